"""Helpers for the engine-core tests: a transport the test drives by hand, and a `db` transport
that records each committed wake in the marker file (for poller processes).

`ManualTransport` holds turns and step attempts until the test runs them, so a test can put
the engine in states the inline transport never reaches: a step still executing when the run
is cancelled, a job the broker lost, an attempt answering after its timeout.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from durable_flow.admission.base import OnCount
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.admission.rules.windows import start_key
from durable_flow.config.settings import DurableFlowSettings
from durable_flow.engine import Engine
from durable_flow.models import AdmissionStart
from durable_flow.transports.base import Transport
from durable_flow.transports.db.transport import DatabaseTransport
from tests.conftest import MovableClock, local_engine


@dataclass(frozen=True)
class StepJob:
    """One step attempt the engine sent to the transport."""

    run_id: str
    key: str
    attempt: int
    priority: int


class ManualTransport(Transport):
    """Queues work on commit (like a real broker) and runs it only when the test says so."""

    name = "manual"

    def __init__(self) -> None:
        self.turns: list[str] = []
        self.steps: list[StepJob] = []
        self.engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def enqueue_turn(self, run_id: str) -> None:
        transaction.on_commit(lambda: self.turns.append(run_id))

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        job = StepJob(run_id, step_key, attempt, priority)
        transaction.on_commit(lambda: self.steps.append(job))

    def run_turns(self) -> int:
        """Run every queued turn (and the turns those queue); return how many ran."""
        assert self.engine is not None
        count = 0
        while self.turns:
            self.engine.run_turn(self.turns.pop(0))
            count += 1
        return count

    def take(self, key: str | None = None, run_id: str | None = None) -> StepJob:
        """Remove and return the first queued step attempt matching `key`/`run_id`."""
        for index, job in enumerate(self.steps):
            if (key is None or job.key == key) and (run_id is None or job.run_id == run_id):
                return self.steps.pop(index)
        raise AssertionError(f"no queued step matches key={key!r} run_id={run_id!r}; queued: {self.steps}")

    def execute(self, job: StepJob) -> str:
        """Run one attempt on "this worker", as `durable_worker` would."""
        assert self.engine is not None
        return self.engine.execute_step(job.run_id, job.key, job.attempt, worker_id="manual")

    def run_all(self, *, on_step: Callable[[StepJob], None] | None = None, limit: int = 10_000) -> None:
        """Run turns and steps (oldest first) until nothing is queued; `on_step` sees each step first."""
        for _ in range(limit):
            self.run_turns()
            if not self.steps:
                return
            job = self.steps.pop(0)
            if on_step is not None:
                on_step(job)
            self.execute(job)
        raise AssertionError("work kept coming; a loop in the engine?")


def transport_of(engine: Engine) -> ManualTransport:
    """The `ManualTransport` of an engine from the `manual` fixture."""
    assert isinstance(engine.transport, ManualTransport)
    return engine.transport


def manual_engine(clock: MovableClock, settings: DurableFlowSettings | None = None) -> Engine:
    """An engine on a `ManualTransport`, for tests that need their own settings."""
    return local_engine(clock, ManualTransport(), settings)


class RecordingDatabaseTransport(DatabaseTransport):
    """The `db` transport, plus one marker line per committed turn wake: `woke <run_id> <pid>`.

    Used as `DURABLE_FLOW_TRANSPORT=tests.engine_support.RecordingDatabaseTransport` by poller
    processes, so a test can see which process woke which run, and that none was woken twice.
    Written on commit, so a tick that was rolled back (or killed) records nothing.
    """

    def enqueue_turn(self, run_id: str) -> None:
        super().enqueue_turn(run_id)
        marker = os.environ.get("DURABLE_FLOW_TEST_MARKER")
        if marker:
            transaction.on_commit(lambda: _append(marker, f"woke {run_id} {os.getpid()}\n"))


def _append(path: str, line: str) -> None:
    with open(path, "a") as handle:
        handle.write(line)


class RecordingDatabaseAdmission(DatabaseAdmissionBackend):
    """`db` admission that records, after every start it counts, the instant it counted it at
    (with the call's key) and the queue's start marks then held.

    Used (through `DURABLE_FLOW_RECORD_STARTS=1`, see settings.test) by worker processes, so a test
    judges a rate limit or a throttle by the backend's own instants, on its own clock, instead of
    by the stamps steps write a scheduling delay later. A mark lives a period before it is pruned,
    so the marks read after each count, together, are every start counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read = threading.local()

    def _now(self) -> int:
        self._read.ms = super()._now()
        return self._read.ms

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        self._read.ms = None
        wait_ms = super().try_start(queue, ticket, key, on_count=on_count)
        if wait_ms == 0 and self._read.ms is not None:  # counted (not a queue with nothing to count)
            marks = AdmissionStart.objects.filter(queue=queue).values_list("pk", "at_ms")
            _record(queue, start_key(ticket, key), self._read.ms, [(str(pk), at_ms) for pk, at_ms in marks])
        return wait_ms


class RecordingRedisAdmission(RedisAdmissionBackend):
    """`redis` admission, recording every start it counts as `RecordingDatabaseAdmission` does."""

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        if on_count is not None:
            on_count()
        wait_ms, now_ms = self.try_start_timed(queue, ticket, key)
        if wait_ms == 0:
            marks = self.redis.zrange(f"{self.prefix}:q:{queue}:starts", 0, -1, withscores=True)
            _record(queue, start_key(ticket, key), now_ms, [(_text(member), int(score)) for member, score in marks])
        return wait_ms


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _record(queue: str, key: str, at_ms: int, marks: list[tuple[str, int]]) -> None:
    marker = os.environ.get("DURABLE_FLOW_TEST_MARKER")
    if marker:
        # Four fields, as every marker line: what, queue, key or mark id @ ms, pid.
        lines = [f"started {queue} {key}@{at_ms} {os.getpid()}\n"]
        lines += [f"counted {queue} {ident}@{mark_ms} {os.getpid()}\n" for ident, mark_ms in marks]
        _append(marker, "".join(lines))


def counted_at(marker: str | os.PathLike[str], queue: str) -> dict[str, list[int]]:
    """Per call key, the instants (ms, ascending) a recording admission backend counted its
    starts in `queue` at."""
    counted: dict[str, list[int]] = {}
    with open(marker) as handle:
        for line in handle:
            what, where, entry, _ = line.split()
            if what == "started" and where == queue:
                key, at_ms = entry.rsplit("@", 1)
                counted.setdefault(key, []).append(int(at_ms))
    return {key: sorted(instants) for key, instants in counted.items()}


def counted_starts(marker: str | os.PathLike[str], queue: str) -> list[int]:
    """Every start mark a recording admission backend held in `queue` (ms, ascending)."""
    marks: dict[str, int] = {}
    with open(marker) as handle:
        for line in handle:
            what, where, mark, _ = line.split()
            if what == "counted" and where == queue:
                ident, at_ms = mark.rsplit("@", 1)
                marks[ident] = int(at_ms)
    return sorted(marks.values())


def most_within(instants: list[int], period_ms: int) -> int:
    """The most of the ascending `instants` (ms) in any trailing period (ms - period_ms, ms]."""
    return max(
        (bisect.bisect_right(instants, ms) - bisect.bisect_right(instants, ms - period_ms) for ms in instants),
        default=0,
    )
