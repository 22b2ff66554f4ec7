"""The quota and keys pages' contexts and live fragments: start quotas as declared (their limit
shown while nothing runs), the refused starts kept with their filter and per-minute chart, and
the busy keys of each step-concurrency constraint in the workflow's terms, each linked to the
runs list filtered to it. `dashboard/live.py` registers their topics (`quotas`, `keys`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.http import QueryDict
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from durable_flow.observe import quotas
from durable_flow.observe.admission import step_concurrency
from durable_flow.observe.runs import workflow_names

from . import charts

#: The run statuses a busy key's runs link selects: the ones whose steps may hold or wait for a
#: slot (not debounced: a debounced run has not started a step).
KEY_RUN_STATUSES = ("pending", "running", "suspended", "cancelling")
#: Refused starts listed at most (newest first); older ones are reached by the filter.
REFUSALS_SHOWN = 100
#: Busy keys listed per constraint on the keys page.
KEYS_SHOWN = 50

QUOTAS_FRAGMENTS = ["quota-declared", "quota-refusals", "start-control"]
KEYS_FRAGMENTS = ["step-concurrency"]


class RefusalFilter(forms.Form):
    """The refusal history's filter: a workflow and a quota key, each exact and optional."""

    workflow = forms.CharField(required=False, max_length=200)
    key = forms.CharField(required=False, max_length=200)

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        for name in ("workflow", "key"):
            if "\x00" in (data.get(name) or ""):
                self.add_error(name, "must not contain a NUL character")
        return data


def refusal_filter(params: Mapping[str, Any] | QueryDict) -> RefusalFilter:
    return RefusalFilter(params)


def runs_href(params: Mapping[str, str], statuses: tuple[str, ...] = KEY_RUN_STATUSES) -> str:
    """The runs list filtered by `params` and `statuses`."""
    query = [(name, value) for name, value in params.items() if value] + [("status", s) for s in statuses]
    return f"{reverse('dashboard:runs')}?{urlencode(query)}"


def quotas_context(snap: Mapping[str, Any], workflow: str = "", key: str = "") -> dict[str, Any]:
    """The quota page: declared quotas with their keys in use, debounce and singleton, and the
    refused starts (filtered by `workflow` and `key`) with their chart."""
    now = parse_datetime(snap["at"]) or timezone.now()
    declared = quotas.declared(now)
    for row in declared:
        for k in row["keys"]:
            k["href"] = runs_href({"tag": f"concurrency:{k['key']}"})
            k["refusals_href"] = f"{reverse('dashboard:quotas')}?{urlencode({'key': k['key']})}"
    history = quotas.refusals(workflow, key, REFUSALS_SHOWN)
    scope = chart_scope(workflow, key)
    chart = charts.line_chart(
        f"Refused starts per minute over the last hour, {scope}",
        {"failures": quotas.refusals_per_minute(now, key, workflow=workflow)},
        {"failures": "refused / min"},
        now,
        timedelta(hours=1),
        60,
    )
    return {
        "snap": snap,
        "declared": declared,
        "refusals": [{"row": r, "runs_href": runs_href({"tag": f"concurrency:{r.key}"})} for r in history.rows],
        "more_refusals": history.more,
        "refusals_shown": REFUSALS_SHOWN,
        "filter": {"workflow": workflow, "key": key},
        "filter_query": urlencode({k: v for k, v in (("workflow", workflow), ("key", key)) if v}),
        # A start refused under a per-start quota names a workflow that declares none: every
        # registered workflow can be picked (from the registry, not a scan of the history).
        "workflows": sorted(
            {row["workflow"] for row in declared} | set(workflow_names()) | ({workflow} if workflow else set())
        ),
        "refusal_chart": chart,
        "refusal_scope": scope,
    }


def chart_scope(workflow: str, key: str) -> str:
    """Whose refusals the chart counts, in words: `workflow billing.export, key acme`, `all workflows and keys`."""
    parts = ([f"workflow {workflow}"] if workflow else []) + ([f"key {key}"] if key else [])
    return ", ".join(parts) or "all workflows and keys"


def keys_context(snap: Mapping[str, Any], top: int = KEYS_SHOWN) -> dict[str, Any]:
    """The keys page (and the queues page's step-concurrency table): each declared constraint
    with its busy keys, each linked to its runs."""
    constraints = step_concurrency(top)
    for row in constraints:
        for k in row["busiest"]:
            k["href"] = runs_href(k["filter"])
    return {"snap": snap, "constraints": constraints, "keys_href": reverse("dashboard:keys")}


def quotas_topic(snap: Mapping[str, Any], argument: str) -> dict[str, str]:
    """The `quotas:<query>` live topic: the page's fragments under the filter its query gives."""
    form = refusal_filter(QueryDict(argument))
    data = form.cleaned_data if form.is_valid() else {}
    context = quotas_context(snap, data.get("workflow", ""), data.get("key", ""))
    return fragments(QUOTAS_FRAGMENTS, context)


def keys_topic(snap: Mapping[str, Any], _: str) -> dict[str, str]:
    """The `keys` live topic."""
    return fragments(KEYS_FRAGMENTS, keys_context(snap))


def fragments(names: list[str], context: Mapping[str, Any]) -> dict[str, str]:
    """Each fragment template (`dashboard/fragments/<name>.html`) rendered with the page's context."""
    return {name: render_to_string(f"dashboard/fragments/{name}.html", dict(context)) for name in names}
