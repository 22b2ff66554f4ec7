"""Worker heartbeats: every few seconds a worker writes its live numbers to `WorkerHeartbeat`.

A worker whose `last_seen` is older than `HEARTBEAT["TTL_S"]` is dead: the dashboard shows it
so, and the poller re-dispatches the steps it was executing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections import deque
from datetime import datetime
from typing import Any

import psutil
from django.utils import timezone

from durable_flow.config.limits import ADJUSTMENT_REASON_LENGTH
from durable_flow.models import WorkerHeartbeat, dead_worker_cutoff
from durable_flow.runtime.concurrency import ConcurrencyController, ResourceSample
from durable_flow.store import worker_names

#: The default names of `durable_worker`s: `w0`, `w1`, ... per host (`claim_worker_id`).
DEFAULT_NAME_PREFIX = "w"


def new_worker_id() -> str:
    """host:pid:random, unique across restarts that reuse a pid: the id of a runtime built
    without one (tests, scripts). `durable_worker` takes a stable one (`claim_worker_id`)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class WorkerNameTaken(Exception):
    """Another live process holds the worker name asked for."""


def claim_worker_id(
    name: str | None, transport: str, ttl_s: float, interval_s: float, *, sleep: Any = time.sleep
) -> str:
    """The id `host:name` of this worker, taken for this process (`store.worker_names`), stable
    across restarts so its metric series and its dashboard card continue.

    Without `name`, the lowest free `w<n>` on this host: the n-th worker of a host keeps its
    name across a deploy's graceful restarts. A worker that crashed keeps its name until its
    heartbeat lapses (`ttl_s`), so one restarted at once takes the next free number meanwhile.
    With `name`, waits (up to the TTL and two beats) for a crashed holder's heartbeat to lapse;
    `WorkerNameTaken` if a live worker still holds it then.
    """
    host = socket.gethostname()
    if name is None:
        return worker_names.take_first_free(
            host, DEFAULT_NAME_PREFIX, transport, dead_worker_cutoff(ttl_s), timezone.now()
        )
    worker_id = f"{host}:{name}"
    deadline = time.monotonic() + ttl_s + 2 * interval_s
    while not worker_names.take(worker_id, host, transport, dead_worker_cutoff(ttl_s), timezone.now()):
        if time.monotonic() >= deadline:
            raise WorkerNameTaken(f"worker {worker_id!r} is held by a live worker (its heartbeat is fresh)")
        sleep(interval_s)
    return worker_id


def cgroup_memory_limit() -> int | None:
    """The cgroup v2 (or v1) memory limit of this process's container, if one is set."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as handle:
                raw = handle.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:  # v1 reports "no limit" as a huge number
            return int(raw)
        return None
    return None


class WorkerStats:
    """Latencies and completions, shared by the task threads and the heartbeat."""

    def __init__(self, window: int = 512) -> None:
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=window)
        self.done = 0
        self.in_flight = 0

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, latency_ms: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.done += 1
            self._latencies.append(latency_ms)

    def p95_ms(self) -> float | None:
        with self._lock:
            if not self._latencies:
                return None
            ordered = sorted(self._latencies)
            return ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


class Heartbeat:
    """Writes one worker's `WorkerHeartbeat` row and samples its RSS and CPU."""

    def __init__(
        self, worker_id: str, transport: str, queues: list[str], stats: WorkerStats, controller: ConcurrencyController
    ) -> None:
        self.worker_id = worker_id
        self.transport = transport
        self.queues = queues
        self.stats = stats
        self.controller = controller
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # prime: the first call always answers 0.0
        psutil.cpu_percent(None)
        self.started_at = timezone.now()
        self._last_done = 0
        self._last_time = time.monotonic()

    def sample(self) -> ResourceSample:
        """What the adaptive loop brakes on: memory pressure and machine CPU.

        `ram_pct` is the host's memory in use, or this process's RSS against the container's
        cgroup memory limit when one is set, whichever is higher: an out-of-memory kill comes
        from whichever runs out first. `cpu_pct` is the machine's CPU use since the last
        sample (all cores), the load that a CPU ceiling protects.
        """
        ram_pct = psutil.virtual_memory().percent
        limit = cgroup_memory_limit()
        if limit:
            ram_pct = max(ram_pct, 100.0 * self.process.memory_info().rss / limit)
        return ResourceSample(ram_pct=ram_pct, cpu_pct=psutil.cpu_percent(None), in_flight=self.stats.in_flight)

    def beat(self, stopped: bool = False, running: list[str] | None = None, seen_at: datetime | None = None) -> None:
        """Write the row now. `running` lists the step attempts executing here
        (`run_id/key/attempt`), so the poller can tell a step this live worker dropped;
        `seen_at` (default: now) is when that list was read, the beat's `last_seen`."""
        now_mono = time.monotonic()
        done = self.stats.done
        elapsed = max(1e-6, now_mono - self._last_time)
        throughput = (done - self._last_done) / elapsed
        self._last_done, self._last_time = done, now_mono
        adjustment = self.controller.last_adjustment
        reason = adjustment.reason if adjustment else ""
        now = seen_at or timezone.now()
        WorkerHeartbeat.objects.update_or_create(
            worker_id=self.worker_id,
            defaults={
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "transport": self.transport,
                "queues": self.queues,
                "started_at": self.started_at,
                "last_seen": now,
                "stopped_at": now if stopped else None,
                "mode": self.controller.mode,
                "live_limit": self.controller.limit,
                "in_flight": max(0, self.stats.in_flight),
                "rss_bytes": self.process.memory_info().rss,
                "cpu_percent": round(self.process.cpu_percent(None), 1),
                "throughput": round(throughput, 2),
                "p95_ms": self.stats.p95_ms(),
                "tasks_done": done,
                "running": running or [],
                "last_adjustment_at": (
                    datetime.fromtimestamp(adjustment.at_ms / 1000, tz=timezone.get_current_timezone())
                    if adjustment
                    else None
                ),
                "last_adjustment_reason": reason[:ADJUSTMENT_REASON_LENGTH],
            },
        )
