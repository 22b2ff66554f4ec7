"""The live flow view: a queue's calls as dots, from the waiting line through the queue's gate
into the worker slots and out; and the "burst" that starts demo runs into it.

The snapshot is what the page draws (and what its WebSocket pushes): each dot is a step call
(`run_id/key`) placed in a zone, so the browser can move a dot from zone to zone as its
checkpoint moves from `waiting` to `dispatched` on a worker to `completed`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from durable_flow.config.limits import QUEUE_NAME_LENGTH, WORKFLOW_NAME_LENGTH
from durable_flow.config.options import Option, dictionary, number, parse_options, text
from durable_flow.config.settings import get_settings
from durable_flow.engine import get_engine
from durable_flow.models import FlowQueue, StepCheckpoint, StepStatus, WorkerHeartbeat, dead_worker_cutoff

#: Dots drawn per zone; the rest are counted ("+120 more").
MAX_DOTS = 120
#: How long a finished call stays in the "out" zone.
DONE_FOR = timedelta(seconds=8)
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


def _dot(cp: dict[str, Any], zone: str) -> dict[str, Any]:
    return {"id": f"{cp['run_id']}/{cp['key']}", "run": cp["run_id"], "zone": zone, "tip": cp.get("tip", "")}


def flow_snapshot(queue: str) -> dict[str, Any]:
    """Where every call of `queue` is now, and the gate's numbers (cap, window, paused)."""
    now = timezone.now()
    row = FlowQueue.objects.filter(pk=queue).first()
    config = row.config if row else {}
    calls = StepCheckpoint.objects.filter(queue=queue)
    waiting_qs = calls.filter(status=StepStatus.WAITING).order_by("-priority", "created_at", "id")
    waiting = [
        _dot({**c, "tip": f"{c['fairness_key'] or c['run_id']} · waiting"}, "waiting")
        for c in waiting_qs.values("run_id", "key", "fairness_key")[:MAX_DOTS]
    ]
    backoff = [
        _dot({**c, "tip": f"attempt {c['attempt']} failed; backing off"}, "backoff")
        for c in calls.filter(status=StepStatus.RETRYING).values("run_id", "key", "attempt")[:MAX_DOTS]
    ]
    cutoff = dead_worker_cutoff(get_settings().heartbeat_ttl_s, now)
    workers = [
        {"id": w.worker_id, "label": f"{w.host}:{w.pid}", "slots": max(w.live_limit, 1), "busy": w.in_flight}
        for w in WorkerHeartbeat.objects.filter(stopped_at=None, last_seen__gte=cutoff).order_by("started_at")[:12]
    ]
    known = {w["id"] for w in workers}
    running = []
    for c in calls.filter(status=StepStatus.DISPATCHED).values("run_id", "key", "worker", "attempt")[:MAX_DOTS]:
        zone = f"worker:{c['worker']}" if c["worker"] in known else "admitted"
        running.append(_dot({**c, "tip": f"attempt {c['attempt']} on {c['worker'] or 'no worker yet'}"}, zone))
    done = [
        _dot({**c, "tip": c["status"]}, "failed" if c["status"] == StepStatus.FAILED else "done")
        for c in calls.filter(status__in=(StepStatus.COMPLETED, StepStatus.FAILED), finished_at__gte=now - DONE_FOR)
        .order_by("-finished_at")
        .values("run_id", "key", "status")[:MAX_DOTS]
    ]
    admission = get_engine().admission
    rate = config.get("rate_limit") or None
    return {
        "queue": queue,
        "known": row is not None,
        "paused": bool(row and row.paused),
        "concurrency": config.get("concurrency"),
        "rate_limit": rate,
        "window_used": admission.window_usage(queue) if row else None,
        "in_flight": admission.in_flight(queue) if row else None,
        "waiting_total": waiting_qs.count(),
        "workers": workers,
        "dots": waiting + backoff + running + done,
        "at": now.isoformat(),
    }
