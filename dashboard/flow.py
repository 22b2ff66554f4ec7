"""The "burst" of the live flow view: the demo runs its button starts into a queue
(`settings.DASHBOARD_BURST`). What the view draws, a queue's calls as dots from the waiting line
through the queue's gate into the worker slots and out, is the read model's
(`durable_flow.observe.queues.queue_flow`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from durable_flow.config.limits import QUEUE_NAME_LENGTH, WORKFLOW_NAME_LENGTH
from durable_flow.config.validation import number_problem, storable_text
from durable_flow.exceptions import InvalidInput

#: The default burst: the demo's throttled queue and a workflow that goes through it.
DEFAULT_BURST = {"WORKFLOW": "examples.sync_tenant", "QUEUE": "demo-throttled", "SIZE": 20, "INPUT": {}}
MAX_BURST = 200
TENANTS = ("acme", "globex", "initech", "umbrella")


def burst_config() -> dict[str, Any]:
    """`settings.DASHBOARD_BURST` over the defaults: which workflow a burst starts, into which
    queue. `ImproperlyConfigured` for a malformed setting (which `durable_flow_dashboard.E005` reports)."""
    value = getattr(settings, "DASHBOARD_BURST", {})
    problem = burst_problem(value)
    if problem:
        raise ImproperlyConfigured(problem)
    return {**DEFAULT_BURST, **value}


def burst_problem(value: object) -> str | None:
    """What is wrong with a `DASHBOARD_BURST` setting, or None: a dict of the default's keys,
    names the database can store, a `SIZE` from 1 to `MAX_BURST` and an `INPUT` dict."""
    if not isinstance(value, Mapping):
        return f"DASHBOARD_BURST must be a dict, got {type(value).__name__}"
    unknown = sorted(set(map(str, value)) - set(DEFAULT_BURST))
    if unknown:
        return f"DASHBOARD_BURST: unknown key(s) {', '.join(unknown)}"
    config = {**DEFAULT_BURST, **value}
    try:
        storable_text(config["WORKFLOW"], 'DASHBOARD_BURST["WORKFLOW"]', WORKFLOW_NAME_LENGTH)
        storable_text(config["QUEUE"], 'DASHBOARD_BURST["QUEUE"]', QUEUE_NAME_LENGTH)
    except InvalidInput as exc:
        return str(exc)
    problem = number_problem(config["SIZE"], minimum=1, maximum=MAX_BURST, integer=True, unit="runs")
    if problem:
        return f'DASHBOARD_BURST["SIZE"] {problem}'
    if not isinstance(config["INPUT"], dict):
        return f'DASHBOARD_BURST["INPUT"] must be a dict, got {type(config["INPUT"]).__name__}'
    return None


def burst_inputs(size: int) -> list[dict[str, Any]]:
    """The inputs of a burst: the configured input, with a tenant (fairness key) per run."""
    base = burst_config()["INPUT"]
    tenants = [TENANTS[i % len(TENANTS)] for i in range(size)]
    return [{**base, "tenant": tenant, "key": tenant, "n": i} for i, tenant in enumerate(tenants)]
