"""Step concurrency with real `db` workers and a poller (SQLite, or PostgreSQL with
DATABASE_URL), and with real RQ workers on `redis` admission: limits hold from the stamps the
steps write, per key, across processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from durable_flow import start
from durable_flow.engine import get_engine
from durable_flow.models import RunStatus, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.reliability.evidence import max_overlap
from tests.support.redis_keys import delete_keys
from tests.support.workers import read_intervals, run_workers


@pytest.fixture(autouse=True)
def forget_resources(stack: dict[str, str]) -> None:
    """Drop step-concurrency keys an earlier session of this test id may have left in Redis."""
    if stack["DURABLE_FLOW_ADMISSION"] != "redis":
        return
    backend = get_engine().admission
    client, prefix = backend.redis, backend.prefix  # type: ignore[attr-defined]
    delete_keys(client, f"{prefix}:res:*", f"{prefix}:q::*")


def intervals_of(marker: Path, prefix: str) -> list[tuple[float, float]]:
    """The step executions whose id starts with `prefix`, from their own stamps."""
    stamps = read_intervals_by_id(marker)
    return [interval for step_id, interval in stamps if step_id.startswith(prefix)]


def read_intervals_by_id(marker: Path) -> list[tuple[str, tuple[float, float]]]:
    opened: dict[tuple[str, str], float] = {}
    out: list[tuple[str, tuple[float, float]]] = []
    for line in marker.read_text().splitlines():
        name, value, pid, at = line.split()
        if name == "slow_start":
            opened[(value, pid)] = float(at)
        elif name == "slow_end":
            out.append((value, (opened.pop((value, pid)), float(at))))
    return out


def all_completed(runs: list[str], timeout: float, what: str) -> None:
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() == len(runs),
        timeout=timeout,
        what=what,
    )


def test_two_accounts_never_exceed_their_limit_and_run_side_by_side(
    stack: dict[str, str],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
) -> None:
    """Two accounts x 20 one-step runs of 0.2 s under a limit of 2 per account."""
    marker = tmp_path / "marker"
    runs = [
        start("sc.per_account", {"account": acct, "seconds": 0.2, "id": f"{acct}-{i}"}).id
        for i in range(20)
        for acct in ("a", "b")
    ]
    run_workers(spawn, {**stack, "DURABLE_FLOW_TEST_MARKER": str(marker)})
    all_completed(runs, 240, "40 runs of two accounts to complete")
    a, b = intervals_of(marker, "a-"), intervals_of(marker, "b-")
    assert len(a) == len(b) == 20
    assert max_overlap(a) <= 2 and max_overlap(b) <= 2
    # Both accounts' steps executed at the same time: one account's backlog did not hold up the other.
    assert max_overlap(a + b) >= 3


def test_parallel_steps_of_one_run_never_exceed_the_limit(
    stack: dict[str, str],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
) -> None:
    marker = tmp_path / "marker"
    run = start("sc.fan", {"seconds": 0.2, "id": "fan"}).id
    run_workers(spawn, {**stack, "DURABLE_FLOW_TEST_MARKER": str(marker)})
    all_completed([run], 180, "the fan-out run to complete")
    intervals = read_intervals(marker)
    assert len(intervals) == 10
    assert max_overlap(intervals) <= 3


def test_runs_that_sleep_free_their_slot(
    stack: dict[str, str],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
) -> None:
    marker = tmp_path / "marker"
    runs = [start("sc.sleeper", {"seconds": 0.05, "id": f"s{i}", "sleep": 1}).id for i in range(100)]
    run_workers(spawn, {**stack, "DURABLE_FLOW_TEST_MARKER": str(marker)})
    all_completed(runs, 400, "100 sleeping runs to complete")
    intervals = read_intervals(marker)
    assert len({step_id for step_id, _ in read_intervals_by_id(marker)}) == 200  # two steps a run
    assert max_overlap(intervals) <= 10


def test_two_constraints_hold_together_across_processes(
    stack: dict[str, str],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
) -> None:
    marker = tmp_path / "marker"
    runs = [
        start("sc.two", {"account": acct, "seconds": 0.2, "id": f"{acct}-{i}"}).id
        for i in range(6)
        for acct in ("a", "b", "c", "d")
    ]
    run_workers(spawn, {**stack, "DURABLE_FLOW_TEST_MARKER": str(marker)})
    all_completed(runs, 240, "24 runs under two constraints to complete")
    every: list[Any] = []
    for acct in "abcd":
        mine = intervals_of(marker, f"{acct}-")
        assert max_overlap(mine) <= 2
        every += mine
    assert len(every) == 24 and max_overlap(every) <= 5
