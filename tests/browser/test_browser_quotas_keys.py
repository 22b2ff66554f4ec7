"""The Quotas and Keys pages in a real headless Chromium, against a real daphne server and a real
`db` worker holding per-key step slots: the declared quota's limit and a refusal's row
(workflow, key, time, active/limit) arrive live; the busy key shows in the workflow's terms and
its link lists exactly its runs. Screenshots at 1400 px and 420 px go to var/screenshots."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from durable_flow import ConcurrencyLimitError, start
from durable_flow.models import RunStatus, StepCheckpoint, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.support.browser import login, shoot

DB = {"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"}
SLEEPER = "tests.quota_sleeper"  # quota: key "sleeper:" + input.tenant, limit 1


@pytest.fixture
def worker(engine_db: Any, spawn: Callable[..., ManagedProcess]) -> None:
    spawn("durable_worker", "--concurrency", "4", env=DB)


def live(page: Any) -> None:
    page.wait_for_function("document.getElementById('live-status').dataset.state === 'live'", timeout=20000)


def refuse(tenant: str) -> None:
    with pytest.raises(ConcurrencyLimitError):
        start(SLEEPER, {"tenant": tenant, "seconds": 600})


def test_quotas_show_their_limits_and_refusals_live(server: str, browser: Any, worker: None) -> None:
    page = login(browser, server, 1400)
    page.goto(f"{server}/dashboard/quotas/")
    live(page)
    row = f'#quota-declared tr[data-workflow="{SLEEPER}"]'
    assert page.inner_text(f"{row} .limit").strip() == "1"  # the declared limit, with nothing running
    assert page.inner_text(f"{row} .in-use").strip() == "none now (0 / 1)"

    page.evaluate("window.__noReload = true")
    start(SLEEPER, {"tenant": "acme", "seconds": 600})
    refuse("acme")
    page.wait_for_function(  # pushed live, no reload
        "s => document.querySelector(s + ' li[data-key=\"sleeper:acme\"] .key-usage')?.innerText.trim() === '1 / 1'"
        " && document.querySelector(s + ' .refused').innerText.trim() === '1'",
        arg=row,
        timeout=20000,
    )
    page.wait_for_selector("#quota-refusals tr[data-refusal]", timeout=20000)
    refusal = page.inner_text("#quota-refusals tr[data-refusal]")
    assert SLEEPER in refusal and "sleeper:acme" in refusal and "1 / 1" in refusal
    assert page.evaluate("window.__noReload") is True
    shoot(page, "dashboard-quotas")

    # The filter: another key's refusals only.
    start(SLEEPER, {"tenant": "globex", "seconds": 600})
    refuse("globex")
    page.fill("input[name=key]", "sleeper:globex")
    page.click(".refusal-filter button[type=submit]")
    live(page)
    page.wait_for_function("document.querySelectorAll('#quota-refusals tr[data-refusal]').length === 1")
    assert "sleeper:globex" in page.inner_text("#quota-refusals tr[data-refusal]")

    narrow = login(browser, server, 420)
    narrow.goto(f"{server}/dashboard/quotas/")
    narrow.wait_for_selector("#quota-refusals tr[data-refusal]")
    shoot(narrow, "dashboard-quotas")


def test_a_busy_key_shows_in_user_terms_and_links_to_exactly_its_runs(server: str, browser: Any, worker: None) -> None:
    held = [start("sc.per_account", {"account": "cust-7", "seconds": 60, "id": f"c{i}"}).id for i in range(3)]
    other = start("sc.per_account", {"account": "cust-8", "seconds": 60, "id": "d0"}).id
    wait_for(
        lambda: StepCheckpoint.objects.filter(run_id__in=held, status="dispatched").count() == 2,
        timeout=60,
        what="the worker to run cust-7's two slots",
    )
    page = login(browser, server, 1400)
    page.goto(f"{server}/dashboard/keys/")
    live(page)
    row = 'tr[data-resource="sc:fn:sc.per_account:cust-7"]'
    page.wait_for_function(
        "s => { const r = document.querySelector(s); return r && r.querySelector('.active').innerText === '2'"
        " && r.querySelector('.waiting').innerText === '1'; }",
        arg=row,
        timeout=30000,
    )
    text = page.inner_text("#step-concurrency")
    assert "sc:fn:" not in text and "workflow sc.per_account" in text
    assert page.inner_text(f"{row} .key").strip() == "cust-7"
    shoot(page, "dashboard-keys")

    page.click(f"{row} .key a")
    page.wait_for_selector("#runs")
    listed = set(page.eval_on_selector_all("#runs tr[data-run]", "rows => rows.map(r => r.dataset.run)"))
    assert listed == set(held) and other not in listed
    assert page.input_value("input[name=key]") == "cust-7"

    narrow = login(browser, server, 420)
    narrow.goto(f"{server}/dashboard/keys/")
    narrow.wait_for_selector(row)
    shoot(narrow, "dashboard-keys")
    assert WorkflowRun.objects.filter(pk__in=held, status=RunStatus.COMPLETED).count() == 0
