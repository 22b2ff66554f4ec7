"""The dashboard's Runs, Run detail and Flow pages in a real headless Chromium, against a real
daphne server, a `db` worker and the poller: the tasks a user comes for (find why a run failed
and retry it until it completes, read a timeline, cancel with confirmation, send a signal,
start a workflow, watch a burst flow through a throttled queue). Screenshots at 1400 px and
420 px go to var/screenshots (docs/screenshots with DURABLE_FLOW_SCREENSHOTS=docs/screenshots).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from durable_flow import register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepAttempt, WorkflowRun
from tests.conftest import wait_for
from tests.support.browser import login, shoot, status_of


def test_find_why_a_run_failed_and_retry_it_until_it_completes(
    server: str,
    browser: Any,
    db_workers: Engine,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "config.json"
    run = start("tests.needs_file_flow", {"path": str(gate)}, run_id="import-2026-12")
    wait_for(lambda: status_of(run.id) == RunStatus.FAILED, what="the run to fail")
    for width in (420, 1400):  # the narrow screen first, while the run is still failed
        page = login(browser, server, width)
        page.select_option("select[name=workflow]", "tests.needs_file_flow")
        page.check("input[name=status][value=failed]")
        page.click(".filters button[type=submit]")
        page.wait_for_selector('tr[data-run="import-2026-12"]')
        assert page.inner_text("#match-count") == "1"
        shoot(page, "dashboard-runs-failed")
        page.click('tr[data-run="import-2026-12"] a')
        assert "config file" in page.inner_text("#run-error")
        assert page.inner_text("#attempts").count("FileNotFoundError") == 2  # both attempts' errors
        shoot(page, "dashboard-run-failed")
        if width == 420:
            page.close()
            continue
        page.click("#retry-run")  # the cause is not fixed yet: it fails again
        page.wait_for_selector(".messages")
        wait_for(lambda: status_of(run.id) == RunStatus.FAILED and StepAttempt.objects.count() >= 5, what="fail again")
        gate.write_text("{}")  # fix the cause, retry again
        page.reload()
        page.click("#retry-run")
        page.wait_for_selector(".messages")  # the POST's redirect has landed before the reload below
        wait_for(lambda: status_of(run.id) == RunStatus.COMPLETED, what="the retried run to complete")
        page.reload()
        assert page.inner_text("#run-status") == "completed"
        # Attempts count per retry round: the second retry's first attempt, of the two it was given.
        assert "retry 2 · attempt 1 of 2" in page.inner_text("#timeline")
        # Each retry by hand: the time the run sat failed is the operator's delay, not a queue wait.
        assert len(page.query_selector_all(".seg.k-operator")) == 2
        shoot(page, "dashboard-run-retried")
        page.close()


def test_read_a_runs_timeline(server: str, browser: Any, db_workers: Engine) -> None:
    run = start("tests.three_then_sleep", 3)
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to sleep")
    for width in (1400, 420):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/{run.id}/")
        rows = page.query_selector_all("#timeline .tl-row")
        assert len(rows) == 4  # the run's turns, two steps and the sleep
        turn = page.get_attribute('.tl-row[data-key=""] .seg.k-turn', "title")  # the first turn's wait
        assert turn.startswith("turn: waiting for a worker, then replay: ")
        assert page.query_selector('.tl-row[data-key="3"] .seg.k-sleep') is not None
        assert "wakes at" in page.inner_text('.tl-row[data-key="3"]')
        assert page.query_selector_all(".seg.k-execution")
        title = page.get_attribute('.tl-row[data-key="1"] .seg.k-execution', "title")
        assert title.startswith("execution: ") and (" ms)" in title or " s)" in title)
        page.click("text=Timeline as a table")
        assert "no worker free" in page.inner_text("#timeline-table")
        shoot(page, "dashboard-run-timeline")
        page.close()


def test_cancel_asks_for_confirmation(server: str, browser: Any, db_workers: Engine) -> None:
    run = start("tests.three_then_sleep", 3)
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to sleep")
    page = login(browser, server)
    page.goto(f"{server}/dashboard/runs/{run.id}/")
    page.click("#cancel-run")
    page.wait_for_selector("#confirm-cancel")
    shoot(page, "dashboard-cancel-confirmation")
    assert status_of(run.id) == RunStatus.SUSPENDED  # nothing happens before the confirmation
    page.click("#confirm-cancel")
    page.wait_for_selector(".messages")
    assert status_of(run.id) == RunStatus.CANCELLED
    assert page.inner_text("#run-status") == "cancelled"
    assert page.is_hidden("#cancel-run") and page.is_visible("#retry-run")  # in the page, shown by state


def test_send_a_signal(server: str, browser: Any, db_workers: Engine) -> None:
    run = start("tests.signal_waiter", None)
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    page = login(browser, server)
    page.goto(f"{server}/dashboard/runs/{run.id}/")
    page.fill("#signal-name", "approve")
    page.fill("#signal-payload", '{"by": "ops"}')
    page.click("#send-signal")
    page.wait_for_selector(".messages")
    wait_for(lambda: status_of(run.id) == RunStatus.COMPLETED, what="the signalled run to complete")
    page.reload()
    assert "approve" in page.inner_text("#signals") and '"ops"' in page.inner_text("#run-output")


def test_start_a_workflow(server: str, browser: Any, db_workers: Engine) -> None:
    page = login(browser, server)
    page.click("text=Start a run")
    page.select_option("#id_workflow", "tests.three_steps")
    page.fill("#id_input", "2")
    page.fill("#id_run_id", "started-in-browser")
    page.click("#start-run")
    page.wait_for_selector("#run-id")
    assert page.inner_text("#run-id") == "started-in-browser"
    wait_for(lambda: status_of("started-in-browser") == RunStatus.COMPLETED, what="the started run to complete")


def test_watch_the_flow_view_move_during_a_burst(server: str, browser: Any, db_workers: Engine) -> None:
    register_queue("browser-flow", concurrency=2, rate_limit={"limit": 6, "period_ms": 2000})
    for width in (1400, 420):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/flow/")
        page.wait_for_function("document.getElementById('live-status').innerText.startsWith('live')", timeout=15000)
        page.evaluate("window.__noReload = true")
        page.fill("input[name=size]", "12")
        page.click("#burst")
        page.wait_for_function("/started 12 runs/.test(document.getElementById('burst-result').innerText)")
        # Backpressure: calls line up while the cap (2) and window (6 per 2 s) hold them...
        page.wait_for_function("document.querySelectorAll('[data-zone=waiting] .dot').length >= 3", timeout=15000)
        page.wait_for_function("document.querySelectorAll('[data-zone^=\"worker:\"] .dot').length >= 1", timeout=15000)
        page.wait_for_timeout(600)  # let the dots finish their move before the screenshot
        shoot(page, "dashboard-flow")
        assert page.evaluate("document.querySelectorAll('[data-zone^=\"worker:\"] .dot').length") <= 2
        # ...and drain out.
        page.wait_for_function("document.querySelectorAll('[data-zone=done] .dot').length >= 3", timeout=30000)
        assert page.evaluate("window.__noReload") is True  # moved over the WebSocket, no reload
        page.close()
        wait_for(
            lambda: not WorkflowRun.objects.exclude(status=RunStatus.COMPLETED).exists(),
            timeout=60,
            what="the burst to drain",
        )
