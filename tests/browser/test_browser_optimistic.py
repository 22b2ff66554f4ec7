"""An optimistic first step (`engine/optimistic.py`, the `rq` default) seen in a real headless
Chromium: while it runs nothing of it is in the run's rows, and the run's page shows it under
"Executing now" from its worker's heartbeat, its turns row "running". (A step the rows record is
listed without the "not recorded yet" note: tests/integration/test_dashboard_runs.py.) A real daphne server,
a real `durable_worker` on RQ and Redis."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, WorkerHeartbeat
from tests.conftest import ManagedProcess, wait_for
from tests.support.browser import login, shoot
from tests.support.rq import OPTIMISTIC, marks, run_status, worker


def test_a_running_optimistic_first_step_is_on_its_runs_page(
    rq_engine: Engine,
    server: str,
    browser: Any,
    spawn: Callable[..., ManagedProcess],
    marker: Path,
) -> None:
    runner = worker(spawn, marker, "--concurrency", "2", env=OPTIMISTIC)
    run = start("tests.slow_one", {"id": "seen", "seconds": 30.0})
    wait_for(lambda: marks(marker, "slow_start"), timeout=60, what="the slow step to start")
    assert not StepCheckpoint.objects.filter(run=run).exists()  # nothing written while it runs
    assert run_status(run.id) == RunStatus.PENDING
    for width in (1400, 420):
        page = login(browser, server, width)

        # The heartbeat lists the step from the worker's next beat: reload until it does.
        def shown(page: Any = page) -> bool:
            page.goto(f"{server}/dashboard/runs/{run.id}/")
            return page.query_selector("#executing-now") is not None

        wait_for(shown, timeout=30, interval=0.5, what="the step on the run's page")
        text = page.inner_text("#executing-now")
        assert text.startswith("step 1, attempt 1, on worker ") and "not recorded yet" in text
        worker_id = WorkerHeartbeat.objects.get(pid=runner.proc.pid).worker_id
        assert f"on worker {worker_id} " in text  # the worker that runs it
        assert page.inner_text("#run-status") == "pending"
        turns = page.inner_text('#timeline .tl-row[data-key=""]')
        assert "running" in turns and "first step is executing" in turns  # not "waiting"
        shoot(page, "dashboard-run-executing")
        page.close()
