"""Queues as the dashboard, the admin and the metrics read them: each registered queue's numbers
(from the admission backend, with the checkpoints' oldest waiter), a queue's calls placed for
the flow view, its busiest fairness keys, and the admission counters.

The numbers here are plain data; what they mean to a reader (why calls wait, a window as text)
is the dashboard's to say.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from durable_flow.config.settings import get_settings
from durable_flow.exceptions import QueueNotFound
from durable_flow.models import FlowQueue, StepCheckpoint, StepKind, StepStatus, WorkerHeartbeat, dead_worker_cutoff
from durable_flow.observe.admission import fleet_in_flight, queue_usage
from durable_flow.observe.sampling import NOT_PARKED, PARKED_COUNT_CAP, parked_calls
from durable_flow.store.counters import decisions

#: Dots the flow view draws per zone; the rest are counted ("+120 more").
MAX_DOTS = 120
#: How long a finished call stays in the flow view's "out" zone.
DONE_FOR = timedelta(seconds=8)
#: Waiting calls, from the front of a queue's line, whose keys the busiest keys count.
KEYS_SAMPLE = 1_000
#: Live workers the flow view draws slots for.
FLOW_WORKERS = 12


def queue_names() -> list[str]:
    """The registered queues' names (the pickers of the run list and the flow view)."""
    return list(FlowQueue.objects.values_list("name", flat=True))


def stored_queue(name: str) -> FlowQueue:
    """The registered queue `name` as stored now (its config after an operator's change);
    `QueueNotFound` for a name no queue has."""
    queue = FlowQueue.objects.filter(pk=name).first()
    if queue is None:
        raise QueueNotFound(f"no queue named {name!r}")
    return queue


def queue_rows(now: datetime | None = None) -> list[dict[str, Any]]:
    """One row per registered queue: waiting, in flight, window use, its configured limits,
    paused, and how long its oldest waiting call has waited.

    The numbers come from the admission backend (`admission.queue_usage`), which holds them under
    every backend (`local`, `db`, `redis`); the checkpoints give the age of the oldest waiting
    call, and parked calls the backend lost track of (`sampling.waiting_now`).
    """
    now = now or timezone.now()
    registered = list(FlowQueue.objects.all())
    parked = parked_calls(queue.name for queue in registered)
    rows = []
    for queue in registered:
        config = queue.config
        line = parked.get(queue.name, NOT_PARKED)
        first = line.oldest
        usage = queue_usage(queue.name, line.n)
        rows.append(
            {
                "name": queue.name,
                "paused": queue.paused,
                "waiting": usage.waiting,
                # The count stopped at the cap and the backend saw no more: "at least".
                "waiting_capped": line.capped and usage.waiting == line.n,
                "in_flight": usage.in_flight,
                "slots": usage.in_flight,
                "concurrency": config.get("concurrency"),
                "rate_limit": config.get("rate_limit") or None,
                "key_rate_limit": config.get("key_rate_limit"),
                "throttle": config.get("throttle"),
                "retry_ms": config.get("retry_ms", 1000),
                "fairness": config.get("fairness", "fifo"),
                "window_used": usage.window_used,
                "oldest_wait_s": round((now - first).total_seconds(), 1) if first else None,
            }
        )
    return rows


def admissions_since(queue: str, since: datetime) -> int:
    """Steps on `queue` dispatched (admitted) since `since`."""
    dispatched = StepCheckpoint.objects.filter(status__in=StepStatus.values, dispatched_at__gt=since)
    return dispatched.filter(kind=StepKind.STEP, queue=queue).count()  # by `(status, dispatched_at)`


def busiest_keys(queue: str, top: int = 10) -> list[dict[str, Any]]:
    """The fairness keys with the most calls on `queue` now: waiting and holding a slot.

    Two reads of the queue's line (`df_checkpoint_queue_line`): the keys of its `KEYS_SAMPLE`
    oldest waiting calls, however long the line (in a longer line, the keys at its front), and
    the calls dispatched (as many as the cap allows)."""
    line = StepCheckpoint.objects.filter(queue=queue)
    oldest = line.filter(status=StepStatus.WAITING).order_by("created_at")[:KEYS_SAMPLE]
    waiting = dict(Counter(oldest.values_list("fairness_key", flat=True)))
    dispatched = {
        key: (n, holding)
        for key, n, holding in line.filter(status=StepStatus.DISPATCHED, kind=StepKind.STEP)
        .values_list("fairness_key")
        .annotate(n=Count("*"), holding=Count("id", filter=Q(holds_slot=True)))
        .values_list("fairness_key", "n", "holding")
        .order_by()
    }
    rows = [
        {
            "fairness_key": key or "(each run its own key)",
            "waiting": waiting.get(key, 0),
            "in_flight": dispatched.get(key, (0, 0))[1],
            "total": waiting.get(key, 0) + dispatched.get(key, (0, 0))[0],
            "key": key,
        }
        for key in waiting.keys() | dispatched.keys()
    ]
    rows.sort(key=lambda row: (-row["total"], row["key"]))
    for row in rows:
        del row["key"]
    return rows[:top]


def waiting_calls(queue: str) -> int | str:
    """Calls parked on `queue` waiting for admission, by the checkpoints (the admin's queue
    list), counted up to `PARKED_COUNT_CAP` (`10000+` past it)."""
    line = parked_calls([queue]).get(queue, NOT_PARKED)
    return f"{line.n}+" if line.capped else line.n


def _dot(cp: dict[str, Any], zone: str) -> dict[str, Any]:
    return {"id": f"{cp['run_id']}/{cp['key']}", "run": cp["run_id"], "zone": zone, "tip": cp.get("tip", "")}


def queue_flow(queue: str) -> dict[str, Any]:
    """Where every call of `queue` is now, as dots in zones (waiting, backing off, admitted, on a
    worker's slot, done or failed), and the gate's numbers (cap, window, paused). Each dot is a
    step call (`run_id/key`), so the flow view can move it from zone to zone as its checkpoint
    moves from `waiting` to `dispatched` on a worker to `completed`."""
    now = timezone.now()
    row = FlowQueue.objects.filter(pk=queue).first()
    config = row.config if row else {}
    calls = StepCheckpoint.objects.filter(queue=queue)
    # In arrival order (the line's index), so the first dots cost the same however long the line.
    waiting_qs = calls.filter(status=StepStatus.WAITING).order_by("created_at", "id")
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
        for w in WorkerHeartbeat.objects.filter(stopped_at=None, last_seen__gte=cutoff).order_by("started_at")[
            :FLOW_WORKERS
        ]
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
    usage = queue_usage(queue) if row else None
    return {
        "queue": queue,
        "known": row is not None,
        "paused": bool(row and row.paused),
        "concurrency": config.get("concurrency"),
        "rate_limit": config.get("rate_limit") or None,
        "window_used": usage.window_used if usage else None,
        "in_flight": usage.in_flight if usage else None,
        "waiting_total": _at_least(waiting_qs.order_by().values("created_at")[:PARKED_COUNT_CAP].count()),
        "workers": workers,
        "dots": waiting + backoff + running + done,
        "at": now.isoformat(),
    }


def _at_least(n: int) -> int | str:
    """A count that stopped at `PARKED_COUNT_CAP`, as shown: `10000+` when it did."""
    return f"{n}+" if n >= PARKED_COUNT_CAP else n


def _per_queue(calls: QuerySet[StepCheckpoint], **aggregate: Any) -> dict[str, Any]:
    """One aggregate of `calls`, grouped by queue, in one query."""
    ((name, expression),) = aggregate.items()
    return dict(calls.values_list("queue").annotate(**{name: expression}).values_list("queue", name).order_by())


def gauges() -> list[dict[str, Any]]:
    """Per registered queue, for the metrics: calls parked waiting for admission (the
    checkpoints, fleet-wide), slots held across the fleet (`admission.fleet_in_flight`), and
    its configured cap and rate window."""
    queues = list(FlowQueue.objects.all())
    # Exact, not capped (a gauge an autoscaler reads): one count of every line, on the index of
    # parked calls alone (`df_checkpoint_waiting`).
    parked = _per_queue(
        StepCheckpoint.objects.filter(status=StepStatus.WAITING, queue__in=[q.name for q in queues]), n=Count("*")
    )
    recorded = _per_queue(StepCheckpoint.objects.filter(status=StepStatus.DISPATCHED, holds_slot=True), n=Count("id"))
    held = fleet_in_flight([q.name for q in queues], recorded)
    return [
        {
            "name": queue.name,
            "waiting": parked.get(queue.name, 0),
            "in_flight": held[queue.name],
            "concurrency": (queue.config or {}).get("concurrency"),
            "rate_limit": (queue.config or {}).get("rate_limit"),
        }
        for queue in queues
    ]


def admission_counts() -> dict[str, dict[str, int]]:
    """Step attempts ever admitted and parked, per named queue (the persisted counters every
    process adds to), with 0 for a registered queue that saw nothing yet."""
    counts = {name: {"admitted": 0, "parked": 0} for name in queue_names()}
    counts.update(decisions())
    return counts
