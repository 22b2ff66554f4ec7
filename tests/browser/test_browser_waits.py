"""The run page as an operator reads it while a run waits, in a real headless Chromium against a
real daphne server, a `db` worker and the poller: what it waits for and why (the queue and the
cause, the signal it waits for and the real wake with its date), the timeline on one unit, the
run list filtered by "waiting because of", the signal form that keeps what was typed and asks
before sending a name the run does not wait for, and the badge turning `completed` live, with no
reload. Screenshots at 1400 px and 420 px go to var/screenshots."""

from __future__ import annotations

import re
from typing import Any

from durable_flow import register_queue, start
from durable_flow.admission.base import AdmissionRequest
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, Signal
from durable_flow.operations import api
from tests.conftest import wait_for
from tests.support.browser import LIVE, login, shoot, status_of
from tests.support.held import queued


def test_a_signal_sent_elsewhere_turns_the_badge_completed_without_a_reload(
    server: str, browser: Any, db_workers: Engine
) -> None:
    run = start("tests.signal_waiter", 86_400)  # its timeout: tomorrow
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    for width in (420, 1400):  # the narrow screen first, while the run still waits
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/{run.id}/")
        waits = page.inner_text("#run-waits")
        assert "signal `approve`, times out" in waits
        assert re.search(r"times out \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}", waits)  # the date: not today
        assert re.match(r"\d{4}-\d{2}-\d{2} ", page.inner_text("#wakes-at"))
        assert page.input_value("#signal-name") == "approve"  # pre-filled with what it waits for
        assert "approve" in page.inner_text("#awaited-names")
        shoot(page, "dashboard-run-waiting-signal")
        if width == 420:
            page.close()
            continue
        page.wait_for_function(LIVE, timeout=15000)
        page.evaluate("window.notReloaded = true")
        api.send_signal(run.id, "approve", {"by": "script"})
        page.wait_for_function("document.getElementById('run-status').innerText === 'completed'", timeout=15000)
        assert page.evaluate("window.notReloaded === true")  # the live topic swapped it in
        assert page.inner_text("#run-finished") != "—"
        page.close()


def test_the_signal_form_keeps_bad_json_and_asks_before_an_unknown_name(
    server: str, browser: Any, db_workers: Engine
) -> None:
    run = start("tests.signal_waiter", None)
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    for width in (420, 1400):  # the narrow screen first: the wide one sends the signals
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/{run.id}/")
        page.fill("#signal-name", "aprove")
        page.fill("#signal-payload", '{"by": "ops",}')  # a trailing comma: not JSON
        page.click("#send-signal")
        page.wait_for_selector("#signal-errors")
        assert (page.input_value("#signal-name"), page.input_value("#signal-payload")) == (
            "aprove",
            '{"by": "ops",}',
        )
        page.fill("#signal-payload", '{"by": "ops"}')
        page.click("#send-signal")
        page.wait_for_selector("#signal-confirm")
        assert "does not wait for aprove (it waits for approve)" in page.inner_text("#signal-confirm")
        assert page.input_value("#signal-name") == "aprove"
        assert not Signal.objects.filter(run_id=run.id).exists()
        shoot(page, "dashboard-run-signal-confirm")
        if width == 420:
            page.close()
            continue
        page.click("#confirm-signal")
        page.wait_for_selector(".messages")
        assert list(Signal.objects.filter(run_id=run.id).values_list("name", flat=True)) == ["aprove"]
        assert status_of(run.id) == RunStatus.SUSPENDED  # still waits for approve
        page.click("#send-signal")  # pre-filled with approve again: sent at once
        page.wait_for_function("document.getElementById('run-status').innerText === 'completed'", timeout=15000)
        page.close()


def test_a_capped_wait_names_its_queue_and_cause_on_the_page_the_timeline_and_the_list(
    server: str, browser: Any, db_workers: Engine, engine_db: Engine
) -> None:
    register_queue("browser-cap", concurrency=1)
    # Another call holds the queue's one slot, as a long step would.
    assert engine_db.admission.try_admit(AdmissionRequest(queue="browser-cap", ticket="holder/1")).admitted
    run = start("tests.queued", queued("browser-cap", "a"))
    wait_for(lambda: status_of(run.id) == RunStatus.SUSPENDED, what="the call to park")
    for width in (1400, 420):
        page = login(browser, server, width)
        page.select_option("#filter-waiting", "cap")
        page.click(".filters button[type=submit]")
        page.wait_for_selector(f'tr[data-run="{run.id}"]')
        assert page.inner_text("#match-count") == "1"
        page.click(f'tr[data-run="{run.id}"] a')
        page.wait_for_selector("#run-waits")
        assert "queue browser-cap: cap 1/1" in page.inner_text("#run-waits")
        assert "cap 1/1" in page.inner_text("#timeline")
        units = {label.rsplit(" ", 1)[-1] for label in page.locator("#timeline .scale > span").all_inner_texts()}
        assert len(units) == 1, units  # one unit on the axis
        shoot(page, "dashboard-run-waiting-cap")
        page.close()
    page = login(browser, server)
    page.goto(f"{server}/dashboard/runs/{run.id}/")
    page.wait_for_function(LIVE, timeout=15000)
    engine_db.grants.release_ticket("browser-cap", "holder/1")  # the slot goes back: the call is granted
    page.wait_for_function("document.getElementById('run-status').innerText === 'completed'", timeout=15000)
    title = page.get_attribute('.tl-row[data-key="1"] .seg.k-queue', "title")
    assert title.startswith("queue wait: queue `browser-cap`: cap 1/1")
    shoot(page, "dashboard-run-waited-cap")
    page.close()
