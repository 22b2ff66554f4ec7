"""The run list's pages and search in a real headless Chromium against a real daphne server:
page older and back newer by keyset links (no total count), find a run by the start of its id,
and by a word of its input only with "also inside inputs" ticked. Screenshots at 1400 px and
420 px go to var/screenshots (docs/screenshots with DURABLE_FLOW_SCREENSHOTS=docs/screenshots).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.observe.run_pages import PAGE_SIZE
from tests.support.browser import login, shoot


def listed(page: Any) -> list[str]:
    return [row.get_attribute("data-run") for row in page.query_selector_all("#runs tr[data-run]")]


def test_page_through_the_runs_and_find_one_by_its_id_or_its_input(server: str, browser: Any) -> None:
    now = timezone.now()
    for i in range(PAGE_SIZE + 10):
        WorkflowRun.objects.create(
            id=f"order-{i:03d}",
            workflow="tests.three_steps",
            status=RunStatus.FAILED if i % 7 == 0 else RunStatus.COMPLETED,
            input={"customer": f"cust-{i}", "file": "nightly.csv" if i == 42 else "orders.csv"},
            error={"type": "ValueError", "message": "row 17: bad date"} if i % 7 == 0 else None,
        )
        WorkflowRun.objects.filter(pk=f"order-{i:03d}").update(created_at=now - timedelta(minutes=i))
    for width in (1400, 420):
        page = login(browser, server, width)
        first = listed(page)
        assert first[0] == "order-000" and len(first) == PAGE_SIZE
        assert page.query_selector("a[rel=prev]") is None
        shoot(page, "dashboard-runs-page")
        page.click("a[rel=next]")
        page.wait_for_selector('tr[data-run="order-059"]')
        second = listed(page)
        assert second == [f"order-{i:03d}" for i in range(PAGE_SIZE, PAGE_SIZE + 10)]
        assert page.query_selector("a[rel=next]") is None
        page.click("a[rel=prev]")
        page.wait_for_selector('tr[data-run="order-000"]')
        assert listed(page) == first
        page.fill("input[name=q]", "order-04")
        page.click(".filters button[type=submit]")
        page.wait_for_selector('tr[data-run="order-049"]')
        assert listed(page) == [f"order-{i:03d}" for i in range(40, 50)]
        assert page.inner_text("#match-count") == "10"
        page.fill("input[name=q]", "nightly")
        page.click(".filters button[type=submit]")
        page.wait_for_selector("#runs td.muted")  # no run's id starts with it
        page.check("input[name=in_input]")
        page.click(".filters button[type=submit]")
        page.wait_for_selector('tr[data-run="order-042"]')
        assert listed(page) == ["order-042"]
        shoot(page, "dashboard-runs-search-inputs")
        page.close()
