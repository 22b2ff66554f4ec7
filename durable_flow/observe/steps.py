"""Step calls over a recent window, as the metrics' histograms read them: how long each waited
for admission, and how long each ran to its result. Only the latest attempt of a call is on its
checkpoint, so both are per call, not per attempt."""

from __future__ import annotations

from datetime import datetime

from django.db.models import QuerySet

from durable_flow.models import StepCheckpoint, StepKind, StepStatus

#: `(label, begin, end)` rows: a queue or step name, and the two instants a duration spans.
Spans = QuerySet[StepCheckpoint, tuple[str, datetime | None, datetime | None]]


def queue_waits(since: datetime, limit: int) -> Spans:
    """Steps dispatched since `since` (at most `limit`): `(queue, called at, dispatched at)`."""
    # Every status named: the window is a range of the `(status, dispatched_at)` index per status.
    rows = StepCheckpoint.objects.filter(status__in=StepStatus.values, kind=StepKind.STEP, dispatched_at__gte=since)
    return rows.values_list("queue", "created_at", "dispatched_at").order_by()[:limit]


def step_runs(since: datetime, limit: int) -> Spans:
    """Steps settled (completed or failed for good) since `since` (at most `limit`):
    `(step name, dispatched at, finished at)`."""
    rows = StepCheckpoint.objects.filter(
        kind=StepKind.STEP, finished_at__gte=since, status__in=[StepStatus.COMPLETED, StepStatus.FAILED]
    )
    return rows.values_list("name", "dispatched_at", "finished_at").order_by()[:limit]
