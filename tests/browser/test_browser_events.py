"""The events page in a real headless Chromium against a real daphne server: an event sent while
the page is open appears by the live feed, with the run its trigger started (a link to the run's
page). Screenshots at 1400 px and 420 px go to var/screenshots."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from durable_flow import send_event
from durable_flow.definitions.registry import WorkflowDefinition
from durable_flow.engine import Engine
from tests.support.browser import LIVE, login, shoot

NO_RELOAD = "window.__noReload = true"
NOT_RELOADED = "window.__noReload === true"


def test_an_event_sent_while_the_page_is_open_appears_with_the_run_it_started(
    server: str, browser: Any, manual: Engine, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("tests.browser-welcome", trigger="tests/orders.created")
    for width in (1400, 420):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/events/")
        page.wait_for_function(LIVE, timeout=30000)
        page.evaluate(NO_RELOAD)
        event_id = f"browser-{width}"
        send_event("tests/orders.created", {"order": width}, id=event_id)
        row = f"tr[data-event='{event_id}']"
        page.wait_for_selector(f"{row} .delivery[data-action='started']", timeout=30000)
        assert page.evaluate(NOT_RELOADED)
        assert page.inner_text(f"{row} .state") == "delivered"
        link = page.get_attribute(f"{row} .delivery a", "href")
        assert link is not None and "tests.browser-welcome" in link and event_id in link
        assert page.inner_text(f"{row} .delivery a") == "tests.browser-welcome"
        shoot(page, "dashboard-events-live")
        page.close()
