"""The start window: a granted step's start is counted in its queue's rate window right before
the call, in the worker that runs it, waiting there until the window has room.

The admission window already paces grants, so the wait is at most the transport's jitter. A
call that follows its count by more than the window's margin (`start_margins`) is counted again.
An outage of the admission backend is waited out: the step has not started, so it is not the
step's failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import close_old_connections, transaction

from durable_flow.engine.start_margins import StartMargins
from durable_flow.models import StepCheckpoint
from durable_flow.store.outage import Outage, transient_errors

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.engine.base import Clock

logger = logging.getLogger("durable_flow.engine")

#: How many times a start counted longer ago than its window's margin is counted again before
#: the step is called anyway (each late count uses up a place in the window).
LATE_START_RECOUNTS = 2


class StartWindow:
    """Counts a step's start in its queue's rate window. Owns each queue's start margin and
    the outage log of the wait."""

    def __init__(self, admission: AdmissionBackend, clock: Clock, sleep: Callable[[float], None]) -> None:
        """`sleep` is how a worker waits for the window to have room (tests replace it)."""
        self.admission = admission
        self.clock = clock
        self.sleep = sleep
        self.margins = StartMargins()
        #: The wait riding out an outage of the admission backend, logged once per outage.
        self.outage = Outage("admission: counting a step's start", logger)

    def await_start_through_outages(self, cp: StepCheckpoint) -> None:
        """`await_start`, waiting out an outage of the admission backend (Redis, or the database
        for `db`) with backoff: the step has not started, so the backend being down is not the
        step's failure and must not spend one of its attempts (or fail its run)."""
        while True:
            try:
                self.await_start(cp)
            except transient_errors() as exc:
                self.sleep(self.outage.failed(exc))
                if not transaction.get_connection().in_atomic_block:
                    close_old_connections()  # a connection the database dropped is reopened
                continue
            self.outage.recovered()
            return

    def await_start(self, cp: StepCheckpoint) -> None:
        """A granted step is about to run: count its start in its queue's rate window, waiting
        in this worker until the window has room. The admission window already paces grants,
        so the wait is at most the transport's jitter (bounded by one period).

        The count happened after the backend told this worker it was about to read its clock
        (`on_count`, after any lock it waited for), and at most half the window's margin before
        that moment (`windows.start_mark`), so a step called within the other half of it is within
        the margin of its count (`start_margins`). One called later
        (the worker was descheduled, the backend slow to answer) is counted again: the late
        count stays in the window as a start that never ran, erring on the safe side."""
        margin_ms = self.margins.ms(cp.queue)
        sent = self.clock()

        def counting() -> None:
            nonlocal sent
            sent = self.clock()

        for attempt in range(1, LATE_START_RECOUNTS + 2):
            sent = self.clock()
            while (wait_ms := self.admission.try_start(cp.queue, cp.ticket, cp.fairness_key, on_count=counting)) > 0:
                self.sleep(wait_ms / 1000)
                sent = self.clock()
            late_ms = (self.clock() - sent).total_seconds() * 1000
            if margin_ms is None or late_ms <= margin_ms:
                return
            again = attempt <= LATE_START_RECOUNTS
            logger.log(
                logging.INFO if again else logging.WARNING,
                "start of %s on %r: %.0f ms after its count (%d ms allowed); %s",
                cp.ticket,
                cp.queue,
                late_ms,
                margin_ms,
                "counting it again" if again else "calling it anyway",
            )
