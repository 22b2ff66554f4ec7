"""What the dashboard shows, computed once per live tick: runs and workers from the database,
queue numbers from the admission backend (the one place that knows them under every backend),
and the problems worth reading first. Every value is a plain JSON type, so a tick can go
through any channel layer."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count
from django.utils import timezone

from dashboard import history as hist
from durable_flow.config.settings import get_settings
from durable_flow.engine import get_engine
from durable_flow.models import (
    FlowQueue,
    RunStatus,
    WorkerHeartbeat,
    WorkflowRun,
    dead_worker_cutoff,
)
from durable_flow.observe import quotas as quota_usage
from durable_flow.observe import start_control as start_control_usage
from durable_flow.observe.sampling import parked_calls, waiting_now
from durable_flow.store import queries

#: A queue whose oldest waiter has waited this long is listed among the problems.
BLOCKED_AFTER_S = 60
#: Crashed workers stay on the problem list this long after their last heartbeat.
DEAD_WORKER_NOTICE = timedelta(hours=24)


BLOCKED_LABELS = {"paused": "paused", "rate": "rate window full", "concurrency": "at its cap"}


def human_period(ms: int) -> str:
    """`10000` → `10 s`, `60000` → `1 min`, `3600000` → `1 h`, `500` → `500 ms`."""
    for unit, size in (("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms / 1000:g} s" if ms >= 1000 else f"{ms} ms"


def human_duration(seconds: float | None) -> str:
    """`12.3` → `12.3 s`, `75` → `1 min 15 s`, `3700` → `1 h 1 min`; None → `—`."""
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def blocked_reasons(row: dict[str, Any]) -> list[dict[str, str]]:
    """Why calls wait on this queue now: paused, the rate window full, every slot busy, or (none
    of these) waiting for their next check."""
    reasons = []
    if row["paused"]:
        reasons.append({"kind": "paused", "text": "Paused: the queue admits nothing until it is resumed."})
    rate = row["rate_limit"]
    if rate and row["window_used"] is not None and row["window_used"] >= rate["limit"]:
        reasons.append(
            {
                "kind": "rate",
                "text": f"Rate limit: the window is full ({row['window_text']}); the next call goes in "
                + ("when the oldest start ages out." if rate["algorithm"] == "sliding" else "when the window resets."),
            }
        )
    cap = row["concurrency"]
    if cap is not None and row["in_flight"] is not None and row["in_flight"] >= cap:
        reasons.append(
            {
                "kind": "concurrency",
                "text": f"Concurrency: all {cap} slots are busy; a waiter goes in when a step finishes.",
            }
        )
    if row["waiting"] and not reasons:
        reasons.append(
            {
                "kind": "turn",
                "text": "Nothing blocks now: the backend grants parked calls a slot as room frees "
                "(the poller's tick grants any room left over).",
            }
        )
    return reasons


def queue_rows(now: datetime | None = None) -> list[dict[str, Any]]:
    """One row per registered queue: waiting, in flight vs cap, window use vs limit, paused,
    why waiters are blocked.

    The numbers come from the admission backend (`in_flight`, `waiting`, `window_usage`), which
    holds them under every backend (`local`, `db`, `redis`); the checkpoints give the age of the
    oldest waiting call, and parked calls the backend lost track of (`waiting_now`).
    """
    now = now or timezone.now()
    admission = get_engine().admission
    parked = parked_calls()
    rows = []
    for queue in FlowQueue.objects.all():
        config = queue.config
        parked_n, first = parked.get(queue.name, (0, None))
        in_flight = admission.in_flight(queue.name)
        rate = config.get("rate_limit") or None
        window_used = admission.window_usage(queue.name)
        row: dict[str, Any] = {
            "name": queue.name,
            "paused": queue.paused,
            "waiting": waiting_now(admission, queue.name, parked_n),
            "in_flight": in_flight,
            "slots": in_flight,
            "concurrency": config.get("concurrency"),
            "rate_limit": rate,
            "key_rate_limit": config.get("key_rate_limit"),
            "throttle": config.get("throttle"),
            "retry_ms": config.get("retry_ms", 1000),
            "fairness": config.get("fairness", "fifo"),
            "window_used": window_used,
            "window_text": (
                f"{window_used if window_used is not None else '?'} / {rate['limit']} per "
                f"{human_period(rate['period_ms'])}, {rate.get('algorithm', 'fixed')}"
                if rate
                else ""
            ),
            "oldest_wait_s": round((now - first).total_seconds(), 1) if first else None,
        }
        row["oldest_wait"] = human_duration(row["oldest_wait_s"])
        row["blocked"] = blocked_reasons(row)
        row["blocked_by"] = ", ".join(BLOCKED_LABELS[r["kind"]] for r in row["blocked"] if r["kind"] in BLOCKED_LABELS)
        rows.append(row)
    return rows


def worker_cards(now: datetime | None = None) -> list[dict[str, Any]]:
    """One card per worker heartbeat in a stable order: live ones first, each group by start
    time, so cards keep their places from one heartbeat to the next."""
    now = now or timezone.now()
    cutoff = dead_worker_cutoff(get_settings().heartbeat_ttl_s, now)
    cards = []
    for beat in WorkerHeartbeat.objects.order_by("-last_seen")[:50]:
        alive = beat.stopped_at is None and beat.last_seen >= cutoff
        cards.append(
            {
                "worker_id": beat.worker_id,
                "host": beat.host,
                "pid": beat.pid,
                "alive": alive,
                "state": "alive" if alive else ("stopped" if beat.stopped_at else "dead"),
                "crashed": not alive and beat.stopped_at is None,
                "transport": beat.transport,
                "mode": beat.mode,
                "live_limit": beat.live_limit,
                "in_flight": beat.in_flight,
                "rss_mb": round(beat.rss_bytes / 1_048_576, 1),
                "cpu_percent": beat.cpu_percent,
                "throughput": beat.throughput,
                "p95_ms": round(beat.p95_ms, 1) if beat.p95_ms is not None else None,
                "tasks_done": beat.tasks_done,
                "running": [_running_step(item) for item in beat.running[:20]],
                "last_adjustment": beat.last_adjustment_reason,
                "last_seen": beat.last_seen.isoformat(),
                "silent_s": round((now - beat.last_seen).total_seconds(), 1),
                "started_at": beat.started_at.isoformat(),
            }
        )
    cards.sort(key=lambda c: (not c["alive"], c["started_at"], c["worker_id"]))
    return cards


def _running_step(item: str) -> dict[str, str]:
    """`run_id/key/attempt` → its parts."""
    run_id, key, attempt = queries.parse_running(item)
    return {"run_id": run_id, "key": key, "attempt": attempt}


def run_counts() -> dict[str, int]:
    """Runs per status, every status present (zero when none)."""
    counts = dict(WorkflowRun.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    return {status: counts.get(status, 0) for status in RunStatus.values}


def problems(
    queues: list[dict[str, Any]], workers: list[dict[str, Any]], runs: dict[str, int], now: datetime
) -> list[dict[str, Any]]:
    """What needs a look first, worst first: a crashed worker or none alive, failures rising, a
    queue blocked for a while, a paused queue. Each names where to go."""
    found: list[dict[str, Any]] = []
    if not any(w["alive"] for w in workers) and runs["pending"] + runs["running"] > 0:
        found.append({"level": "bad", "text": "No worker is alive, and runs are waiting for one.", "target": "workers"})
    for w in workers:
        if w["crashed"] and w["silent_s"] < DEAD_WORKER_NOTICE.total_seconds():
            found.append(
                {
                    "level": "bad",
                    "text": f"Worker {w['host']}:{w['pid']} stopped heartbeating "
                    f"{human_duration(w['silent_s'])} ago (its steps are re-dispatched).",
                    "target": "workers",
                    "anchor": w["worker_id"],
                }
            )
    rising = hist.failures_rising(hist.history(now).totals(), now)
    if rising:
        found.append(
            {
                "level": "bad",
                "text": f"Failures rising: {rising} steps failed in the last 5 minutes.",
                "target": "failed",
            }
        )
    for q in queues:
        if q["waiting"] and q["oldest_wait_s"] is not None and q["oldest_wait_s"] >= BLOCKED_AFTER_S:
            why = q["blocked"][0]["text"] if q["blocked"] else ""
            found.append(
                {
                    "level": "bad" if q["oldest_wait_s"] >= 5 * BLOCKED_AFTER_S else "warn",
                    "text": f"Queue {q['name']}: {q['waiting']} waiting, the oldest for {q['oldest_wait']}. {why}",
                    "target": "queue",
                    "queue": q["name"],
                }
            )
        elif q["paused"]:
            found.append(
                {
                    "level": "warn",
                    "text": f"Queue {q['name']} is paused ({q['waiting'] or 0} waiting).",
                    "target": "queue",
                    "queue": q["name"],
                }
            )
    return found


def snapshot() -> dict[str, Any]:
    """Everything the pages show, once."""
    now = timezone.now()
    queues = queue_rows(now)
    workers = worker_cards(now)
    runs = run_counts()
    return {
        "queues": queues,
        "workers": workers,
        "runs": runs,
        "quotas": quota_usage.usage(),
        "start_control": start_control_usage.usage(),
        "problems": problems(queues, workers, runs, now),
        "at": now.isoformat(),
    }
