"""The keys page: each declared step-concurrency constraint's busy keys in the workflow's terms
(the workflow, the scope, the key's value; never the admission resource's name), read from the
admission backend (`local`, `db` and `redis` alike), each linked to the runs list filtered to
exactly its runs."""

from __future__ import annotations

import html as htmllib
import re
from typing import Any

import pytest

from durable_flow import start
from durable_flow.admission.base import AdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.observe.run_filters import key_resources, runs_from_json
from durable_flow_dashboard.live import render_topic
from durable_flow_dashboard.snapshot import snapshot
from tests import sc_workflows  # noqa: F401 - registers the sc.* workflows
from tests.engine_support import ManualTransport


@pytest.fixture
def busy(admission_backend: AdmissionBackend) -> dict[str, list[str]]:
    """Account a: 2 steps of sc.per_account executing (its limit) and 2 waiting; account b: 1;
    and a run of sc.two under account a (another workflow, the same key value)."""
    transport = ManualTransport()
    engine = Engine(admission=admission_backend, transport=transport, settings=get_settings())
    transport.bind(engine)
    set_engine(engine)
    runs = {
        "a": [start("sc.per_account", {"account": "a", "seconds": 0, "id": f"a{i}"}).id for i in range(4)],
        "b": [start("sc.per_account", {"account": "b", "seconds": 0, "id": "b0"}).id],
        "two": [start("sc.two", {"account": "a", "seconds": 0}).id],
    }
    transport.run_turns()
    return runs


def visible_text(html: str) -> str:
    """The text a reader sees, its whitespace collapsed."""
    text = htmllib.unescape(re.sub(r"<[^>]+>", " ", html))
    return re.sub(r"\s+([,])", r"\1", " ".join(text.split()))


def key_row(html: str, resource: str) -> str:
    """The table row of one admission resource (its machine name is an attribute, never text)."""
    match = re.search(rf'<tr data-resource="{re.escape(resource)}".*?</tr>', html, re.DOTALL)
    assert match, f"no row for {resource}"
    return match.group(0)


def test_busy_keys_show_in_the_workflows_terms(busy: dict[str, list[str]], admin_client: Any) -> None:
    page = admin_client.get("/dashboard/keys/")
    assert page.status_code == 200
    html = page.content.decode()
    table = html[html.index('id="step-concurrency"') :]
    text = visible_text(table)
    assert "sc:fn:" not in text and "sc:acct:" not in text  # no internal names on screen
    assert "sc.per_account: key input.account, limit 2" in text
    assert "scope: workflow sc.per_account" in text  # the scope, in words
    assert 'sc.two, sc.wide: key "openai", limit 5 to 50 · scope: every workflow of every environment' in text
    # The value, executing / limit, waiting.
    assert visible_text(key_row(table, "sc:fn:sc.per_account:a")) == "a 2 / 2 2"
    assert visible_text(key_row(table, "sc:fn:sc.per_account:b")) == "b 1 / 2 0"
    assert visible_text(key_row(table, "sc:fn:sc.two:a")) == "a 1 / 2 0"
    assert "sc.two: key input.account, limit 2 · scope: workflow sc.two" in text


def runs_linked(admin_client: Any, html: str, resource: str) -> set[str]:
    href = htmllib.unescape(re.search(r'<a href="([^"]+)"', key_row(html, resource)).group(1))  # type: ignore[union-attr]
    listing = admin_client.get(href)
    assert listing.status_code == 200
    return set(re.findall(r'<tr data-run="([^"]+)"', listing.content.decode()))


def test_a_busy_keys_link_lists_exactly_its_runs(busy: dict[str, list[str]], admin_client: Any) -> None:
    html = admin_client.get("/dashboard/keys/").content.decode()
    assert runs_linked(admin_client, html, "sc:fn:sc.per_account:a") == set(busy["a"])  # not sc.two's "a"
    assert runs_linked(admin_client, html, "sc:fn:sc.per_account:b") == set(busy["b"])
    assert runs_linked(admin_client, html, "sc:fn:sc.two:a") == set(busy["two"])
    assert runs_linked(admin_client, html, "sc:acct:openai") == set(busy["two"])


def test_the_queues_page_links_its_keys_too(busy: dict[str, list[str]], admin_client: Any) -> None:
    html = admin_client.get("/dashboard/queues/").content.decode()
    assert runs_linked(admin_client, html, "sc:fn:sc.per_account:a") == set(busy["a"])


def test_the_keys_page_is_a_live_topic(busy: dict[str, list[str]]) -> None:
    fragments = render_topic(snapshot(), "keys")
    assert fragments is not None
    assert visible_text(key_row(fragments["step-concurrency"], "sc:fn:sc.per_account:a")).endswith("a 2 / 2 2")


@pytest.mark.parametrize(
    ("value", "scope", "workflow", "resources"),
    [
        ("a", "fn", "sc.per_account", ["sc:fn:sc.per_account:a"]),
        ("", "fn", "sc.fan", ["sc:fn:sc.fan"]),
        ("openai", "account", "", ["sc:acct:openai"]),
        ("x", "env", "", ["sc:env:default:x"]),
        ("", "account", "", []),
    ],
)
def test_a_key_filter_names_the_resources_of_its_scope(
    value: str, scope: str, workflow: str, resources: list[str]
) -> None:
    assert key_resources(value, scope, workflow) == resources


def test_the_api_filter_takes_the_key_too(busy: dict[str, list[str]], admin_client: Any) -> None:
    matched = runs_from_json({"key": "a", "key_scope": "fn", "workflow": "sc.per_account"})
    assert set(matched.values_list("id", flat=True)) == set(busy["a"])
    every_scope = runs_from_json({"key": "a"})  # both workflows' per-workflow "a"
    assert set(every_scope.values_list("id", flat=True)) == set(busy["a"]) | set(busy["two"])
    assert admin_client.get("/dashboard/runs/", {"key": "a", "key_scope": "galaxy"}).status_code == 400
