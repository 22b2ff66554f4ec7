"""What retention keeps and what it removed: the configured ages (the default and each
workflow's own) and the purges' totals, read from the counters every purging process writes
(`store.retention`'s `durable_flow_runs_purged_total` and `durable_flow_rows_purged_total`)."""

from __future__ import annotations

import json
from typing import Any

from django.db.models import Max, Sum

from durable_flow.config.settings import get_settings
from durable_flow.models import MetricCount
from durable_flow.store.retention import ROWS_PURGED, RUNS_PURGED, RetentionPolicy


def summary() -> dict[str, Any]:
    """`{"default_s": seconds or None, "workflows": [(name, seconds)], "runs": n, "rows":
    {table: n}, "last_purge": datetime or None}`: one grouped read of the two counters.
    `last_purge` is the last write of a purge's counts (within a poller pass of the purge)."""
    policy = RetentionPolicy.configured(get_settings())
    counted = (
        MetricCount.objects.filter(metric__in=[RUNS_PURGED, ROWS_PURGED])
        .values("metric", "labels")
        .annotate(total=Sum("value"), last=Max("updated_at"))
    )
    runs, rows, last = 0, {}, None
    for row in counted:
        if row["metric"] == RUNS_PURGED:
            runs += int(row["total"])
            last = row["last"] if last is None else max(last, row["last"])
        else:
            rows.update({value: int(row["total"]) for name, value in json.loads(row["labels"]) if name == "table"})
    return {
        "default_s": None if policy.default is None else policy.default.total_seconds(),
        "workflows": [(name, kept.total_seconds()) for name, kept in sorted(policy.by_workflow.items())],
        "runs": runs,
        "rows": dict(sorted(rows.items())),
        "last_purge": last,
    }
