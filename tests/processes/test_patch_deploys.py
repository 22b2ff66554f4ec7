"""Deploying a changed workflow under in-flight runs, with real worker processes: a worker runs
the old code, is stopped, and one running the code with `ctx.patched` takes over; later a
worker whose code dropped the old branch. Runs past the change finish on the old path, runs
before it and new runs on the new one; `manage.py durable_patches` says when the old branch can
go, and removing it then fails nothing.

On the `db` stack (SQLite and, with DATABASE_URL set, PostgreSQL) and on `redis` + `rq`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from durable_flow import send_signal, start
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from tests.conftest import ROOT, ManagedProcess, database_env, wait_for
from tests.patched_workflows import PATCH_ID

pytestmark = pytest.mark.django_db(transaction=True)

WORKFLOW = "tests.patched_flow"
TIMEOUT = 120


def _waiting_for(run_ids: list[str], key: str) -> Callable[[], bool]:
    """Every run waits at its signal call `key` (2: `go`, 4: `finish`)."""
    waits = StepCheckpoint.objects.filter(
        run_id__in=run_ids, key=key, kind=StepKind.SIGNAL, status=StepStatus.DISPATCHED
    )
    return lambda: waits.count() == len(run_ids)


def _release(run_ids: list[str], signal: str, key: str, worker: ManagedProcess) -> None:
    """Send `signal` to each run and wait until all wait at `key` after it."""
    for run_id in run_ids:
        send_signal(run_id, signal)
    wait_for(_waiting_for(run_ids, key), timeout=TIMEOUT, what=f"{run_ids} at call {key}; log {worker.log_path}")


def _finish(run_ids: list[str], worker: ManagedProcess) -> dict[str, Any]:
    for run_id in run_ids:
        send_signal(run_id, "finish")
    runs = WorkflowRun.objects.filter(pk__in=run_ids)
    wait_for(
        lambda: runs.filter(status__in=(RunStatus.COMPLETED, RunStatus.FAILED)).count() == len(run_ids),
        timeout=TIMEOUT,
        what=f"{run_ids} to finish; log {worker.log_path}",
    )
    return {run.id: (run.status, run.output) for run in runs}


def _patches_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`manage.py durable_patches --patch <id>` in its own process."""
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "durable_patches", "--patch", PATCH_ID],
        cwd=ROOT,
        env=database_env(env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_a_patched_deploy_under_in_flight_runs_keeps_each_run_on_its_path(
    stack: dict[str, str],
    spawn: Callable[..., ManagedProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {**stack, "DURABLE_FLOW_EXTRA_WORKFLOWS": "tests.patched_workflows"}

    def deploy(code: str) -> ManagedProcess:
        monkeypatch.setenv("DURABLE_FLOW_TEST_PATCH", code)  # this process, too, runs that code
        return spawn("durable_worker", "--concurrency", "4", env={**env, "DURABLE_FLOW_TEST_PATCH": code})

    # The old code: two runs get past the change (they wait for `finish`), two wait before it.
    worker = deploy("old")
    past = [start(WORKFLOW, n, run_id=f"past-{n}").id for n in (1, 2)]
    before = [start(WORKFLOW, n, run_id=f"before-{n}").id for n in (10, 20)]
    wait_for(_waiting_for(past + before, "2"), timeout=TIMEOUT, what=f"runs at `go`; log {worker.log_path}")
    _release(past, "go", "4", worker)
    assert worker.terminate() == 0  # a graceful stop: what a deploy does

    # The patched code takes over; a new run starts under it.
    worker = deploy("patched")
    new = [start(WORKFLOW, 100, run_id="new-100").id]
    _release(before + new, "go", "4", worker)
    check = _patches_check(env)
    # The runs past the change have not been replayed by the new code: they may need the old branch.
    assert check.returncode == 1, check.stdout + check.stderr
    assert "keep the old branch" in check.stdout and "past-1" in check.stdout and "past-2" in check.stdout
    finished = _finish(past, worker)
    assert finished == {
        "past-1": (RunStatus.COMPLETED, {"path": "old", "second": 3}),
        "past-2": (RunStatus.COMPLETED, {"path": "old", "second": 4}),
    }
    late = [start(WORKFLOW, 1000, run_id="late-1000").id]  # created after the deploy: never counted
    wait_for(_waiting_for(late, "2"), timeout=TIMEOUT, what=f"the late run at `go`; log {worker.log_path}")
    check = _patches_check(env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "removable" in check.stdout
    assert worker.terminate() == 0

    # The old branch and the `patched` call removed: every run in flight finishes, on the new path.
    worker = deploy("removed")
    _release(late, "go", "4", worker)
    fresh = [start(WORKFLOW, 5, run_id="fresh-5").id]
    _release(fresh, "go", "4", worker)
    finished = _finish(before + new + late + fresh, worker)
    assert finished == {
        "before-10": (RunStatus.COMPLETED, {"path": "new", "second": 22}),
        "before-20": (RunStatus.COMPLETED, {"path": "new", "second": 42}),
        "new-100": (RunStatus.COMPLETED, {"path": "new", "second": 202}),
        "late-1000": (RunStatus.COMPLETED, {"path": "new", "second": 2002}),
        "fresh-5": (RunStatus.COMPLETED, {"path": "new", "second": 12}),
    }
    markers = dict(StepCheckpoint.objects.filter(kind=StepKind.PATCH).values_list("run_id", "output"))
    assert markers == {"past-1": False, "past-2": False, "before-10": True, "before-20": True, "new-100": True}
