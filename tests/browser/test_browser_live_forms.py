"""The dashboard's forms and lists stay live without losing what the operator typed, in a real
headless Chromium against a real daphne server and a real `db` worker: the run page adds failed
attempts and follows the signal names the run waits for while the signal form keeps what was
typed; the runs list counts an unfinished run's duration in the page, with no table re-sent; the
bulk confirmation's count and sample follow the runs, and its result matches the count shown;
the cancel confirmation follows the run's status; the quota page charts the refusals of the
workflow picked. Screenshots at 1400 px and 420 px go to var/screenshots."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from durable_flow import ConcurrencyLimitError, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepAttempt
from durable_flow.operations import api
from tests.conftest import wait_for
from tests.support.browser import LIVE, login, shoot, status_of

NO_RELOAD = "window.__noReload = true"
NOT_RELOADED = "window.__noReload === true"


def text(page: Any, selector: str) -> str:
    return page.evaluate(f"document.querySelector({selector!r})?.innerText ?? ''")


def test_signal_names_follow_the_run_while_the_form_keeps_what_was_typed(
    server: str, browser: Any, db_workers: Engine
) -> None:
    run = start("tests.two_signals", None)
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for approve")
    wide, narrow = login(browser, server, 1400), login(browser, server, 420)
    for page in (wide, narrow):
        page.goto(f"{server}/dashboard/runs/{run.id}/")
        page.wait_for_function(LIVE, timeout=30000)
        assert "approve" in page.inner_text("#awaited-names")
        assert page.input_value("#signal-name") == "approve"  # pre-filled with what it waits for
        page.evaluate(NO_RELOAD)
    # One operator starts typing a payload; the other a name of their own.
    wide.fill("#signal-payload", '{"by": "ops", "note": "half typed')
    narrow.fill("#signal-name", "aprove")
    narrow.fill("#signal-payload", "{}")
    api.send_signal(run.id, "approve", {"by": "script"})  # sent elsewhere: the run now waits for ship
    for page in (wide, narrow):
        page.wait_for_function("document.getElementById('awaited-names').innerText.includes('ship')", timeout=30000)
        assert "approve" not in page.inner_text("#awaited-names")
        assert page.evaluate(NOT_RELOADED)
    # What was typed stays; the name nobody typed in follows the run to `ship`.
    assert wide.input_value("#signal-payload") == '{"by": "ops", "note": "half typed'
    assert wide.input_value("#signal-name") == "ship"
    assert (narrow.input_value("#signal-name"), narrow.input_value("#signal-payload")) == ("aprove", "{}")
    assert wide.eval_on_selector_all("#awaited-signals option", "os => os.map(o => o.value)") == ["ship"]
    shoot(wide, "dashboard-run-signal-live")
    shoot(narrow, "dashboard-run-signal-live")
    # The wide page sends `ship` as it now stands: the run completes, live.
    wide.fill("#signal-payload", '{"by": "ops"}')
    wide.click("#send-signal")
    wide.wait_for_selector(".messages")
    wait_for(lambda: status_of(run.id) == RunStatus.COMPLETED, what="the run to complete")
    narrow.wait_for_function("document.getElementById('run-status').innerText === 'completed'", timeout=30000)
    assert "the run has finished" in narrow.inner_text("#awaited-names")
    assert narrow.input_value("#signal-name") == "aprove"
    for page in (wide, narrow):
        page.close()


def test_failed_attempts_appear_on_the_open_run_page_after_a_retry_elsewhere(
    server: str, browser: Any, db_workers: Engine, tmp_path: Path
) -> None:
    run = start("tests.needs_file_flow", {"path": str(tmp_path / "missing.json")}, run_id="attempts-live")
    wait_for(lambda: status_of(run.id) == RunStatus.FAILED, what="the run to fail")
    pages = [login(browser, server, width) for width in (1400, 420)]
    for page in pages:
        page.goto(f"{server}/dashboard/runs/{run.id}/")
        page.wait_for_function(LIVE, timeout=30000)
        assert len(page.query_selector_all("#attempts tbody tr")) == 2
        page.click("#attempts tbody tr:first-child details summary")  # the operator reads a traceback
        page.evaluate(NO_RELOAD)
    api.retry(run.id)  # someone retries it elsewhere; the cause is not fixed: two more failures
    wait_for(
        lambda: status_of(run.id) == RunStatus.FAILED and StepAttempt.objects.filter(error__isnull=False).count() == 4,
        what="the retried run to fail again",
    )
    for page in pages:
        page.wait_for_function("document.querySelectorAll('#attempts tbody tr').length === 4", timeout=30000)
        assert page.evaluate(NOT_RELOADED)
        assert "retry 1" in page.inner_text("#attempts")
        # The traceback the operator opened is still open after the swap.
        assert page.evaluate("document.querySelector('#attempts tbody tr:first-child details').open")
        shoot(page, "dashboard-run-attempts-live")
        page.close()


def test_a_running_runs_duration_counts_in_the_page_with_no_table_re_sent(
    server: str, browser: Any, db_workers: Engine
) -> None:
    run = start("tests.signal_waiter", None, run_id="list-clock")
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    cell = f'tr[data-run="{run.id}"] td.du'
    for width in (1400, 420):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/?workflow=tests.signal_waiter")
        page.wait_for_function(LIVE, timeout=30000)
        page.evaluate("document.getElementById('runs').dataset.kept = 'yes'")  # gone if the table is swapped
        first = text(page, cell)
        assert re.fullmatch(r"\d+(\.\d)? s|\d+ m \d\d s|\d+ ms", first), first
        status = page.inner_text("#live-status")
        # Two ticks later (each says "live · <its time>"), the duration has grown in the page.
        for _ in range(2):
            page.wait_for_function("s => document.getElementById('live-status').innerText !== s", arg=status)
            status = page.inner_text("#live-status")
        page.wait_for_function("([s, t]) => document.querySelector(s).innerText !== t", arg=[cell, first])
        assert page.evaluate("document.getElementById('runs').dataset.kept") == "yes"  # no fragment came
        shoot(page, "dashboard-runs-clock")
        page.close()


def test_the_bulk_confirmation_follows_the_runs_and_acts_on_the_count_shown(
    server: str, browser: Any, db_workers: Engine
) -> None:
    runs = [start("tests.signal_waiter", None, run_id=f"bulk-live-{i}") for i in range(5)]
    for run in runs:
        wait_for(lambda run=run: status_of(run.id) == RunStatus.SUSPENDED, what="the runs to wait for a signal")
    narrow = login(browser, server, 420)
    narrow.goto(f"{server}/dashboard/runs/bulk/cancel/?workflow=tests.signal_waiter")
    narrow.wait_for_function(LIVE, timeout=30000)
    page = login(browser, server, 1400)
    page.goto(f"{server}/dashboard/runs/bulk/cancel/?workflow=tests.signal_waiter")
    page.wait_for_function(LIVE, timeout=30000)
    assert page.inner_text("#bulk-count") == "5" and len(page.query_selector_all("#bulk-sample tbody tr")) == 5
    assert page.inner_text("#bulk-filter").splitlines() == ["workflow is tests.signal_waiter"]
    page.evaluate(NO_RELOAD)
    shown_at = page.input_value("input[name=confirmed_at]")
    # While the operator reads the page, two runs get their signal and a worker finishes them.
    for run in runs[:2]:
        db_workers.send_signal(run.id, "approve", "in time")
    for p in (page, narrow):
        p.wait_for_function("document.getElementById('bulk-count').innerText === '3'", timeout=30000)
        assert p.inner_text("h1") == "Cancel 3 runs?" and p.inner_text("#confirm-bulk") == "Cancel 3 runs"
        assert len(p.query_selector_all("#bulk-sample tbody tr")) == 3
    assert page.evaluate(NOT_RELOADED)
    assert page.inner_text("#bulk-filter").splitlines() == ["workflow is tests.signal_waiter"]  # the filter stays
    assert page.input_value("input[name=confirmed_at]") != shown_at  # the time of the count shown now
    shoot(narrow, "dashboard-bulk-live")
    shoot(page, "dashboard-bulk-live")
    narrow.close()
    page.click("#confirm-bulk")
    page.wait_for_selector(".messages")
    assert "Cancel: 3 done." in page.inner_text(".messages")  # the count it showed, nothing "in between"
    assert {status_of(run.id) for run in runs[2:]} == {RunStatus.CANCELLED}
    page.close()


def test_the_cancel_confirmation_follows_the_runs_status(server: str, browser: Any, db_workers: Engine) -> None:
    run = start("tests.signal_waiter", None)
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    for width in (420, 1400):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/{run.id}/cancel/")
        page.wait_for_function(LIVE, timeout=30000)
        assert page.inner_text("#run-status") == "suspended"
        shoot(page, "dashboard-cancel-live")
        if width == 420:
            page.close()
            continue
        page.evaluate(NO_RELOAD)
        db_workers.send_signal(run.id, "approve", None)  # it finishes while the question is open
        page.wait_for_function("document.getElementById('run-status').innerText === 'completed'", timeout=30000)
        assert page.evaluate(NOT_RELOADED)
        page.close()


def test_the_quota_page_charts_the_refusals_of_the_workflow_picked(
    server: str, browser: Any, db_workers: Engine
) -> None:
    start("tests.quota_sleeper", {"tenant": "acme", "seconds": 600})
    with pytest.raises(ConcurrencyLimitError):
        start("tests.quota_sleeper", {"tenant": "acme", "seconds": 600})
    with pytest.raises(ConcurrencyLimitError):  # another workflow, the same key (a per-start quota)
        start("tests.echo_flow", 1, quota={"key": "sleeper:acme", "limit": 1})
    for width in (1400, 420):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/quotas/")
        page.wait_for_function(LIVE, timeout=30000)
        chart = "#h-refusals ~ div .chart"
        assert page.get_attribute(chart, "aria-label").endswith("all workflows and keys")
        page.select_option("select[name=workflow]", "tests.echo_flow")
        page.click(".refusal-filter button[type=submit]")
        page.wait_for_function(LIVE, timeout=30000)
        assert page.get_attribute(chart, "aria-label").endswith("workflow tests.echo_flow")
        assert page.inner_text("#refusal-scope").endswith("workflow tests.echo_flow")  # said on screen too
        assert page.input_value("select[name=workflow]") == "tests.echo_flow"
        assert len(page.query_selector_all("#quota-refusals tr[data-refusal]")) == 1
        shoot(page, "dashboard-quotas-by-workflow")
        page.close()
