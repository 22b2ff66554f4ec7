"""Every exception raised by a step's or a workflow's code ends its attempt or its run, not only
an `Exception`: a `SystemExit`, a `KeyboardInterrupt`, a `GeneratorExit` or a `BaseException` of
the user's own is recorded like any error (type and traceback), retried by the step's policy, and
the worker serves on. A real signal stays a stop: a worker's SIGTERM/SIGINT is graceful (its
handlers raise nothing into a step), and on a process's main thread an exception a signal handler
raises (Python's own Ctrl-C, a handler of the program's) stops the program as it always did.

In-process on the inline engine, then over real `durable_worker` processes on the `db` and `rq`
transports, on the optimistic first-step path (the default) and the locked one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import django_rq
import pytest
from redis import Redis

from durable_flow import start
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import (
    AttemptStatus,
    RunStatus,
    StepAttempt,
    StepCheckpoint,
    StepStatus,
    Task,
    WorkerHeartbeat,
    WorkflowRun,
)
from durable_flow.runtime.poller import TimerPoller
from durable_flow.transports.rq import RQTransport
from tests.conftest import ManagedProcess, MovableClock, local_engine, wait_for
from tests.support.held import QueuedTurns
from tests.support.workers import RQ_ENV, clear_rq

#: How long a process test waits for a run to settle. Generous: on today's code before the fix
#: the run never settled (its task was redelivered after every lease, forever).
SETTLE_S = 90.0

#: The log line a worker writes for a step whose code raised outside `Exception`.
LOGGED = "raised {kind} (not an Exception): recorded as its failure"


#: The module of each exception the test workflows raise (`tests.workflows.BASE_EXCEPTIONS`).
MODULE_OF = {"SystemExit": "builtins", "KeyboardInterrupt": "builtins", "GeneratorExit": "builtins"}


def type_name(kind: str) -> str:
    """How a recorded error names the exception `kind`."""
    return f"{MODULE_OF.get(kind, 'tests.workflows')}.{kind}"


def attempts(run: WorkflowRun) -> list[StepAttempt]:
    return list(StepAttempt.objects.filter(run=run).order_by("checkpoint_id", "attempt"))


def assert_one_failed_attempt(run: WorkflowRun, kind: str) -> None:
    """The run failed for its step, whose one attempt names the exception's type."""
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "durable_flow.exceptions.StepFailed" and kind in run.error["message"]
    (attempt,) = attempts(run)
    assert attempt.status == AttemptStatus.FAILED and attempt.attempt == 1
    assert attempt.error["type"] == type_name(kind)
    assert f"{kind} from a" in attempt.error["traceback"]


# -- in-process, the inline engine -------------------------------------------------------------


@pytest.fixture
def no_ctrl_c() -> Iterator[None]:
    """SIGINT set to a handler that raises nothing, as a worker's is: a `KeyboardInterrupt` can
    then only be raised by the code that runs."""
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("kind", ["SystemExit", "GeneratorExit", "CustomStop"])
def test_on_the_inline_engine_a_step_raising_a_base_exception_fails_its_one_attempt(engine: Engine, kind: str) -> None:
    run = start("tests.raises_base_flow", kind)
    assert_one_failed_attempt(run, kind)


def test_on_the_inline_engine_a_steps_keyboard_interrupt_fails_it_when_no_signal_raises_one(
    engine: Engine, no_ctrl_c: None
) -> None:
    run = start("tests.raises_base_flow", "KeyboardInterrupt")
    assert_one_failed_attempt(run, "KeyboardInterrupt")


def test_on_the_inline_engine_a_steps_keyboard_interrupt_off_the_main_thread_fails_it(engine: Engine) -> None:
    """Python runs signal handlers on the main thread only: elsewhere the code raised it."""
    started: list[WorkflowRun] = []
    thread = threading.Thread(target=lambda: started.append(start("tests.raises_base_flow", "KeyboardInterrupt")))
    thread.start()
    thread.join(60)
    (run,) = started
    assert_one_failed_attempt(run, "KeyboardInterrupt")


def test_on_the_inline_engine_an_async_steps_system_exit_fails_its_one_attempt(engine: Engine) -> None:
    run = start("tests.raises_base_async_flow", "SystemExit")
    assert_one_failed_attempt(run, "SystemExit")


@pytest.mark.parametrize("after_step", [False, True], ids=["before-any-call", "in-the-inline-turn"])
@pytest.mark.parametrize("kind", ["SystemExit", "CustomStop"])
def test_on_the_inline_engine_a_workflow_raising_a_base_exception_fails_its_run(
    engine: Engine, kind: str, after_step: bool
) -> None:
    run = start("tests.body_raises_base", {"kind": kind, "after_step": after_step})
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == type_name(kind) and f"{kind} from a workflow" in run.error["message"]


def test_on_the_inline_engine_a_step_raising_system_exit_is_retried_by_its_policy(
    engine: Engine, clock: MovableClock, tmp_path: Path
) -> None:
    run = start("tests.exits_once_flow", str(tmp_path / "exited"))
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.status == StepStatus.RETRYING and cp.error["type"] == "builtins.SystemExit"
    clock.advance(seconds=1)
    assert TimerPoller(engine).tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "second time lucky"
    assert [(a.attempt, a.status) for a in attempts(run)] == [(1, AttemptStatus.FAILED), (2, AttemptStatus.COMPLETED)]


def test_an_optimistic_probe_leaves_a_workflows_system_exit_to_the_locked_path(
    clock: MovableClock, transactional_db: None
) -> None:
    """The probe replays the workflow without the run's lock and writes nothing: a body that
    exits before any call is recorded by the locked turn that follows, which fails the run."""
    engine = local_engine(clock, QueuedTurns())
    run = start("tests.body_raises_base", {"kind": "SystemExit"})
    assert engine.run_first_turn(run.id, "w1") is None
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.PENDING
    engine.run_turn(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.error["type"] == "builtins.SystemExit"


@pytest.mark.inline_only("the step runs on the caller's main thread: only the inline transport does that")
def test_a_real_ctrl_c_on_the_main_thread_still_stops_the_program(engine: Engine) -> None:
    """With Python's own SIGINT handler a `KeyboardInterrupt` on the main thread is how Ctrl-C
    arrives: it is not the step's failure, and it carries on up to the caller. The handler is set
    here: a suite started in the background inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_stops_the_program()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_stops_the_program() -> None:
    with pytest.raises(KeyboardInterrupt):
        start("tests.raises_base_flow", "KeyboardInterrupt")
    cp = StepCheckpoint.objects.get(run__workflow="tests.raises_base_flow")
    assert cp.status == StepStatus.DISPATCHED  # left to be re-driven, not failed
    assert not StepAttempt.objects.filter(status=AttemptStatus.FAILED).exists()


@pytest.mark.inline_only("the step runs on the caller's main thread: only the inline transport does that")
def test_an_exception_a_signal_handler_raises_into_a_step_is_not_the_steps_failure(engine: Engine) -> None:
    """A program's handler that exits on a signal (a web server's on SIGQUIT) raises from its own
    frame, on the main thread, in the middle of whatever runs there: a stop, not a failure."""

    def exit_now(signum: int, _: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGUSR1, exit_now)
    try:
        with pytest.raises(SystemExit):
            start("tests.signals_itself_flow", None)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert StepCheckpoint.objects.get(run__workflow="tests.signals_itself_flow").status == StepStatus.DISPATCHED
    assert not StepAttempt.objects.filter(status=AttemptStatus.FAILED).exists()


# -- real worker processes ---------------------------------------------------------------------

PATHS = pytest.mark.parametrize("optimistic", [True, False], ids=["optimistic-first-step", "locked"])


def path_env(optimistic: bool) -> dict[str, str]:
    return {"DURABLE_FLOW_OPTIMISTIC_FIRST_STEP": "1" if optimistic else "0", "DURABLE_FLOW_LOG": "WARNING"}


def settled(run: WorkflowRun, status: str) -> WorkflowRun:
    wait_for(
        lambda: WorkflowRun.objects.get(pk=run.id).status == status, timeout=SETTLE_S, what=f"run {run.id} {status}"
    )
    run.refresh_from_db()
    return run


def assert_serves_on(worker: ManagedProcess) -> None:
    """The same worker process runs a new run to its end."""
    run = settled(start("tests.three_steps", 1), RunStatus.COMPLETED)
    assert worker.proc.poll() is None
    beat = WorkerHeartbeat.objects.get(pid=worker.proc.pid, stopped_at__isnull=True)
    assert {cp.worker for cp in StepCheckpoint.objects.filter(run=run)} == {beat.worker_id}


@pytest.fixture
def db_worker(spawn: Callable[..., ManagedProcess]) -> Callable[..., ManagedProcess]:
    def worker(optimistic: bool, env: dict[str, str] | None = None) -> ManagedProcess:
        env = {"DURABLE_FLOW_TRANSPORT": "db", **path_env(optimistic), **(env or {})}
        return spawn("durable_worker", "--concurrency", "2", env=env)

    return worker


@PATHS
@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt"])
def test_over_db_a_step_raising_a_base_exception_fails_once_and_the_worker_serves_on(
    db_transport_engine: Engine, db_worker: Callable[..., ManagedProcess], kind: str, optimistic: bool
) -> None:
    worker = db_worker(optimistic)
    run = settled(start("tests.raises_base_flow", kind), RunStatus.FAILED)
    assert_one_failed_attempt(run, kind)
    assert not Task.objects.filter(run_id=run.id).exists()  # nothing left to deliver again
    assert_serves_on(worker)
    assert len(attempts(run)) == 1
    assert LOGGED.format(kind=kind) in worker.output()


@PATHS
def test_over_db_a_workflow_raising_system_exit_fails_its_run_and_the_worker_serves_on(
    db_transport_engine: Engine, db_worker: Callable[..., ManagedProcess], optimistic: bool
) -> None:
    worker = db_worker(optimistic)
    run = settled(start("tests.body_raises_base", {"kind": "SystemExit", "after_step": True}), RunStatus.FAILED)
    assert run.error["type"] == "builtins.SystemExit" and "SystemExit from a workflow" in run.error["traceback"]
    assert not Task.objects.filter(run_id=run.id).exists()
    assert_serves_on(worker)
    assert [a.status for a in attempts(run)] == [AttemptStatus.COMPLETED]  # its step, once


@PATHS
def test_over_db_a_step_raising_system_exit_once_is_retried_and_completes(
    db_transport_engine: Engine,
    db_worker: Callable[..., ManagedProcess],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
    optimistic: bool,
) -> None:
    spawn("durable_poller", env={"DURABLE_FLOW_TRANSPORT": "db", **path_env(optimistic)})
    worker = db_worker(optimistic)
    run = settled(start("tests.exits_once_flow", str(tmp_path / "exited")), RunStatus.COMPLETED)
    assert run.output == "second time lucky"
    first, second = attempts(run)
    assert (first.status, first.error["type"], second.status) == (
        AttemptStatus.FAILED,
        "builtins.SystemExit",
        AttemptStatus.COMPLETED,
    )
    assert_serves_on(worker)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_over_db_a_real_signal_mid_step_is_still_a_graceful_stop(
    db_transport_engine: Engine, db_worker: Callable[..., ManagedProcess], tmp_path: Path, signum: int
) -> None:
    """The worker's handlers raise nothing into the step: it finishes, is recorded completed (no
    failed attempt), and the worker exits 0."""
    marker = tmp_path / "marker"
    worker = db_worker(True, {"DURABLE_FLOW_TEST_MARKER": str(marker)})
    run = start("tests.slow_one", {"id": "stop", "seconds": 2.0})
    wait_for(lambda: marker.exists() and "slow_start" in marker.read_text(), timeout=SETTLE_S, what="the step")
    worker.proc.send_signal(signum)
    assert worker.proc.wait(60) == 0
    run = settled(run, RunStatus.COMPLETED)
    assert [(a.attempt, a.status) for a in attempts(run)] == [(1, AttemptStatus.COMPLETED)]
    assert f"received {signal.Signals(signum).name}: stopping" in worker.output()


# -- the rq transport --------------------------------------------------------------------------


@pytest.fixture
def rq_engine(transactional_db: None) -> Iterator[Engine]:
    """This process's engine on the RQ transport, like the workers; RQ's keys cleared around."""
    connection: Redis = django_rq.get_connection("durable")
    assert connection.connection_pool.connection_kwargs.get("db", 0) != 0, "tests never touch Redis database 0"
    clear_rq(connection)
    engine = Engine(
        admission=LocalAdmissionBackend(),
        transport=RQTransport(queue="durable", concurrency=4),
        settings=get_settings(),
    )
    set_engine(engine)
    yield engine
    clear_rq(connection)


@pytest.fixture
def rq_worker(spawn: Callable[..., ManagedProcess]) -> Callable[..., ManagedProcess]:
    def worker(optimistic: bool) -> ManagedProcess:
        return spawn("durable_worker", "--concurrency", "2", env={**RQ_ENV, **path_env(optimistic)})

    return worker


@PATHS
@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt"])
def test_over_rq_a_step_raising_a_base_exception_fails_once_and_the_worker_serves_on(
    rq_engine: Engine, rq_worker: Callable[..., ManagedProcess], kind: str, optimistic: bool
) -> None:
    worker = rq_worker(optimistic)
    run = settled(start("tests.raises_base_flow", kind), RunStatus.FAILED)
    assert_one_failed_attempt(run, kind)
    assert_serves_on(worker)
    assert len(attempts(run)) == 1
    assert LOGGED.format(kind=kind) in worker.output()


@PATHS
def test_over_rq_a_workflow_raising_system_exit_fails_its_run_and_the_worker_serves_on(
    rq_engine: Engine, rq_worker: Callable[..., ManagedProcess], optimistic: bool
) -> None:
    worker = rq_worker(optimistic)
    run = settled(start("tests.body_raises_base", {"kind": "SystemExit", "after_step": True}), RunStatus.FAILED)
    assert run.error["type"] == "builtins.SystemExit"
    assert_serves_on(worker)
    assert [a.status for a in attempts(run)] == [AttemptStatus.COMPLETED]


@PATHS
def test_over_rq_a_step_raising_system_exit_once_is_retried_and_completes(
    rq_engine: Engine,
    rq_worker: Callable[..., ManagedProcess],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
    optimistic: bool,
) -> None:
    spawn("durable_poller", env={**RQ_ENV, **path_env(optimistic)})
    worker = rq_worker(optimistic)
    run = settled(start("tests.exits_once_flow", str(tmp_path / "exited")), RunStatus.COMPLETED)
    assert [(a.attempt, a.status) for a in attempts(run)] == [(1, AttemptStatus.FAILED), (2, AttemptStatus.COMPLETED)]
    assert_serves_on(worker)
