"""The run page's actions and the schedules page follow the database live, in a real headless
Chromium against a real daphne server: a run that finishes while its page is open hides Cancel
and the signal form, and shows Retry only once the run can be retried; the schedules page shows
a schedule's new last tick after the poller ticks, and its Pause button, swapped in by the live
feed with no CSRF token of its own, pauses the schedule (the page's script gave its form the
token). Screenshots at 1400 px and 420 px go to var/screenshots."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from durable_flow import start
from durable_flow.definitions import registry
from durable_flow.definitions.registry import workflow
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, Schedule
from durable_flow.operations import api
from durable_flow.runtime.schedules import ScheduleTicker
from tests.conftest import MovableClock, wait_for
from tests.support.browser import LIVE, login, shoot, status_of

NO_RELOAD = "window.__noReload = true"
NOT_RELOADED = "window.__noReload === true"
SHOWN = "(id) => !document.getElementById(id).hidden && document.getElementById(id).offsetParent !== null"


def shown(page: Any, element_id: str) -> bool:
    return page.evaluate(SHOWN, element_id)


def test_a_run_that_finishes_live_hides_cancel_and_the_signal_form(
    server: str, browser: Any, db_workers: Engine
) -> None:
    runs = {width: start("tests.signal_waiter", None, run_id=f"actions-{width}") for width in (1400, 420)}
    for run in runs.values():
        wait_for(lambda run=run: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    for width, run in runs.items():
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/{run.id}/")
        page.wait_for_function(LIVE, timeout=30000)
        assert (shown(page, "cancel-run"), shown(page, "signal-form"), shown(page, "retry-form")) == (True, True, False)
        page.evaluate(NO_RELOAD)
        if width == 1400:
            db_workers.send_signal(run.id, "approve", None)  # it completes: nothing to retry
            page.wait_for_function("document.getElementById('run-status').innerText === 'completed'", timeout=30000)
            retry = False
        else:
            api.cancel(run.id)  # cancelled: it can be retried from where it stopped
            page.wait_for_function("document.getElementById('run-status').innerText === 'cancelled'", timeout=30000)
            retry = True
        assert page.evaluate(NOT_RELOADED)
        actions = (shown(page, "cancel-run"), shown(page, "signal-form"), shown(page, "retry-form"))
        assert actions == (False, False, retry)
        shoot(page, "dashboard-run-actions-live")
        if retry:  # the form shown live is the page's own, with its token: it retries
            page.click("#retry-run")
            page.wait_for_selector(".messages")
            assert "Retrying run" in page.inner_text(".messages")
        page.close()


@pytest.fixture
def scheduled() -> Iterator[str]:
    """A schedule declared in this process only: no poller process ticks it, the test does."""
    workflow("tests.browser-tick", schedule="* * * * *")(lambda ctx, _: None)
    yield "tests.browser-tick"
    registry._workflows.pop("tests.browser-tick", None)


def _row(name: str, cell: str) -> str:
    return f"document.querySelector('tr[data-schedule=\"{name}\"] td.{cell}')?.innerText.trim()"


def test_the_schedules_page_shows_the_last_tick_live_and_its_swapped_in_pause_works(
    server: str, browser: Any, manual: Engine, clock: MovableClock, scheduled: str
) -> None:
    clock._now = datetime(2026, 1, 1, 9, 59, 30, tzinfo=UTC)
    ticker = ScheduleTicker(manual)
    ticker.tick()  # the row, with its first tick at 10:00
    pages = {width: login(browser, server, width) for width in (1400, 420)}
    for page in pages.values():
        page.goto(f"{server}/dashboard/schedules/")
        page.wait_for_function(LIVE, timeout=30000)
        assert page.evaluate(_row(scheduled, "last")) == "—"
        page.evaluate(NO_RELOAD)
        page.evaluate("document.getElementById('schedules').dataset.kept = 'yes'")  # gone once swapped
    clock.advance(seconds=30)
    assert len(ticker.tick()) == 1  # the poller starts 10:00's run
    for page in pages.values():
        page.wait_for_function(f"{_row(scheduled, 'last')} === '2026-01-01 10:00:00'", timeout=30000)
        assert page.evaluate(NOT_RELOADED)
        assert page.evaluate("document.getElementById('schedules').dataset.kept") is None  # the table was swapped
        assert page.evaluate(_row(scheduled, "next")) == "2026-01-01 10:01:00"
        form = f'tr[data-schedule="{scheduled}"] form'
        assert page.input_value(f"{form} input[name=csrfmiddlewaretoken]")  # given by the page's script
        assert page.is_enabled(f"{form} button")  # the user has change_schedule
        shoot(page, "dashboard-schedules-live")
    page = pages[420]
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.click(f'tr[data-schedule="{scheduled}"] form button')
    assert posted.value.status == 303  # CSRF accepted: redirected back to the page
    page.wait_for_selector(".messages")
    assert f"Paused: {scheduled}" in page.inner_text(".messages")
    assert Schedule.objects.get(workflow=scheduled).paused
    # The page joining the feed may first get the table of the tick before the pause: the next
    # tick's says paused.
    page.wait_for_function(f"{_row(scheduled, 'state')} === 'paused'", timeout=30000)
    # The other tab learns it on a tick: its button, swapped in again, now resumes.
    pages[1400].wait_for_function(f"{_row(scheduled, 'state')} === 'paused'", timeout=30000)
    assert pages[1400].inner_text(f'tr[data-schedule="{scheduled}"] form button') == "Resume"
    for page in pages.values():
        page.close()


def test_a_swapped_in_schedule_button_is_disabled_for_staff_without_the_permission(
    server: str, browser: Any, manual: Engine, clock: MovableClock, scheduled: str
) -> None:
    from django.contrib.auth import get_user_model

    clock._now = datetime(2026, 1, 1, 9, 59, 30, tzinfo=UTC)
    ticker = ScheduleTicker(manual)
    ticker.tick()
    get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{server}/dashboard/schedules/")
    page.fill("#id_username", "viewer")
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")
    page.wait_for_function(LIVE, timeout=30000)
    page.evaluate("document.getElementById('schedules').dataset.kept = 'yes'")
    clock.advance(seconds=30)
    ticker.tick()
    page.wait_for_function(f"{_row(scheduled, 'last')} === '2026-01-01 10:00:00'", timeout=30000)
    assert page.evaluate("document.getElementById('schedules').dataset.kept") is None
    button = f'tr[data-schedule="{scheduled}"] form button'
    assert not page.is_enabled(button)
    assert page.get_attribute(button, "title") == "needs the change_schedule permission"
    page.close()
