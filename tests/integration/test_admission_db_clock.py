"""The `db` backend reads its clock after it holds the queue's lock (issue 9, bug 3).

A decision that waited for the lock used to stamp its rate-window mark with the time it
started waiting, so the window reopened early by as long as it had waited. The verdict here
waits on events, not on timing margins: the lock holder releases only after the waiting
decision has either read its clock (the bug) or had ample chance to.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.queues import QueueConfig, RateLimit
from durable_flow.models import AdmissionMark, FlowQueue

pytestmark = pytest.mark.django_db(transaction=True)


class RecordingClock:
    """The wall clock, noting when it is first read."""

    def __init__(self) -> None:
        self.read = threading.Event()

    def __call__(self) -> int:
        self.read.set()
        return time.time_ns() // 1_000_000


def test_a_decision_that_waited_for_the_lock_marks_the_window_when_it_got_it() -> None:
    config = QueueConfig(name="clocked", rate_limit=RateLimit(limit=1, period_ms=2_000, algorithm="sliding"))
    FlowQueue.objects.create(name=config.name, config=config.as_dict())
    clock = RecordingClock()
    backend = DatabaseAdmissionBackend(clock=clock)
    backend.register(config)
    decisions = []

    def decide() -> None:
        try:
            decisions.append(backend.try_admit(AdmissionRequest(queue="clocked", ticket="run/1")))
        finally:
            connection.close()

    with transaction.atomic():
        # Hold the queue row (SQLite: the whole database, IMMEDIATE) while the decision starts.
        list(FlowQueue.objects.select_for_update().filter(name="clocked"))
        waiter = threading.Thread(target=decide)
        waiter.start()
        clock.read.wait(timeout=3)
        read_while_locked_out = clock.read.is_set()
        released_ms = time.time_ns() // 1_000_000
    waiter.join(30)

    assert not read_while_locked_out, "the decision read its clock before it held the queue lock"
    assert decisions and decisions[0].admitted
    mark = AdmissionMark.objects.get(queue="clocked")
    assert mark.at_ms >= released_ms
