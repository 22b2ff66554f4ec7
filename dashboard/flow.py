"""The "burst" of the live flow view: the demo runs its button starts into a queue
(`settings.DASHBOARD_BURST`). What the view draws, a queue's calls as dots from the waiting line
through the queue's gate into the worker slots and out, is the read model's
(`durable_flow.observe.queues.queue_flow`).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from durable_flow.config.limits import QUEUE_NAME_LENGTH, WORKFLOW_NAME_LENGTH
from durable_flow.config.options import Option, dictionary, number, parse_options, text

#: The default burst: the demo's throttled queue and a workflow that goes through it.
DEFAULT_BURST = {"WORKFLOW": "examples.sync_tenant", "QUEUE": "demo-throttled", "SIZE": 20, "INPUT": {}}
MAX_BURST = 200
TENANTS = ("acme", "globex", "initech", "umbrella")
#: The keys of `settings.DASHBOARD_BURST`, each optional (`DEFAULT_BURST` fills them in).
BURST_OPTIONS = {
    "WORKFLOW": Option("The workflow a burst starts.", text(max_length=WORKFLOW_NAME_LENGTH)),
    "QUEUE": Option(
        "The queue the flow view shows, which the workflow's steps go through.", text(max_length=QUEUE_NAME_LENGTH)
    ),
    "SIZE": Option("How many runs a burst starts.", number(1, MAX_BURST, integer=True, unit="runs")),
    "INPUT": Option("The input of every run, with a tenant added.", dictionary),
}


def burst_config() -> dict[str, Any]:
    """`settings.DASHBOARD_BURST` over the defaults: which workflow a burst starts, into which
    queue. `ImproperlyConfigured` for a malformed setting (which `durable_flow_dashboard.E005` reports)."""
    value = getattr(settings, "DASHBOARD_BURST", {})
    problem = burst_problem(value)
    if problem:
        raise ImproperlyConfigured(problem)
    return {**DEFAULT_BURST, **value}


def burst_problem(value: object) -> str | None:
    """What is wrong with a `DASHBOARD_BURST` setting, or None: a dict of `BURST_OPTIONS` (names
    the database can store, a `SIZE` from 1 to `MAX_BURST` and an `INPUT` dict)."""
    try:
        parse_options(BURST_OPTIONS, value, "DASHBOARD_BURST")  # type: ignore[arg-type]
    except ImproperlyConfigured as exc:
        return str(exc)
    return None


def burst_inputs(size: int) -> list[dict[str, Any]]:
    """The inputs of a burst: the configured input, with a tenant (fairness key) per run."""
    base = burst_config()["INPUT"]
    tenants = [TENANTS[i % len(TENANTS)] for i in range(size)]
    return [{**base, "tenant": tenant, "key": tenant, "n": i} for i, tenant in enumerate(tenants)]
