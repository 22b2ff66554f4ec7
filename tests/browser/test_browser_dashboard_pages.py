"""The dashboard's overview, queue, queues and workers pages in a real headless Chromium,
against a real daphne server, a `durable_worker` and the poller (all on the `db` transport and
admission): pause a queue and watch waiting grow, resume and watch it drain; watch the charts
get points; survive a server restart; learn that the session expired.

Screenshots at 1400 px and 420 px go to var/screenshots/ (DURABLE_FLOW_SCREENSHOTS=docs/screenshots
refreshes the docs').
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session

from durable_flow import register_queue, start
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import FlowQueue, RunStatus, WorkflowRun
from durable_flow.transports.db.transport import DatabaseTransport
from tests.conftest import ManagedProcess, wait_for
from tests.support.browser import CHROMIUM, SCREENSHOTS, free_port, playwright

DB = {"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_SAMPLE_INTERVAL_S": "1"}
WIDE, NARROW = {"width": 1400, "height": 900}, {"width": 420, "height": 900}


class Server:
    """daphne on a fixed port, restartable (the browser keeps its page across a restart)."""

    def __init__(self, spawn: Callable[..., ManagedProcess]) -> None:
        self.spawn = spawn
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: ManagedProcess | None = None

    def listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self) -> None:
        args = ("-b", "127.0.0.1", "-p", str(self.port), "settings.asgi:application")
        self.process = self.spawn(*args, module="daphne", env=DB)
        wait_for(self.listening, timeout=120, what="daphne to listen")

    def stop(self) -> None:
        assert self.process is not None
        self.process.terminate()
        wait_for(lambda: not self.listening(), timeout=30, what="daphne to stop")


@pytest.fixture
def engine_db(transactional_db: None) -> Engine:
    """This process starts runs as the web process would: db transport and admission."""
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    return engine


@pytest.fixture
def server(transactional_db: None, spawn: Callable[..., ManagedProcess]) -> Server:
    if not __import__("pathlib").Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium")
    server = Server(spawn)
    server.start()
    return server


@pytest.fixture
def page(server: Server) -> Iterator[Any]:
    get_user_model().objects.create_user("staff", password="pw", is_staff=True, is_superuser=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport=WIDE)
        page.goto(f"{server.url}/")
        page.fill("#id_username", "staff")
        page.fill("#id_password", "pw")
        page.click("input[type=submit]")
        page.wait_for_selector("h1")
        yield page
        browser.close()


def live(page: Any) -> None:
    page.wait_for_function("document.getElementById('live-status').dataset.state === 'live'", timeout=15000)


def shoot(page: Any, name: str) -> None:
    """Full-page screenshots at 1400 px and 420 px wide."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for suffix, size in (("", WIDE), ("-narrow", NARROW)):
        page.set_viewport_size(size)
        page.wait_for_timeout(300)
        page.screenshot(path=str(SCREENSHOTS / f"{name}{suffix}.png"), full_page=True)
    page.set_viewport_size(WIDE)


def text_is(page: Any, selector: str, value: str, timeout: int = 20000) -> None:
    page.wait_for_function(
        "([s, v]) => document.querySelector(s)?.innerText.trim() === v", arg=[selector, value], timeout=timeout
    )


def test_pause_a_queue_watch_waiting_grow_then_resume_and_watch_it_drain(
    engine_db: Engine, server: Server, page: Any, spawn: Callable[..., ManagedProcess]
) -> None:
    register_queue("browser-gate", concurrency=2, rate_limit={"limit": 20, "period_ms": 10_000, "algorithm": "sliding"})
    spawn("durable_worker", "--concurrency", "4", env=DB)
    spawn("durable_poller", env=DB)
    page.goto(f"{server.url}/dashboard/queues/browser-gate/")
    live(page)
    page.evaluate("window.__noReload = true")
    page.click("#pause-queue")  # a form POST with CSRF; back on the page
    page.wait_for_selector("#resume-queue")
    live(page)
    page.evaluate("window.__noReload = true")
    runs = [start("tests.queued", {"queue": "browser-gate", "value": i, "key": f"tenant-{i % 3}"}).id for i in range(6)]
    text_is(page, "#q-waiting", "6")  # pushed live: no reload
    assert page.evaluate("window.__noReload") is True
    assert page.query_selector('#queue-why [data-reason="paused"]') is not None
    assert "tenant-0" in page.inner_text("#queue-keys")
    shoot(page, "dashboard-queue-paused")

    page.click("#resume-queue")
    page.wait_for_selector("#pause-queue")
    live(page)
    text_is(page, "#q-waiting", "0", timeout=60000)
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() == 6,
        timeout=60,
        what="the queue to drain",
    )


def test_resizing_the_cap_in_the_browser_keeps_the_windows_and_the_throttle(
    engine_db: Engine, server: Server, page: Any
) -> None:
    register_queue(
        "browser-paced",
        concurrency=2,
        rate_limit=[{"limit": 20, "period_ms": 10_000}, {"limit": 2, "period_ms": 500, "per": "key"}],
        throttle={"limit": 6, "period_ms": 60_000, "burst": 3, "per": "key"},
    )
    before = FlowQueue.objects.get(pk="browser-paced").config
    page.goto(f"{server.url}/dashboard/queues/browser-paced/")
    assert page.input_value("#resize-form [name=key_rate_period_s]") == "0.5"
    assert page.input_value("#resize-form [name=throttle_per]") == "key"
    shoot(page, "dashboard-queue-resize")
    page.fill("#resize-form [name=concurrency]", "5")
    page.click("#resize-form button[type=submit]")
    page.wait_for_selector("text=Resized")
    assert FlowQueue.objects.get(pk="browser-paced").config == before | {"concurrency": 5}
    assert page.input_value("#resize-form [name=concurrency]") == "5"


def test_the_charts_get_points_from_the_poller_samples(
    engine_db: Engine, server: Server, page: Any, spawn: Callable[..., ManagedProcess]
) -> None:
    register_queue("demo-throttled", concurrency=2, rate_limit={"limit": 20, "period_ms": 10_000}, fairness="key")
    register_queue("emails", concurrency=10)
    spawn("durable_worker", "--concurrency", "4", env=DB)
    adaptive = spawn("durable_worker", "--concurrency", "adaptive", env=DB)
    spawn("durable_poller", env=DB)
    for i in range(24):
        start("tests.queued", {"queue": "demo-throttled", "seconds": 0.4, "id": i, "key": f"tenant-{i % 4}"})
    for i in range(4):
        start("tests.queued", {"queue": "emails", "value": i})
    for _ in range(3):
        start("tests.fails", None)
    page.goto(f"{server.url}/")
    live(page)
    points = "() => Number(document.querySelector('[data-live=overview-chart] svg.chart')?.dataset.points || 0)"
    first = page.evaluate(points)
    page.wait_for_function(f"({points})() >= {first + 3}", timeout=30000)  # pushed live as samples land
    page.wait_for_function(
        "document.querySelector('tr[data-queue=\"demo-throttled\"] svg.spark') !== null", timeout=15000
    )
    if "DURABLE_FLOW_SCREENSHOTS" in os.environ:  # refreshing the docs': a few more samples, so lines have shape
        page.wait_for_timeout(4000)
    shoot(page, "dashboard-overview")

    for i in range(12):  # a second burst: backlog behind the cap and the window
        start("tests.queued", {"queue": "demo-throttled", "seconds": 0.4, "id": 100 + i, "key": f"tenant-{i % 4}"})
    page.goto(f"{server.url}/dashboard/queues/demo-throttled/")
    live(page)
    page.wait_for_function("Number(document.querySelector('#q-waiting')?.innerText) > 0", timeout=15000)
    page.wait_for_function(
        "Number(document.querySelector('[data-live=queue-charts] svg.chart')?.dataset.points || 0) >= 3",
        timeout=30000,
    )
    shoot(page, "dashboard-queue")
    page.goto(f"{server.url}/dashboard/queues/")
    live(page)
    shoot(page, "dashboard-queue-list")
    adaptive.kill()  # SIGKILL: its heartbeat lapses, its card is dimmed and listed as a problem
    page.goto(f"{server.url}/dashboard/workers/")
    live(page)
    page.wait_for_function("document.querySelectorAll('#workers svg.spark polyline').length >= 3", timeout=30000)
    # Dimmed once its heartbeat is older than the TTL (10 s in the tests): wait well past it.
    page.wait_for_selector("#workers article.dead", timeout=90000)
    order = page.eval_on_selector_all("#workers article", "cards => cards.map((c) => c.dataset.worker)")
    page.wait_for_timeout(3000)  # several heartbeats later the cards keep their places
    assert page.eval_on_selector_all("#workers article", "cards => cards.map((c) => c.dataset.worker)") == order
    shoot(page, "dashboard-workers")
    page.goto(f"{server.url}/")
    assert "stopped heartbeating" in page.inner_text("#problems")


def test_reconnects_after_a_server_restart_and_says_when_the_session_expired(server: Server, page: Any) -> None:
    live(page)
    page.keyboard.press("Tab")  # keyboard first: the skip link, then the nav
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Overview"
    server.stop()
    page.wait_for_function("document.getElementById('live-status').dataset.state === 'disconnected'", timeout=15000)
    assert "disconnected" in page.inner_text("#live-status")
    assert page.evaluate("document.body.classList.contains('stale')")
    page.wait_for_timeout(1500)  # let the backoff grow a little
    server.start()
    live(page)
    assert not page.evaluate("document.body.classList.contains('stale')")

    Session.objects.all().delete()  # the session ends (expired, or logged out elsewhere)
    server.stop()
    server.start()
    page.wait_for_function("document.getElementById('live-status').dataset.state === 'expired'", timeout=30000)
    link = page.query_selector("#live-status a")
    assert link is not None and "/admin/login/" in link.get_attribute("href")
