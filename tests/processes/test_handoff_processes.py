"""Handoff with real worker and poller processes: parked runs take no turns while they wait,
and a rate limit holds where the step starts, from the start marks the backend counted.

Two stacks: `db` admission + `db` transport (SQLite, or PostgreSQL with DATABASE_URL), and
`redis` admission + `rq` transport with real RQ workers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from durable_flow import register_queue, start
from durable_flow.models import RunStatus, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.engine_support import counted_starts, most_within
from tests.reliability.evidence import max_overlap
from tests.support.workers import read_intervals, run_workers, unique


def starts(marker: Path) -> list[float]:
    """When each step was called, as the step itself stamped it."""
    return sorted(begin for begin, _ in read_intervals(marker))


def test_parked_runs_take_no_turns_while_they_wait(
    stack: dict[str, str], spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    """40 one-step runs over 4 fairness keys through a cap of 2: every run is one turn to park,
    a grant to dispatch, one turn after the result, however long it waited."""
    marker = tmp_path / "marker"
    queue = unique("render")
    register_queue(queue, concurrency=2, fairness="key", retry_ms=100)
    runs = [
        start("tests.queued", {"queue": queue, "seconds": 0.05, "id": i, "key": f"tenant-{i % 4}"}).id
        for i in range(40)
    ]
    run_workers(spawn, {**stack, "DURABLE_FLOW_TEST_MARKER": str(marker)})
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() == 40,
        timeout=180,
        what="40 queued runs to complete",
    )
    turns = list(WorkflowRun.objects.filter(pk__in=runs).values_list("turns", flat=True))
    assert max(turns) <= 3, f"turns per run: {sorted(turns)}"
    assert max_overlap(read_intervals(marker)) <= 2


@pytest.mark.parametrize("algorithm", ["sliding", "fixed"])
def test_the_rate_limit_holds_at_step_start(
    stack: dict[str, str], spawn: Callable[..., ManagedProcess], tmp_path: Path, algorithm: str
) -> None:
    """5 per second: never more than 5 step starts counted in any trailing second (sliding) or
    any aligned second (fixed), judged by the instants the backend counted them at (on its own
    clock, recorded by the worker processes), with transport delays between admission and start;
    every step ran once."""
    marker = tmp_path / "marker"
    queue = unique("api")
    register_queue(queue, rate_limit={"limit": 5, "period_ms": 1000, "algorithm": algorithm})
    runs = [start("tests.queued", {"queue": queue, "seconds": 0.01, "id": i}).id for i in range(25)]
    run_workers(spawn, {**stack, "DURABLE_FLOW_TEST_MARKER": str(marker), "DURABLE_FLOW_RECORD_STARTS": "1"})
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() == 25,
        timeout=180,
        what="25 rate-limited runs to complete",
    )
    assert len(starts(marker)) == 25
    counted = counted_starts(marker, queue)
    # A start the worker found itself late for is counted again: a count that never ran.
    assert len(counted) >= 25, counted
    if algorithm == "sliding":
        assert most_within(counted, 1000) <= 5, counted
    else:
        assert max(Counter(ms // 1000 for ms in counted).values()) <= 5, counted
    turns = list(WorkflowRun.objects.filter(pk__in=runs).values_list("turns", flat=True))
    assert max(turns) <= 3, f"turns per run: {sorted(turns)}"
