"""Each page's context, built from one snapshot, and its live fragments: the same templates
render the page without JavaScript and the fragments every tick pushes (`dashboard/live.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from django.template.loader import render_to_string
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from durable_flow.config.settings import get_settings
from durable_flow.config.validation import MAX_DURATION_MS
from durable_flow.observe.admission import key_windows, throttle_buckets
from durable_flow.observe.history import SPAN, History, Sample, history
from durable_flow.observe.queues import admissions_since, busiest_keys
from durable_flow.observe.retention import summary as retention_summary
from durable_flow.observe.runs import RUN_COUNT_CAP

from . import charts
from .limit_pages import keys_context

RUN_STATUS_ORDER = ["failed", "running", "pending", "debounced", "suspended", "cancelling", "completed", "cancelled"]


def runs_url(status: str | None = None) -> str:
    """The run list filtered by status: the dashboard's own list when it is installed, the
    admin's otherwise."""
    try:
        base, param = reverse("dashboard:runs"), "status"
    except NoReverseMatch:
        base, param = reverse("admin:durable_flow_workflowrun_changelist"), "status__exact"
    return f"{base}?{param}={status}" if status else base


def _at(snap: Mapping[str, Any]) -> datetime:
    return parse_datetime(snap["at"]) or timezone.now()


def _problem_links(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    links = []
    for problem in snap["problems"]:
        target = problem["target"]
        if target == "queue":
            href = reverse("dashboard:queue", args=[problem["queue"]])
        elif target == "failed":
            href = runs_url("failed")
        else:
            href = reverse("dashboard:workers") + (f"#worker-{problem['anchor']}" if problem.get("anchor") else "")
        links.append({**problem, "href": href})
    return links


def _rate(samples: list[Sample], field: str) -> list[tuple[datetime, float]]:
    return [(s.at, s.per_min(getattr(s, field))) for s in samples]


def _gauge(samples: list[Sample], field: str) -> list[tuple[datetime, float]]:
    return [(s.at, float(getattr(s, field))) for s in samples]


def _every(samples: list[Sample]) -> float:
    return samples[-1].interval_s if samples else get_settings().sample_interval_s


FAILURE_LABELS = {
    "throughput": "completed / min",
    "attempt_failures": "failed attempts / min (retried ones too)",
    "failures": "failed for good / min",
}


def overview_charts(past: History, now: datetime) -> list[Any]:
    """Throughput and failures per minute (every failed attempt, and steps failed for good); and
    the backlog, on its own scale."""
    totals = past.totals()
    every = _every(totals)
    return [
        charts.line_chart(
            "Steps completed, attempts failed and steps failed for good, per minute",
            {
                "throughput": _rate(totals, "completions"),
                "attempt_failures": _rate(totals, "failed_attempts"),
                "failures": _rate(totals, "failures"),
            },
            FAILURE_LABELS,
            now,
            SPAN,
            every,
        ),
        charts.line_chart(
            "Backlog: calls waiting for admission, and steps in flight",
            {"backlog": _gauge(totals, "waiting"), "in_flight": _gauge(totals, "in_flight")},
            {"backlog": "waiting", "in_flight": "in flight"},
            now,
            SPAN,
            every,
        ),
    ]


def _queue_table(snap: Mapping[str, Any], past: History) -> list[dict[str, Any]]:
    rows = []
    for q in snap["queues"]:
        samples = past.queues.get(q["name"], [])[-60:]
        rows.append(
            {
                **q,
                "href": reverse("dashboard:queue", args=[q["name"]]),
                "backlog_spark": charts.sparkline(
                    f"{q['name']} waiting, last {len(samples)} samples", [s.waiting for s in samples], "backlog"
                ),
            }
        )
    return rows


def _worker_cards(snap: Mapping[str, Any], past: History) -> list[dict[str, Any]]:
    cards = []
    for w in snap["workers"]:
        points = past.workers.get(w["worker_id"], [])
        running = [{**step, "href": _run_href(step["run_id"])} for step in w["running"]]
        cards.append(
            {
                **w,
                "running": running,
                "silent": f"{w['silent_s']:.0f} s",
                "sparks": [
                    ("Limit", charts.sparkline("live limit", [p[0] for p in points], "admissions")),
                    ("In flight", charts.sparkline("in flight", [p[1] for p in points], "in_flight")),
                    ("Throughput", charts.sparkline("tasks per second", [p[2] for p in points], "throughput")),
                ],
            }
        )
    return cards


def _run_href(run_id: str) -> str:
    try:
        return reverse("dashboard:run", args=[run_id])
    except NoReverseMatch:
        return reverse("admin:durable_flow_workflowrun_change", args=[run_id])


def overview_context(snap: Mapping[str, Any]) -> dict[str, Any]:
    """The overview page: problems with links, run counts with links, charts, queues, workers."""
    now = _at(snap)
    past = history(now)
    return {
        "snap": snap,
        "problems": _problem_links(snap),
        # Live statuses with their numbers; finished ones as links only (never counted by a
        # scan of the history).
        "run_counts": [
            {
                "status": s,
                "n": snap["runs"].get(s),
                "at_least": snap["runs"].get(s, 0) >= RUN_COUNT_CAP,
                "href": runs_url(s),
            }
            for s in RUN_STATUS_ORDER
        ],
        "charts": overview_charts(past, now),
        "queue_table": _queue_table(snap, past),
        "workers": _worker_cards(snap, past),
        "workers_alive": sum(1 for w in snap["workers"] if w["alive"]),
        "retention": retention_context(),
    }


def retention_context() -> dict[str, Any]:
    """The overview's retention line: how long finished runs are kept (by default, per
    workflow) and what purges removed so far. Read at page load, not on the live tick."""
    read = retention_summary()

    def kept(seconds: float | None) -> str | None:
        if seconds is None:
            return None
        for unit, size in (("day", 86_400), ("hour", 3600), ("minute", 60)):
            if seconds >= size and seconds % size == 0:
                n = int(seconds // size)
                return f"{n} {unit}{'s' if n != 1 else ''}"
        return f"{seconds:g} seconds"

    return {
        **read,
        "default": kept(read["default_s"]),
        "workflows": [(name, kept(seconds)) for name, seconds in read["workflows"]],
        "with_rows": ", ".join(f"{n} {table}" for table, n in read["rows"].items() if table != "runs" and n),
    }


def queues_context(snap: Mapping[str, Any]) -> dict[str, Any]:
    """The queues page: the queue table with backlog sparklines, and the busiest keys of each
    step-concurrency constraint (from the admission backend), linked to their runs."""
    return {**keys_context(snap, top=10), "queue_table": _queue_table(snap, history(_at(snap)))}


def workers_context(snap: Mapping[str, Any]) -> dict[str, Any]:
    """The workers page: cards with sparklines and the steps each runs."""
    return {"snap": snap, "workers": _worker_cards(snap, history(_at(snap)))}


def queue_context(snap: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The queue page, or None for an unknown queue."""
    row = next((q for q in snap["queues"] if q["name"] == name), None)
    if row is None:
        return None
    now = _at(snap)
    samples = history(now).queues.get(name, [])
    cap, rate = row["concurrency"], row["rate_limit"]
    return {
        "snap": snap,
        "q": row,
        "resize": resize_initial(row),
        "admissions_per_min": admissions_since(name, now - timedelta(minutes=1)),
        "in_flight_pct": min(100, round(100 * (row["in_flight"] or 0) / cap)) if cap else None,
        "window_pct": min(100, round(100 * (row["window_used"] or 0) / rate["limit"])) if rate else None,
        "keys": busiest_keys(name),
        "key_windows": key_windows(name, row.get("key_rate_limit")),
        "throttle_buckets": throttle_buckets(name, row.get("throttle")),
        "depth_chart": charts.line_chart(
            f"{name}: waiting and in flight over the last hour",
            {"backlog": _gauge(samples, "waiting"), "in_flight": _gauge(samples, "in_flight")},
            {"backlog": "waiting", "in_flight": "in flight"},
            now,
            SPAN,
            _every(samples),
        ),
        "rate_chart": charts.line_chart(
            f"{name}: admissions, completions and failures per minute over the last hour",
            {
                "admissions": _rate(samples, "admissions"),
                "throughput": _rate(samples, "completions"),
                "attempt_failures": _rate(samples, "failed_attempts"),
                "failures": _rate(samples, "failures"),
            },
            {"admissions": "admitted / min", **FAILURE_LABELS},
            now,
            SPAN,
            _every(samples),
        ),
    }


def fragments(names: list[str], context: Mapping[str, Any]) -> dict[str, str]:
    """Render each fragment template (`dashboard/fragments/<name>.html`) with the page's context."""
    return {name: render_to_string(f"dashboard/fragments/{name}.html", dict(context)) for name in names}


OVERVIEW_FRAGMENTS = [
    "problems",
    "run-counts",
    "overview-chart",
    "queues-table",
    "quotas",
    "start-control",
    "workers-summary",
]
QUEUE_FRAGMENTS = ["queue-stats", "queue-why", "queue-charts", "queue-keys"]
QUEUES_FRAGMENTS = ["queues-table", "step-concurrency"]


#: The resize form's window groups: (field prefix, the window's `per`, its key in the config, legend).
RESIZE_WINDOWS = (
    ("rate", "global", "rate_limit", "Rate window, all calls"),
    ("key_rate", "key", "key_rate_limit", "Rate window, per key"),
)


def resize_initial(row: Mapping[str, Any]) -> dict[str, Any]:
    """The resize form's fields as the queue is configured now. The form sends every option
    back (a blank one removes it), so each must show its current value: a per-key window or a
    throttle the form did not show would be removed by resizing the cap."""
    windows = []
    for prefix, _, config_key, legend in RESIZE_WINDOWS:
        window = row.get(config_key) or {}
        windows.append(
            {
                "prefix": prefix,
                "legend": legend,
                "limit": _text(window.get("limit")),
                "period_s": _seconds(window.get("period_ms")),
                "algorithm": window.get("algorithm", "fixed"),
            }
        )
    throttle = row.get("throttle") or {}
    return {
        "concurrency": _text(row.get("concurrency")),
        "windows": windows,
        "throttle_limit": _text(throttle.get("limit")),
        "throttle_period_s": _seconds(throttle.get("period_ms")),
        "throttle_burst": _text(throttle.get("burst")),
        "throttle_per": throttle.get("per", "global"),
    }


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _seconds(period_ms: object) -> str:
    """A period in seconds as the form shows it: `60`, `0.5`, `1.25` (milliseconds kept exact)."""
    if not isinstance(period_ms, int):
        return ""
    return str(Decimal(period_ms) / 1000) if period_ms % 1000 else str(period_ms // 1000)


def parse_resize_form(post: Mapping[str, Any]) -> dict[str, Any]:
    """The resize form's fields → `update_queue` keyword arguments, the whole config at once:
    the cap, both windows (global and per key) and the throttle; a blank limit removes that
    option. ValueError (shown to the user) for anything that is not a number."""

    def field(name: str) -> str:
        return str(post.get(name, "")).strip()

    def number(name: str) -> int | None:
        raw = field(name)
        if not raw:
            return None
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{name.replace('_', ' ')} must be a positive whole number, got {raw!r}")
        return int(raw)

    def period_ms(name: str, needed_by: str) -> int:
        raw = field(name)
        if not raw:
            raise ValueError(f"{needed_by} needs a period in seconds")
        try:
            seconds = Decimal(raw)
        except InvalidOperation:
            raise ValueError(f"{name.replace('_', ' ')} must be a number of seconds, got {raw!r}") from None
        # Bounded before it is multiplied: `1e999999` seconds overflows the decimal context.
        in_range = seconds.is_finite() and seconds <= MAX_DURATION_MS // 1000
        ms = seconds * 1000 if in_range else Decimal(0)
        if ms < 1 or ms != ms.to_integral_value():
            raise ValueError(
                f"{name.replace('_', ' ')} must be whole milliseconds from 0.001 to {MAX_DURATION_MS // 1000} s, "
                f"got {raw!r}"
            )
        return int(ms)

    def choice(name: str, allowed: tuple[str, ...]) -> str:
        value = field(name) or allowed[0]
        if value not in allowed:
            raise ValueError(f"{name.replace('_', ' ')} is one of {', '.join(allowed)}, got {value!r}")
        return value

    windows = []
    for prefix, per, _, _ in RESIZE_WINDOWS:
        limit = number(f"{prefix}_limit")
        if limit is None:
            continue
        window = {
            "limit": limit,
            "period_ms": period_ms(f"{prefix}_period_s", "a rate limit"),
            "algorithm": choice(f"{prefix}_algorithm", ("fixed", "sliding")),
        }
        windows.append(window | ({"per": per} if per == "key" else {}))
    throttle = None
    if (throttle_limit := number("throttle_limit")) is not None:
        throttle = {
            "limit": throttle_limit,
            "period_ms": period_ms("throttle_period_s", "a throttle"),
            "burst": number("throttle_burst") or 1,
            "per": choice("throttle_per", ("global", "key")),
        }
    return {"concurrency": number("concurrency"), "rate_limit": windows or None, "throttle": throttle}
