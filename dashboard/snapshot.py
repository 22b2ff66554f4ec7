"""What the dashboard shows, computed once per live tick: the read model's overview
(`durable_flow.observe.overview`: queues, workers, runs, quotas), each queue's numbers put in
words (its window, its oldest wait, why its calls wait), and the problems worth reading first.
Every value is a plain JSON type, so a tick can go through any channel layer."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from durable_flow.observe.overview import overview

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


def shown_queue(row: dict[str, Any]) -> dict[str, Any]:
    """A queue's row of the read model with its numbers in words: the window's use (`window_text`),
    the oldest wait, why waiters are blocked."""
    rate = row["rate_limit"]
    window_used = row["window_used"]
    shown = {
        **row,
        "window_text": (
            f"{window_used if window_used is not None else '?'} / {rate['limit']} per "
            f"{human_period(rate['period_ms'])}, {rate.get('algorithm', 'fixed')}"
            if rate
            else ""
        ),
        "oldest_wait": human_duration(row["oldest_wait_s"]),
    }
    shown["blocked"] = blocked_reasons(shown)
    shown["blocked_by"] = ", ".join(BLOCKED_LABELS[r["kind"]] for r in shown["blocked"] if r["kind"] in BLOCKED_LABELS)
    return shown


def problems(
    queues: list[dict[str, Any]], workers: list[dict[str, Any]], runs: dict[str, int], rising: int | None
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
    read = overview(timezone.now())
    queues = [shown_queue(row) for row in read.pop("queues")]
    rising = read.pop("failures_rising")
    return {
        "queues": queues,
        "workers": read["workers"],
        "runs": read["runs"],
        "quotas": read["quotas"],
        "start_control": read["start_control"],
        "problems": problems(queues, read["workers"], read["runs"], rising),
        "at": read["at"],
    }
