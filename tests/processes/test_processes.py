"""Real processes: `durable_worker` killed with SIGKILL mid-step, `durable_poller` killed and
restarted, and two pollers racing over the same due runs on PostgreSQL.

Each test shares its database with `manage.py` subprocesses (see `spawn` in conftest), so it
uses `transactional_db`: what the test writes is committed and visible to them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, Task, TaskKind, WorkflowRun
from tests.conftest import ManagedProcess, wait_for

RECORDING_TRANSPORT = "tests.engine_support.RecordingDatabaseTransport"

postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="SKIP LOCKED between pollers: runs in the PostgreSQL pass"
)


def marker_lines(marker: Path) -> list[list[str]]:
    return [line.split() for line in marker.read_text().splitlines()] if marker.exists() else []


def park_runs(count: int, first_due_in_s: float, spread_s: float) -> list[str]:
    """Suspended runs coming due evenly over `spread_s` seconds from `first_due_in_s` from now."""
    now = timezone.now()
    runs = [
        WorkflowRun(
            id=f"parked-{i:05d}",
            workflow="tests.sleeper",
            input=1,
            status=RunStatus.SUSPENDED,
            wake_at=now + timedelta(seconds=first_due_in_s + spread_s * i / count),
        )
        for i in range(count)
    ]
    WorkflowRun.objects.bulk_create(runs, batch_size=1000)
    return [run.id for run in runs]


def woken_by(marker: Path) -> Counter[str]:
    """How many times each run was woken, from the recording transport's marker lines."""
    return Counter(parts[1] for parts in marker_lines(marker) if parts[0] == "woke")


@pytest.mark.parametrize("optimistic", [True, False], ids=["optimistic-first-step", "locked"])
def test_worker_killed_mid_step_loses_nothing_and_the_run_completes_after_restart(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess], tmp_path: Path, optimistic: bool
) -> None:
    """Optimistic (the default): the killed worker wrote nothing, so its turn task, given up
    by the poller, is claimed a second time and takes the locked path: the step's first
    recorded attempt is the restarted worker's. Locked: the step was written as dispatched,
    and the restarted worker's run of it is attempt 2."""
    marker = tmp_path / "marker"
    env = {
        "DURABLE_FLOW_TRANSPORT": "db",
        "DURABLE_FLOW_TEST_MARKER": str(marker),
        "DURABLE_FLOW_OPTIMISTIC_FIRST_STEP": "1" if optimistic else "0",
    }
    payload = {"id": "killed", "seconds": 2.0}
    run = start("tests.slow_one", payload)
    spawn("durable_poller", env=env)
    worker = spawn("durable_worker", "--concurrency", "2", env=env)
    wait_for(lambda: ["slow_start", "killed"] in [p[:2] for p in marker_lines(marker)], what="the step to start")
    worker.kill()  # SIGKILL, mid-step
    assert worker.proc.returncode == -9
    run.refresh_from_db()
    assert run.status == (RunStatus.PENDING if optimistic else RunStatus.RUNNING)
    assert StepCheckpoint.objects.filter(run=run).exists() is not optimistic
    spawn("durable_worker", "--concurrency", "2", env=env)
    wait_for(
        lambda: WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED, timeout=120, what="run to complete"
    )
    events = Counter(parts[0] for parts in marker_lines(marker))
    assert events == {"slow_start": 2, "slow_end": 1}  # re-executed once more, finished once
    starters = [parts[2] for parts in marker_lines(marker) if parts[0] == "slow_start"]
    assert starters[0] != starters[1]  # the second run of the body was on the restarted worker
    run.refresh_from_db()
    assert run.output == payload
    (cp,) = StepCheckpoint.objects.filter(run=run)
    attempt = 1 if optimistic else 2
    assert (cp.status, cp.attempt, cp.output, cp.late_result) == (StepStatus.COMPLETED, attempt, payload, None)


def test_a_poller_killed_and_restarted_wakes_every_due_run_once(
    transactional_db: None, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    env = {"DURABLE_FLOW_TRANSPORT": RECORDING_TRANSPORT, "DURABLE_FLOW_TEST_MARKER": str(marker)}
    run_ids = park_runs(400, first_due_in_s=1.0, spread_s=4.0)
    all_due_at = timezone.now() + timedelta(seconds=5.0)
    poller = spawn("durable_poller", "--batch-size", "20", env=env)
    wait_for(lambda: len(woken_by(marker)) >= 20, what="the first poller to wake some runs")
    poller.kill()
    time.sleep(max(0.0, (all_due_at - timezone.now()).total_seconds()))
    # What the first poller committed is the database's to say: a marker line is written after
    # its wake's commit, so the SIGKILL may land between the two (a batch's lines lost at most).
    woken_before = WorkflowRun.objects.exclude(status=RunStatus.SUSPENDED).count()
    lost_lines = woken_before - len(woken_by(marker))
    assert 0 <= lost_lines <= 20
    assert woken_before < len(run_ids), "the poller was killed too late to prove anything"
    suspended = WorkflowRun.objects.filter(status=RunStatus.SUSPENDED, wake_at__lte=timezone.now()).count()
    assert suspended == len(run_ids) - woken_before  # due, and nobody is waking them
    spawn("durable_poller", "--batch-size", "20", env=env)
    # The marker line of a wake is written on commit, after its run is seen woken: wait for both.
    wait_for(
        lambda: (
            not WorkflowRun.objects.filter(status=RunStatus.SUSPENDED).exists()
            and len(woken_by(marker)) == len(run_ids) - lost_lines
        ),
        what="every due run to be woken",
    )
    assert set(woken_by(marker).values()) == {1}  # no run woken twice by the two pollers
    assert Task.objects.filter(kind=TaskKind.TURN).count() == len(run_ids)  # each woken exactly once


@postgresql_only
def test_two_pollers_looping_on_postgresql_wake_every_run_exactly_once(
    transactional_db: None, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    """Runs come due over 3 s while both pollers tick every 100 ms, so they contend for the same
    rows; each committed wake is recorded with the waking process's pid."""
    marker = tmp_path / "marker"
    env = {"DURABLE_FLOW_TRANSPORT": RECORDING_TRANSPORT, "DURABLE_FLOW_TEST_MARKER": str(marker)}
    run_ids = park_runs(2000, first_due_in_s=2.0, spread_s=3.0)
    pollers = [spawn("durable_poller", "--batch-size", "50", env=env) for _ in range(2)]
    wait_for(lambda: len(woken_by(marker)) == len(run_ids), timeout=60, what="all runs to be woken")
    time.sleep(0.5)  # a double wake would land now
    woken = woken_by(marker)
    assert set(woken) == set(run_ids)
    assert max(woken.values()) == 1, [run for run, n in woken.items() if n > 1][:10]
    by_pid = Counter(parts[2] for parts in marker_lines(marker))
    assert {str(p.proc.pid) for p in pollers} == set(by_pid), f"both pollers must take part: {by_pid}"
    assert not WorkflowRun.objects.exclude(status=RunStatus.PENDING).exists()


@postgresql_only
def test_two_once_pollers_on_postgresql_report_disjoint_sets_covering_all_due_runs(
    transactional_db: None, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    run_ids = park_runs(2000, first_due_in_s=-10.0, spread_s=5.0)
    reports = [tmp_path / f"report-{n}.json" for n in range(2)]
    env = {"DURABLE_FLOW_TRANSPORT": "db"}
    pollers = [
        spawn("durable_poller", "--once", "--batch-size", "10", "--report", str(report), env=env) for report in reports
    ]
    for poller in pollers:
        assert poller.proc.wait(60) == 0, poller.output()
    first, second = (json.loads(report.read_text()) for report in reports)
    assert len(first) == len(set(first)) and len(second) == len(set(second))
    assert not set(first) & set(second)
    assert set(first) | set(second) == set(run_ids)
