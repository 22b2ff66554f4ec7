"""The busiest keys of each step-concurrency constraint, on the dashboard's queues page and the
admin's queue list, from the admission backend (`local`, `db` and `redis` alike); a run's
evaluated keys on its dashboard page."""

from __future__ import annotations

import re
from typing import Any

import pytest

from durable_flow import start
from durable_flow.admission.base import AdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from tests import sc_workflows  # noqa: F401 - registers the sc.* workflows
from tests.engine_support import ManualTransport


@pytest.fixture
def busy(admission_backend: AdmissionBackend) -> ManualTransport:
    """Account a: 2 steps executing (its limit) and 2 waiting; account b: 1 executing."""
    transport = ManualTransport()
    engine = Engine(admission=admission_backend, transport=transport, settings=get_settings())
    transport.bind(engine)
    set_engine(engine)
    for i in range(4):
        start("sc.per_account", {"account": "a", "seconds": 0, "id": f"a{i}"})
    start("sc.per_account", {"account": "b", "seconds": 0, "id": "b0"})
    transport.run_turns()
    return transport


def rows_of(html: str) -> dict[str, tuple[str, str]]:
    """`data-resource` -> (executing, waiting) from the step-concurrency table."""
    table = html[html.index('id="step-concurrency"') :]
    found = re.findall(
        r'data-resource="([^"]+)".*?class="active num">(\d+)<.*?class="waiting num">(\d+)<', table, re.DOTALL
    )
    return {resource: (active, waiting) for resource, active, waiting in found}


def test_the_dashboard_queues_page_shows_the_busiest_keys(busy: ManualTransport, admin_client: Any) -> None:
    page = admin_client.get("/dashboard/queues/")
    assert page.status_code == 200
    rows = rows_of(page.content.decode())
    assert rows["sc:fn:sc.per_account:a"] == ("2", "2")
    assert rows["sc:fn:sc.per_account:b"] == ("1", "0")
    # Busiest first.
    assert list(rows).index("sc:fn:sc.per_account:a") < list(rows).index("sc:fn:sc.per_account:b")


def test_the_admin_queue_list_shows_the_busiest_keys(busy: ManualTransport, admin_client: Any) -> None:
    page = admin_client.get("/admin/durable_flow/flowqueue/")
    assert page.status_code == 200
    assert rows_of(page.content.decode())["sc:fn:sc.per_account:a"] == ("2", "2")


def test_a_released_slot_shows_at_once(busy: ManualTransport, admin_client: Any) -> None:
    busy.execute(busy.take())  # one of a's steps finishes: its slot goes to a waiter
    rows = rows_of(admin_client.get("/dashboard/queues/").content.decode())
    assert rows["sc:fn:sc.per_account:a"][1] == "1"


def test_the_dashboard_run_page_shows_the_evaluated_keys(busy: ManualTransport, admin_client: Any) -> None:
    run = start("sc.two", {"account": "acme", "seconds": 0})
    html = admin_client.get(f"/dashboard/runs/{run.id}/").content.decode()
    facts = html[html.index('id="step-concurrency"') :][:300]
    assert "sc:acct:openai (at most 5 executing)" in facts and "sc:fn:sc.two:acme (at most 2 executing)" in facts
