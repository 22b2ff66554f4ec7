"""The dashboard and the admin in a real headless Chromium against a real daphne server.

The server runs in a subprocess on the test database; the page must show the queue backlog,
update it live over the WebSocket without reloading, and cancel from the admin must cancel
the run in the database. Screenshots are saved under docs/screenshots/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from durable_flow import register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.support.browser import CHROMIUM, SCREENSHOTS, playwright


@pytest.fixture
def page(server: str) -> Iterator[Any]:
    get_user_model().objects.create_user("staff", password="pw", is_staff=True, is_superuser=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{server}/")
        page.fill("#id_username", "staff")
        page.fill("#id_password", "pw")
        page.click("input[type=submit]")
        page.wait_for_selector("#queues")
        yield page
        browser.close()


def cell(page: Any, queue: str, column: str) -> str:
    return page.inner_text(f'tr[data-queue="{queue}"] td.{column}').strip()


def test_queue_backlog_updates_live_without_a_reload(
    engine_db: Engine, server: str, page: Any, spawn: Callable[..., ManagedProcess]
) -> None:
    register_queue("browser-render", concurrency=1, retry_ms=60_000)
    spawn("durable_worker", "--concurrency", "2", env={"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"})
    holder = start("tests.queued", {"queue": "browser-render", "seconds": 60, "id": "holder"})
    wait_for(lambda: WorkflowRun.objects.get(pk=holder.id).status == RunStatus.RUNNING, what="the holder to run")
    waiting = [start("tests.queued", {"queue": "browser-render", "value": i}) for i in range(3)]
    page.evaluate("window.__noReload = true")
    page.wait_for_function(
        "document.querySelector('tr[data-queue=\"browser-render\"] td.waiting')?.innerText.trim() === '3'",
        timeout=15000,
    )
    assert cell(page, "browser-render", "in-flight") == "1 / 1"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "dashboard-queues.png"), full_page=True)

    for run in waiting[:2]:
        engine_db.cancel(run.id)
    # The page shows it without a reload (checked below); how soon is not the verdict: a loaded
    # machine may take a while to push the update.
    page.wait_for_function(
        "document.querySelector('tr[data-queue=\"browser-render\"] td.waiting')?.innerText.trim() === '1'",
        timeout=60000,
    )
    assert page.evaluate("window.__noReload") is True  # pushed over the WebSocket, not reloaded
    assert "live" in page.inner_text("#live-status")
    assert WorkflowRun.objects.get(pk=holder.id).status == RunStatus.RUNNING


def test_cancel_from_the_admin_cancels_the_run(
    engine_db: Engine, server: str, page: Any, spawn: Callable[..., ManagedProcess]
) -> None:
    spawn("durable_worker", env={"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"})
    run = start("tests.three_then_sleep", 3)
    wait_for(lambda: WorkflowRun.objects.get(pk=run.id).status == RunStatus.SUSPENDED, what="the run to sleep")
    page.goto(f"{server}/admin/durable_flow/workflowrun/{run.id}/change/")
    page.screenshot(path=str(SCREENSHOTS / "admin-run-detail.png"), full_page=True)
    page.click("#cancel-run")
    page.wait_for_selector("#confirm-cancel")  # a confirmation page first
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.SUSPENDED
    page.screenshot(path=str(SCREENSHOTS / "admin-cancel-confirmation.png"), full_page=True)
    page.click("#confirm-cancel")
    page.wait_for_selector(".messagelist")
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert page.query_selector("#cancel-run") is None
