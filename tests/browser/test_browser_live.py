"""Every dashboard page live, in a real headless Chromium against a real daphne server and a
real `db` worker: the run list updates a row's status without a reload when a worker finishes
the run; the flow view shows the queue's new limits after a resize made in another tab; the
bulk confirmation says its filter in words (and warns when there is none) and its result counts
the runs that finished in between; at 420 px the overview keeps "Oldest wait" on screen.
Screenshots at 1400 px and 420 px go to var/screenshots."""

from __future__ import annotations

from typing import Any

from durable_flow import register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus
from tests.conftest import wait_for
from tests.support.browser import LIVE, login, shoot, status_of


def badge(run_id: str) -> str:
    return f"document.querySelector('tr[data-run=\"{run_id}\"] td.st .badge')?.innerText.trim()"


def test_the_run_list_shows_a_run_finish_without_a_reload(server: str, browser: Any, db_workers: Engine) -> None:
    runs = [start("tests.signal_waiter", None, run_id=f"live-list-{width}") for width in (1400, 420)]
    for run in runs:
        wait_for(lambda run=run: status_of(run.id) == RunStatus.SUSPENDED, what="the run to wait for its signal")
    for run, width in zip(runs, (1400, 420), strict=True):
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/?workflow=tests.signal_waiter")
        page.wait_for_function(LIVE, timeout=30000)
        assert page.evaluate(badge(run.id)) == "suspended"
        page.evaluate("window.__noReload = true")
        db_workers.send_signal(run.id, "approve", {"by": "ops"})
        # The worker finishes it; the row's badge follows on a tick (how soon is not the verdict).
        page.wait_for_function(f"{badge(run.id)} === 'completed'", timeout=60000)
        assert status_of(run.id) == RunStatus.COMPLETED
        assert page.evaluate("window.__noReload") is True  # pushed over the WebSocket, not reloaded
        shoot(page, "dashboard-runs-live")
        page.close()


def test_the_flow_view_shows_the_new_limits_after_a_resize(server: str, browser: Any, db_workers: Engine) -> None:
    register_queue("browser-resized", concurrency=6, rate_limit={"limit": 60, "period_ms": 60_000})
    for width in (1400, 420):
        flow = login(browser, server, width)
        flow.goto(f"{server}/dashboard/flow/?queue=browser-resized")
        flow.wait_for_function(LIVE, timeout=30000)
        assert (flow.inner_text("#n-cap"), flow.inner_text("#n-rate")) == ("6", "60")
        flow.evaluate("window.__noReload = true")
        # An operator resizes the queue in another tab: 6 / 60 → 2 / 20.
        steer = login(browser, server)
        steer.goto(f"{server}/dashboard/queues/browser-resized/")
        steer.fill("#resize-form [name=concurrency]", "2")
        steer.fill("#resize-form [name=rate_limit]", "20")
        steer.click("#resize-form button[type=submit]")
        steer.wait_for_selector("text=Resized")
        steer.close()
        text = "(id) => document.getElementById(id).innerText"
        resized = f"({text})('n-cap') === '2' && ({text})('n-rate') === '20'"
        flow.wait_for_function(resized, timeout=30000)
        assert flow.evaluate("window.__noReload") is True
        shoot(flow, "dashboard-flow-resized")
        flow.close()
        register_queue("browser-resized", concurrency=6, rate_limit={"limit": 60, "period_ms": 60_000})


def test_bulk_cancel_says_its_filter_and_counts_the_runs_finished_in_between(
    server: str, browser: Any, db_workers: Engine
) -> None:
    runs = [start("tests.signal_waiter", None, run_id=f"bulk-{i}") for i in range(5)]
    for run in runs:
        wait_for(lambda run=run: status_of(run.id) == RunStatus.SUSPENDED, what="the runs to wait for a signal")
    for width in (420, 1400):  # with no filter: the warning
        page = login(browser, server, width)
        page.goto(f"{server}/dashboard/runs/bulk/cancel/")
        assert "No filter: this is all unfinished runs (5)." in page.inner_text("#bulk-everything")
        shoot(page, "dashboard-bulk-everything")
        page.close()
    page = login(browser, server, 420)
    # A confirmation that is not live (no WebSocket here; a dropped feed is the same): its count
    # stays as shown, so the runs that finish meanwhile are the ones "in between". (A live page
    # follows them: tests/browser/test_browser_live_forms.py.)
    page.add_init_script("delete window.WebSocket")
    page.goto(f"{server}/dashboard/runs/?workflow=tests.signal_waiter&status=suspended")
    page.click("#bulk-cancel")
    page.wait_for_selector("#bulk-filter")
    assert page.inner_text("#bulk-filter").splitlines() == ["status is suspended", "workflow is tests.signal_waiter"]
    assert page.inner_text("#bulk-count") == "5" and page.query_selector("#bulk-everything") is None
    shoot(page, "dashboard-bulk-confirm")
    page.set_viewport_size({"width": 1400, "height": 900})
    shoot(page, "dashboard-bulk-confirm")
    # While the operator reads the page, two runs get their signal and a worker finishes them.
    for run in runs[:2]:
        db_workers.send_signal(run.id, "approve", "in time")
    for run in runs[:2]:
        wait_for(lambda run=run: status_of(run.id) == RunStatus.COMPLETED, what="the signalled runs to complete")
    page.click("#confirm-bulk")
    page.wait_for_selector(".messages")
    result = page.inner_text(".messages")
    assert "Cancel: 3 done, 2 already finished." in result
    assert "ended on their own after you confirmed" in result
    assert {status_of(run.id) for run in runs[2:]} == {RunStatus.CANCELLED}
    shoot(page, "dashboard-bulk-result")
    page.set_viewport_size({"width": 420, "height": 900})
    shoot(page, "dashboard-bulk-result")
    page.close()


def test_at_420px_the_overview_keeps_the_oldest_wait_on_screen(server: str, browser: Any, db_workers: Engine) -> None:
    register_queue("browser-stuck", concurrency=1, retry_ms=60_000)
    holder = start("tests.queued", {"queue": "browser-stuck", "seconds": 60, "id": "holder"})
    wait_for(lambda: status_of(holder.id) == RunStatus.RUNNING, what="the holder to run")
    start("tests.queued", {"queue": "browser-stuck", "value": 1})
    cell = 'tr[data-queue="browser-stuck"] td.oldest-wait'
    pages = [(420, "/", "dashboard-overview"), (1400, "/", "dashboard-overview")]
    pages += [(420, "/dashboard/queues/", "dashboard-queues"), (1400, "/dashboard/queues/", "dashboard-queues")]
    for width, path, name in pages:
        page = login(browser, server, width)
        page.goto(f"{server}{path}")
        # The waiter is parked behind the holder: its wait has an age (not "—").
        page.wait_for_function(f"/\\d/.test(document.querySelector('{cell}')?.innerText || '')", timeout=60000)
        # Measured in one go in the page: each tick replaces the cell (its age grows), so a box
        # read in two steps could belong to a cell already swapped out.
        box = page.evaluate(
            f"""(() => {{
                const el = document.querySelector('{cell}');
                el.scrollIntoView({{block: "center"}});
                const r = el.getBoundingClientRect(), style = getComputedStyle(el);
                return {{x: r.x, y: r.y, right: r.right, bottom: r.bottom, width: r.width, height: r.height,
                         shown: style.display !== "none" && style.visibility !== "hidden",
                         viewport: [innerWidth, innerHeight]}};
            }})()"""
        )
        assert box["shown"] and box["width"] > 0 and box["height"] > 0, box
        assert box["x"] >= 0 and box["right"] <= width, box  # not cut off at the side
        assert box["y"] >= 0 and box["bottom"] <= box["viewport"][1], box
        shoot(page, name)
        page.close()
