"""The `db` admission backend's read model: what the admin, the dashboard and the metrics ask
of it (a queue's line, slots, windows and resources, as every process sees them). Reads only:
no lock is taken, so a read never waits behind a decision."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from durable_flow.admission.base import ResourceUsage
from durable_flow.admission.db import keyed as db_keyed
from durable_flow.admission.db import resources as db_resources
from durable_flow.admission.rules.windows import oldest_mark_needed
from durable_flow.config.queues import QueueConfig, queue_from_dict
from durable_flow.models import AdmissionSlot, AdmissionStart, AdmissionWaiter, FlowQueue


class DatabaseReadModel:
    """Mixed into `DatabaseAdmissionBackend`."""

    # Provided by DatabaseAdmissionBackend.
    _now: Callable[[], int]

    @staticmethod
    def _stored_config(queue: str) -> QueueConfig | None:
        """The queue's config as stored on its `FlowQueue` row (what every process decides by)."""
        raw = FlowQueue.objects.filter(name=queue).values_list("config", flat=True).first()
        return queue_from_dict(raw) if raw is not None else None

    @staticmethod
    def _rank_order(config: QueueConfig) -> list[str]:
        """`waiter_line.rank` as an ORDER BY (served by the `df_waiter_rank` index)."""
        # `key_served` is -1 for every waiter of a fifo-fairness queue, so ordering by it changes
        # nothing there but lets the `df_waiter_rank` index serve the ORDER BY (no sort of the
        # whole line per grant).
        return ["-priority", "key_served", "arrival" if config.order == "fifo" else "-arrival"]

    def next_waiters(self, queue: str, limit: int) -> list[str]:
        """The tickets admission would grant next, best first."""
        config = self._stored_config(queue)
        if config is None:
            return []
        waiters = AdmissionWaiter.objects.filter(queue=queue).order_by(*self._rank_order(config))
        return list(waiters.values_list("ticket", flat=True)[:limit])

    def resource_usage(self, resources: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per resource: (slots held, calls waiting), by any process."""
        return db_resources.usage(resources)

    def constraint_usage(self, prefix: str = "", limit: int = 10) -> list[ResourceUsage]:
        """The busiest step-concurrency resources, by any process."""
        return db_resources.busiest(prefix, limit)

    def in_flight(self, queue: str) -> int:
        """Slots held now, by any process."""
        return AdmissionSlot.objects.filter(queue=queue).count()

    def waiting(self, queue: str, limit: int | None = None) -> int:
        """Waiters parked now, by any process, counted up to `limit` (the count reads the
        queue's line in its index, so a cap bounds what a sample of a long line costs)."""
        line = AdmissionWaiter.objects.filter(queue=queue)
        return line.count() if limit is None else line.values("pk")[:limit].count()

    def key_window_usage(self, queue: str, limit: int) -> list[tuple[str, int]] | None:
        """The busiest keys of the per-key window, by any process."""
        config = self._stored_config(queue)
        return db_keyed.usage(config, self._now(), limit) if config is not None else None

    def throttle_usage(self, queue: str, limit: int) -> list[tuple[str, float]] | None:
        """The throttle's busiest buckets, by any process."""
        config = self._stored_config(queue)
        return db_keyed.throttle_usage(config, self._now(), limit) if config is not None else None

    def window_usage(self, queue: str) -> int | None:
        """Step starts in the current rate window, by any process."""
        config = self._stored_config(queue)
        rate = config.rate_limit if config is not None else None
        if rate is None:
            return None
        return AdmissionStart.objects.filter(queue=queue, at_ms__gte=oldest_mark_needed(rate, self._now())).count()
