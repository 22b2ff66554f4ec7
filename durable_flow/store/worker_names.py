"""A worker's stable name: `host:name`, kept across restarts, held by one live process at a time.

A worker's heartbeat row (`WorkerHeartbeat`, keyed by the worker's id) is the name's lease: a
process takes the name only while no live process holds it, that is while the row is absent,
marked stopped (a graceful stop) or silent past the heartbeat TTL (a crash). The take is one
conditional UPDATE (or the INSERT of a new row), so of two processes starting at once exactly
one gets a name.
"""

from __future__ import annotations

import os
from datetime import datetime

from django.db import IntegrityError, transaction
from django.db.models import Q

from durable_flow.models import WorkerHeartbeat


def take(worker_id: str, host: str, transport: str, cutoff: datetime, now: datetime) -> bool:
    """Take `worker_id` for this process if no live process holds it (a row silent since before
    `cutoff` is a dead process's); True if taken. The row reads as this live process's from now."""
    fields = {
        "host": host,
        "pid": os.getpid(),
        "transport": transport,
        "started_at": now,
        "last_seen": now,
        "stopped_at": None,
        "in_flight": 0,
        "running": [],
    }
    free = Q(stopped_at__isnull=False) | Q(last_seen__lt=cutoff)
    if WorkerHeartbeat.objects.filter(free, worker_id=worker_id).update(**fields):
        return True
    try:
        with transaction.atomic():
            WorkerHeartbeat.objects.create(worker_id=worker_id, **fields)
    except IntegrityError:  # held by a live process (or taken by another one just now)
        return False
    return True


def take_first_free(host: str, prefix: str, transport: str, cutoff: datetime, now: datetime) -> str:
    """Take the lowest-numbered free name `host:<prefix><n>` (n = 0, 1, ...): a worker restarted
    on the same host gets the name it had, once its previous process stopped or lapsed."""
    index = 0
    while not take(f"{host}:{prefix}{index}", host, transport, cutoff, now):
        index += 1
    return f"{host}:{prefix}{index}"
