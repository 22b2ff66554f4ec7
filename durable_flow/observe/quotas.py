"""The busiest start-quota keys, for the dashboard and the admin."""

from __future__ import annotations

from typing import Any

from durable_flow.definitions.quotas import ACTIVE_STATUSES
from durable_flow.models import QuotaRefusal, WorkflowRun


def usage(top: int = 20) -> list[dict[str, Any]]:
    """The busiest quota keys: active runs (every non-terminal status), the limit the latest of
    them started under, and refusals in the last minute. Keys refused lately but with nothing
    active are listed too."""
    from datetime import timedelta

    from django.db.models import Count, Max, Sum
    from django.utils import timezone

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
