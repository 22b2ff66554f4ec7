"""What the dashboard's overview reads once per live tick: the queues' numbers, the workers'
cards, run counts, start-quota and start-control usage, and whether failures are rising. Every
value is a plain JSON type (or None), so a tick can go through any channel layer."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from durable_flow.observe import quotas, start_control
from durable_flow.observe.history import failures_rising, history
from durable_flow.observe.queues import queue_rows
from durable_flow.observe.runs import run_counts
from durable_flow.observe.workers import worker_cards


def overview(now: datetime) -> dict[str, Any]:
    """Everything the overview shows, read once at `now`. `failures_rising`: steps failed for
    good in the last five minutes when that is rising (`history.failures_rising`), else None."""
    return {
        "queues": queue_rows(now),
        "workers": worker_cards(now),
        "runs": run_counts(),
        "quotas": quotas.usage(),
        "start_control": start_control.usage(),
        "failures_rising": failures_rising(history(now).totals(), now),
        "at": now.isoformat(),
    }
