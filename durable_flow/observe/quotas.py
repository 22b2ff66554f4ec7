"""Start-quota keys as the dashboard and the admin read them: the busiest keys, and each
refusal row's key's active runs and latest limit; the quota page's declared quotas (from the
registry, so a limit shows while nothing runs), the refused starts kept (`StartRefusal`) and
the refusals per minute."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Max, OuterRef, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, TruncMinute
from django.utils import timezone

from durable_flow.definitions.quotas import ACTIVE_STATUSES, CelKey, QuotaSpec
from durable_flow.definitions.registry import workflows
from durable_flow.models import QuotaRefusal, StartRefusal, WorkflowRun


def usage(top: int = 20) -> list[dict[str, Any]]:
    """The busiest quota keys: active runs (every non-terminal status), the limit the latest of
    them started under, and refusals in the last minute. Keys refused lately but with nothing
    active are listed too, with the limit they were refused at."""
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
    idle = [key for key, _ in sorted(refused.items(), key=lambda item: -item[1]) if key not in rows][: top - len(rows)]
    # A key refused with nothing active: the limit its refusals were checked against (kept in
    # the refusal rows of that minute), not "—".
    limits = (
        dict(
            StartRefusal.objects.filter(key__in=idle, at__gte=since.replace(second=0, microsecond=0))
            .values("key")
            .annotate(limit=Max("limit"))
            .order_by()
            .values_list("key", "limit")
        )
        if idle
        else {}
    )
    for key in idle:
        rows[key] = {"key": key, "active": 0, "limit": limits.get(key), "refused_per_min": refused[key]}
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


def describe_quota_key(spec: QuotaSpec) -> str:
    """The key as declared: its CEL expression, a literal, or the callable's name."""
    if isinstance(spec.key, CelKey):
        return spec.key.expression
    if isinstance(spec.key, str):
        return spec.key
    return _callable_name(spec.key)


def describe_limit(spec: QuotaSpec) -> str:
    """`5`, or `per key (plan_limit)` when a callable gives each key its limit."""
    if callable(spec.limit):
        return f"per key ({_callable_name(spec.limit)})"
    return str(spec.limit)


def _callable_name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def declared(now: datetime, top: int = 20) -> list[dict[str, Any]]:
    """Per workflow that declares a start quota (and per workflow whose runs hold a key a
    per-start `quota=` gave): the key as declared, its limit (always: the declaration's, not
    the runs'), the statuses it counts, its keys in use now (`key`, `active` runs of the key in
    any workflow and every non-terminal status, the `limit` its latest run started under; the
    `top` busiest) and its refusals in the last hour."""
    specs = {name: d.quota for name, d in workflows().items() if d.quota is not None}
    held = list(
        WorkflowRun.objects.filter(concurrency_key__isnull=False, status__in=ACTIVE_STATUSES)
        .values("workflow", "concurrency_key")
        .annotate(n=Count("id"), limit=Max("concurrency_limit"))
        .order_by()
    )
    per_key: dict[str, int] = {}
    for row in held:
        per_key[row["concurrency_key"]] = per_key.get(row["concurrency_key"], 0) + row["n"]
    refused = dict(
        StartRefusal.objects.filter(at__gte=now - timedelta(hours=1))
        .values("workflow")
        .annotate(n=Count("id"))
        .order_by()
        .values_list("workflow", "n")
    )
    rows: dict[str, dict[str, Any]] = {}
    for name, spec in sorted(specs.items()):
        statuses = "" if spec.count_statuses == ACTIVE_STATUSES else ", ".join(spec.count_statuses)
        rows[name] = {
            "workflow": name,
            "declared": True,
            "key": describe_quota_key(spec),
            "limit": describe_limit(spec),
            "fixed_limit": None if callable(spec.limit) else spec.limit,
            "counts": statuses,
            "keys": [],
        }
    for row in held:
        name = row["workflow"]
        entry = rows.setdefault(
            name,
            {"workflow": name, "declared": False, "key": "given at start", "limit": "given at start", "counts": ""},
        )
        entry.setdefault("keys", []).append(
            {"key": row["concurrency_key"], "active": per_key[row["concurrency_key"]], "limit": row["limit"]}
        )
    for entry in rows.values():
        entry["keys"] = sorted(entry["keys"], key=lambda k: (-k["active"], k["key"]))[:top]
        entry["active"] = sum(k["active"] for k in entry["keys"])
        entry["refused_last_hour"] = refused.get(entry["workflow"], 0)
    return sorted(rows.values(), key=lambda entry: (not entry["declared"], entry["workflow"]))


@dataclass(frozen=True)
class RefusalPage:
    """The latest refused starts matching a filter (newest first), and whether older ones match
    too: no COUNT of the whole history."""

    rows: list[StartRefusal]
    more: bool


def refusals(workflow: str = "", key: str = "", limit: int = 100) -> RefusalPage:
    """The refused starts kept, newest first, of one workflow and/or key (exact), at most `limit`."""
    found = StartRefusal.objects.all()
    if workflow:
        found = found.filter(workflow=workflow)
    if key:
        found = found.filter(key=key)
    rows = list(found.order_by("-at", "-id")[: limit + 1])
    return RefusalPage(rows=rows[:limit], more=len(rows) > limit)


def refusals_per_minute(
    now: datetime, key: str = "", minutes: int = 60, workflow: str = ""
) -> list[tuple[datetime, float]]:
    """Refused starts per minute over the last `minutes` (every minute, zeros included), of one
    key or of all, and of one workflow or of all. Without a workflow, from the per-minute counts
    (`QuotaRefusal`: at most one row per key and minute, however hot the refusals); a workflow's
    from its refused starts kept (`StartRefusal`, on its `(workflow, at)` index), which are the
    ones that name their workflow (a key is shared by every workflow that uses it)."""
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=minutes - 1)
    if workflow:
        kept = StartRefusal.objects.filter(workflow=workflow, at__gte=start)
        if key:
            kept = kept.filter(key=key)
        per_minute = kept.annotate(m=TruncMinute("at", tzinfo=UTC)).values("m").annotate(n=Count("id"))
        by_minute = dict(per_minute.order_by().values_list("m", "n"))
    else:
        counts = QuotaRefusal.objects.filter(minute__gte=start)
        if key:
            counts = counts.filter(key=key)
        by_minute = dict(counts.values("minute").annotate(n=Sum("refusals")).order_by().values_list("minute", "n"))
    return [
        (start + timedelta(minutes=i), float(by_minute.get(start + timedelta(minutes=i), 0))) for i in range(minutes)
    ]
