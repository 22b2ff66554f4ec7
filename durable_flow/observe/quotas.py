"""Start-quota keys as the dashboard and the admin read them: the busiest keys, and each
refusal row's key's active runs and latest limit."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import Count, Max, OuterRef, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from durable_flow.definitions.quotas import ACTIVE_STATUSES
from durable_flow.models import QuotaRefusal, WorkflowRun


def usage(top: int = 20) -> list[dict[str, Any]]:
    """The busiest quota keys: active runs (every non-terminal status), the limit the latest of
    them started under, and refusals in the last minute. Keys refused lately but with nothing
    active are listed too."""
    active = (
        WorkflowRun.objects.filter(concurrency_key__isnull=False, status__in=ACTIVE_STATUSES)
        .values("concurrency_key")
        .annotate(active=Count("id"), limit=Max("concurrency_limit"))
        .order_by("-active", "concurrency_key")[:top]
    )
    since = timezone.now() - timedelta(minutes=1)
    refused = dict(
        QuotaRefusal.objects.filter(minute__gte=since.replace(second=0, microsecond=0))
        .values("key")
        .annotate(total=Sum("refusals"))
        .values_list("key", "total")
    )
    rows = {
        row["concurrency_key"]: {
            "key": row["concurrency_key"],
            "active": row["active"],
            "limit": row["limit"],
            "refused_per_min": refused.get(row["concurrency_key"], 0),
        }
        for row in active
    }
    for key, total in sorted(refused.items(), key=lambda item: -item[1]):
        if key not in rows and len(rows) < top:
            rows[key] = {"key": key, "active": 0, "limit": None, "refused_per_min": total}
    return list(rows.values())


def with_key_usage(refusals: QuerySet[QuotaRefusal]) -> QuerySet[QuotaRefusal]:
    """`refusals` annotated with their key's active runs now (`active_runs`, every non-terminal
    status, as `usage` counts them) and the limit the key's latest run started under
    (`latest_limit`), in the list's one query (not two per row)."""
    runs = WorkflowRun.objects.filter(concurrency_key=OuterRef("key"))
    active = runs.filter(status__in=ACTIVE_STATUSES).order_by().values("concurrency_key")
    latest = runs.exclude(concurrency_limit=None).order_by("-created_at").values("concurrency_limit")[:1]
    return refusals.annotate(
        active_runs=Coalesce(Subquery(active.annotate(n=Count("id")).values("n")), 0),
        latest_limit=Subquery(latest),
    )
