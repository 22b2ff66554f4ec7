"""The shipped Grafana dashboard (deploy/grafana/durable_flow.json) asks only for metrics the
scrape produces: every metric name in every PromQL expression (panels and variables) is a
sample name of a family that `/metrics/` exposes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "durable_flow.json"
METRIC = re.compile(r"\bdurable_flow_[a-z0-9_]+\b")
#: The sample names a family of each type exposes (the text format's suffixes).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets' `expr`, variables' queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def produced(text: str) -> set[str]:
    """The sample names a scrape's families expose, whether or not they have samples now."""
    return {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in SUFFIXES.get(family.type, ("",))
    }


@pytest.fixture
def scraped_names(staff_client: Client) -> set[str]:
    response = staff_client.get("/metrics/")
    assert response.status_code == 200
    return produced(response.content.decode())


def test_every_metric_the_dashboard_queries_is_produced(scraped_names: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(expressions(dashboard))
    named = {name for expr in exprs for name in METRIC.findall(expr)}
    assert len(exprs) > 20 and len(named) > 15  # the walk found the queries
    assert sorted(named - scraped_names) == []


def test_the_check_catches_a_name_the_scrape_does_not_produce(scraped_names: set[str]) -> None:
    """The old names (a windowed gauge histogram, the mixed-unit limit) are gone from the scrape."""
    for old in ("durable_flow_queue_wait_seconds_bucket", "durable_flow_queue_limit", "durable_flow_runs_total"):
        assert old not in scraped_names
    assert "durable_flow_step_duration_seconds_count" in scraped_names  # a histogram's suffixes


def test_the_dashboard_covers_queues_throughput_failures_latency_workers_retention_and_schedules() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = {panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"}
    assert {"Queues", "Throughput", "Failures", "Latency", "Workers", "Retention", "Schedules"} <= rows
    exprs = " ".join(expressions(dashboard))
    assert "durable_flow_schedule_lag_seconds" in exprs  # a poller down shows as a growing lag
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
