"""Which exceptions raised out of a step's or a workflow's code are that code's failure.

Every one, whatever its class: a `SystemExit`, a `KeyboardInterrupt`, a `GeneratorExit`, an
`asyncio.CancelledError` or a `BaseException` of the user's own ends the attempt (or the run) as
an `Exception` does, recorded with its type and traceback and retried by the step's policy.
Left to propagate, it would leave the run's task to be delivered again at every lease's end,
forever, with nothing logged. Two kinds are not the code's:

- the engine's own unwinding (`Unwind`: a turn's `Suspend`, ...), which passes through user
  code by design;
- a real signal's. Python runs signal handlers on the main thread only, and a worker's (SIGTERM,
  SIGINT) raise nothing: they stop it gracefully. So on a worker's threads every exception is
  the code's. On a main thread (the inline transport in a script, a shell, a web server's
  process) a handler may raise into the step: Python's own SIGINT handler raises
  `KeyboardInterrupt` (Ctrl-C), any other handler raises from its own frame. Those stop the
  program, as they always did: a `KeyboardInterrupt` the code raises itself on a main thread
  where Ctrl-C raises one too is taken for Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
import threading
import traceback
from types import CodeType

from durable_flow.engine.turn import Unwind

logger = logging.getLogger("durable_flow.engine")


def is_code_failure(exc: BaseException, what: str = "") -> bool:
    """Whether `exc`, raised out of user code, is that code's failure (see the module's
    docstring); the caller records it, or re-raises it when not. `what` names the code for the
    log: a failure outside `Exception` is logged, as nothing else would say why a step that
    exits or interrupts itself failed."""
    if isinstance(exc, Exception):
        return True
    if isinstance(exc, Unwind) or raised_by_signal(exc):
        return False
    if what:
        logger.warning(
            "%s raised %s (not an Exception): recorded as its failure", what, type(exc).__qualname__, exc_info=exc
        )
    return True


def raised_by_signal(exc: BaseException) -> bool:
    """Whether `exc` came from a signal handler rather than the code it interrupted: on the main
    thread only, a `KeyboardInterrupt` while Python's own SIGINT handler is installed (it has no
    frame of its own to look for), or an exception whose traceback holds the frame of a handler
    installed now."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        return True
    handlers = {code for signum in signal.valid_signals() if (code := _code_of(signal.getsignal(signum)))}
    return any(frame.f_code in handlers for frame, _ in traceback.walk_tb(exc.__traceback__))


def _code_of(handler: object) -> CodeType | None:
    """A Python handler's code (a function's, or a bound method's); None for the rest."""
    function = getattr(handler, "__func__", handler)
    code = getattr(function, "__code__", None)
    return code if isinstance(code, CodeType) else None
