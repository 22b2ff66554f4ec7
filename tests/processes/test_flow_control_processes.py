"""Flow control with real worker and poller processes, for the two exact admission backends:
`db` (the embedded default) and `redis` (fleet-wide).

Runs on SQLite and, with DATABASE_URL set, on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from durable_flow import register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.reliability.evidence import max_overlap
from tests.support.workers import completed, read_intervals, unique


def slots_held(engine: Engine, queue: str) -> int:
    return engine.admission.in_flight(queue)  # type: ignore[attr-defined]


def test_the_cap_holds_across_worker_processes(
    matching_admission_engine: Engine, process_env: dict[str, str], spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    queue = unique("render")
    register_queue(queue, concurrency=3, retry_ms=200)
    runs = [start("tests.queued", {"queue": queue, "seconds": 0.15, "id": i}).id for i in range(30)]
    env = {**process_env, "DURABLE_FLOW_TEST_MARKER": str(marker)}
    for _ in range(3):
        spawn("durable_worker", "--concurrency", "4", env=env)
    spawn("durable_poller", env=env)
    wait_for(lambda: completed(runs), timeout=120, what="30 queued runs to complete")
    intervals = read_intervals(marker)
    assert len(intervals) == 30
    assert max_overlap(intervals) <= 3
    assert max_overlap(intervals) >= 2  # the cap was actually contended, not trivially kept
    assert slots_held(matching_admission_engine, queue) == 0


def test_parked_runs_survive_killing_every_process(
    matching_admission_engine: Engine, process_env: dict[str, str], spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    queue = unique("render")
    register_queue(queue, concurrency=2, retry_ms=300)
    runs = [start("tests.queued", {"queue": queue, "seconds": 0.5, "id": i}).id for i in range(10)]
    env = {**process_env, "DURABLE_FLOW_TEST_MARKER": str(marker)}
    first = [spawn("durable_worker", "--concurrency", "4", env=env) for _ in range(2)]
    first.append(spawn("durable_poller", env=env))
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() >= 2,
        timeout=60,
        what="two runs to complete",
    )
    for process in first:
        process.kill()
    import time

    killed_at = time.time()
    parked = WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.SUSPENDED)
    assert parked.exists()
    # Parked in the queue's waiting line (durably: rows on `db`, keys on Redis), with nothing
    # to poll: grants, or after a crash the restarted poller's re-offer, dispatch them.
    assert all(run.wake_at is None for run in parked)
    assert StepCheckpoint.objects.filter(run__in=parked, status=StepStatus.WAITING).count() == parked.count()
    assert (matching_admission_engine.admission.waiting(queue) or 0) > 0

    for _ in range(2):
        spawn("durable_worker", "--concurrency", "4", env=env)
    spawn("durable_poller", env=env)
    wait_for(lambda: completed(runs), timeout=120, what="every run to complete after the restart")
    assert max_overlap(read_intervals(marker, until=killed_at)) <= 2
    for cp in StepCheckpoint.objects.filter(run_id__in=runs):
        assert cp.status == StepStatus.COMPLETED and not cp.holds_slot
    assert slots_held(matching_admission_engine, queue) == 0
