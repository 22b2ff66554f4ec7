"""What the browser tests share (their fixtures are loaded by tests/browser/conftest.py): a real
daphne server on the test database (`server`), this process's engine on the `db` transport and
admission as the web process has them (`engine_db`), a headless Chromium (`browser`), a logged-in
page and a screenshot that proves the page fits its width.

Importing it skips the importing module when Playwright is missing, and lets the ORM run between
page actions (Playwright's sync API keeps an event loop in this thread)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import WorkflowRun
from durable_flow.transports.db.transport import DatabaseTransport
from tests.conftest import ROOT, ManagedProcess, wait_for

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in requirements.txt")
CHROMIUM = "/usr/bin/chromium"
# Screenshots go to var/screenshots (ignored); DURABLE_FLOW_SCREENSHOTS=docs/screenshots refreshes
# the ones the docs show.
SCREENSHOTS = ROOT / os.environ.get("DURABLE_FLOW_SCREENSHOTS", "var/screenshots")
# Playwright's sync API keeps an event loop in this thread; the ORM calls between page
# actions are ordinary blocking calls, which is what this flag tells Django.
os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(transactional_db: None, spawn: Callable[..., ManagedProcess]) -> str:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium")
    port = free_port()
    # The web process asks its admission backend for the queue numbers: the same `db` backend
    # the workers decide on, as in the embedded default.
    spawn(
        "-b",
        "127.0.0.1",
        "-p",
        str(port),
        "settings.asgi:application",
        module="daphne",
        env={"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"},
    )

    def up() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_for(up, timeout=120, what="daphne to listen")  # a start-up on a busy machine: an event, not a verdict
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def engine_db(transactional_db: None) -> Engine:
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    return engine


#: The embedded default stack, `db` transport and admission, for the spawned processes.
DB_STACK = {"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"}
#: True once the page's live feed reports itself live.
LIVE = "document.getElementById('live-status').innerText.startsWith('live')"


@pytest.fixture
def db_workers(engine_db: Engine, spawn: Callable[..., ManagedProcess]) -> Engine:
    """A real `db` worker (threads for turns beside capped steps) and a fast poller beside the
    test's server, on the embedded default stack."""
    spawn("durable_worker", "--concurrency", "4", env=DB_STACK)
    spawn("durable_poller", "--interval-ms", "100", env=DB_STACK)
    return engine_db


def status_of(run_id: str) -> str:
    return WorkflowRun.objects.get(pk=run_id).status


@pytest.fixture
def browser(server: str) -> Iterator[Any]:
    get_user_model().objects.create_user("staff", password="pw", is_staff=True, is_superuser=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def login(browser: Any, server: str, width: int = 1400) -> Any:
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(f"{server}/dashboard/runs/")
    page.fill("#id_username", "staff")
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")
    page.wait_for_selector("#runs")
    return page


def shoot(page: Any, name: str) -> None:
    """A full-page screenshot, and proof the page fits its width (no horizontal scroll)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    width = page.viewport_size["width"]
    wide = page.evaluate(
        "[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > innerWidth + 1)"
        ".slice(0, 5).map(e => `${e.tagName}#${e.id}.${e.className} ${Math.round(e.getBoundingClientRect().right)}`)"
    )
    assert page.evaluate("document.documentElement.scrollWidth") <= width, (
        f"{name} scrolls sideways at {width}px: {wide}"
    )
    page.screenshot(path=str(SCREENSHOTS / f"{name}-{width}.png"), full_page=True)
