"""Which runs an operator means: one validated form turns filters (a query string on the
dashboard, a JSON object on the API) into a queryset, so a page, its pagination links, the
dashboard's bulk actions and the API's bulk endpoints all select the same runs; and a page of
them by keyset (`run_page`), so no list counts every run.

Each filter is written so that PostgreSQL answers it from an index however long the history:
the run id by prefix on the primary key's pattern index, a queue by an `EXISTS` probe of the
run's checkpoints, a tag by JSON containment on a GIN index (`df_run_tags`), and text inside
the inputs only when asked for (`in_input`): a case-insensitive LIKE on the input's text, which
a trigram index answers where the deployment added one (`df_run_input_trgm`, documented; not
made by a migration, for what it costs every write of a run), and which reads the runs
otherwise."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django import forms
from django.db import connection
from django.db.models import Exists, OuterRef, Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.utils import timezone

from durable_flow.config.settings import get_settings
from durable_flow.definitions.registry import workflows
from durable_flow.exceptions import InvalidInput
from durable_flow.models import RunStatus, StepCheckpoint, WorkflowRun
from durable_flow.observe.waits import FILTER_CHOICES, waiting_because

#: The time-range presets of the filter bar, as `?range=` values.
RANGES = {"15m": timedelta(minutes=15), "1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
#: A step-concurrency key's scopes, as `?key_scope=` values.
KEY_SCOPES = {"fn": "one workflow", "env": "environment", "account": "account"}


class RunFilterForm(forms.Form):
    """The filter bar. Every field is optional; an invalid value is a 400 with the form's error."""

    q = forms.CharField(required=False, max_length=200, label="Run id")
    in_input = forms.BooleanField(required=False, label="also inside inputs")
    status = forms.MultipleChoiceField(required=False, choices=RunStatus.choices)
    workflow = forms.CharField(required=False, max_length=200)
    queue = forms.CharField(required=False, max_length=100)
    tag = forms.CharField(required=False, max_length=200)
    waiting = forms.ChoiceField(required=False, choices=[("", "anything"), *FILTER_CHOICES], label="Waiting because of")
    key = forms.CharField(required=False, max_length=200, label="Step-concurrency key")
    key_scope = forms.ChoiceField(required=False, choices=[("", "any scope"), *KEY_SCOPES.items()], label="Key scope")
    range = forms.ChoiceField(
        required=False, choices=[("", "any time")] + [(key, f"last {key}") for key in RANGES], label="Started"
    )
    since = forms.DateTimeField(required=False, label="From")
    until = forms.DateTimeField(required=False, label="To")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        for name in ("q", "workflow", "queue", "tag", "key"):
            if "\x00" in (data.get(name) or ""):
                self.add_error(name, "must not contain a NUL character")
        return data


def filtered_runs(data: dict[str, Any]) -> QuerySet[WorkflowRun]:
    """The runs matching a valid `RunFilterForm`'s cleaned data, newest first."""
    runs = WorkflowRun.objects.all()
    if data.get("status"):
        runs = runs.filter(status__in=data["status"])
    if data.get("workflow"):
        runs = runs.filter(workflow=data["workflow"])
    if data.get("queue"):
        runs = runs.filter(on_queue(data["queue"]))
    if data.get("tag"):
        runs = runs.filter(tagged(data["tag"]))
    runs = filter_waiting(runs, data.get("waiting") or "")
    if data.get("key") or data.get("key_scope"):
        runs = holding_key(runs, data.get("key") or "", data.get("key_scope") or "", data.get("workflow") or "")
    if data.get("range"):
        runs = runs.filter(created_at__gte=timezone.now() - RANGES[data["range"]])
    if data.get("since"):
        runs = runs.filter(created_at__gte=data["since"])
    if data.get("until"):
        runs = runs.filter(created_at__lte=data["until"])
    if data.get("q"):
        text = data["q"]
        if data.get("in_input"):
            runs = runs.annotate(input_text=Cast("input", TextField())).filter(
                Q(pk__startswith=text) | Q(input_text__icontains=text)
            )
        else:
            runs = runs.filter(pk__startswith=text)
    return runs.order_by("-created_at", "pk")


def filter_waiting(runs: QuerySet[WorkflowRun], cause: str) -> QuerySet[WorkflowRun]:
    """Unfinished runs with a call waiting because of `cause` (`waits.FILTER_CHOICES`; "" for
    any run), as the engine recorded it when it parked the call."""
    return runs.filter(waiting_because(cause)) if cause else runs


def key_resources(value: str, scope: str, workflow: str) -> list[str]:
    """The admission resources a step-concurrency key names (`step_concurrency.ConcurrencySpec.
    resource`): `value` in `scope` ("" for every scope); of `workflow`, or of every workflow that
    declares a per-workflow constraint, for the `fn` scope. An empty `value` in the `fn` scope is
    a workflow's keyless constraint."""
    resources = []
    if scope in ("", "fn"):
        names = (
            [workflow]
            if workflow
            else [n for n, d in workflows().items() if any(s.scope == "fn" for s in d.concurrency)]
        )
        resources += [f"sc:fn:{name}:{value}" if value else f"sc:fn:{name}" for name in names]
    if value and scope in ("", "env"):
        resources.append(f"sc:env:{get_settings().environment}:{value}")
    if value and scope in ("", "account"):
        resources.append(f"sc:acct:{value}")
    return resources


def holding_key(runs: QuerySet[WorkflowRun], value: str, scope: str, workflow: str) -> QuerySet[WorkflowRun]:
    """The runs whose steps take a slot of the key (`WorkflowRun.step_concurrency` names its
    resource): JSON containment where the database has it (PostgreSQL), else the stored JSON's
    text, which holds `"resource": "<name>"` exactly as Django wrote it."""
    resources = key_resources(value, scope, workflow)
    if not resources:
        return runs.none()
    match = Q()
    if connection.features.supports_json_field_contains:
        for resource in resources:
            match |= Q(step_concurrency__contains=[{"resource": resource}])
        return runs.filter(match)
    for resource in resources:
        match |= Q(sc_text__contains=f'"resource": {json.dumps(resource)}')
    return runs.annotate(sc_text=Cast("step_concurrency", TextField())).filter(match)


def on_queue(queue: str) -> Exists:
    """Runs with a call on `queue`: an `EXISTS` probe of each run's checkpoints (by the
    `(run, key)` index), not a join, which would repeat a run once per call and need a
    `DISTINCT` over every column to undo it."""
    return Exists(StepCheckpoint.objects.filter(run_id=OuterRef("pk"), queue=queue))


def tagged(tag: str) -> Q:
    """Runs whose tags include `tag`. PostgreSQL: JSON containment, answered by the partial GIN
    index `df_run_tags` (runs with tags; the `tags <> '[]'` term lets the planner use it). SQLite
    has no JSON containment: the list's text holds `"tag"`, quoted."""
    if connection.vendor == "postgresql":
        return Q(tags__contains=[tag]) & ~Q(tags=[])
    return Q(
        pk__in=WorkflowRun.objects.annotate(tags_text=Cast("tags", TextField()))
        .filter(tags_text__contains=json.dumps(tag))
        .values("pk")
    )


def runs_from_json(body: dict[str, Any]) -> QuerySet[WorkflowRun]:
    """The runs a JSON filter (the API's bulk endpoints) matches, through the same form.

    Keys are the form's fields (`status` a string or a list of strings, the others strings);
    an unknown key, a value of the wrong type or an invalid value raises `InvalidInput` naming
    it, and an empty filter must say `"all": true`, so a typo never selects every run."""
    body = dict(body)
    select_all = body.pop("all", False)
    if not isinstance(select_all, bool):
        raise InvalidInput('"all" must be true or false')
    fields = RunFilterForm.base_fields
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise InvalidInput(f"unknown filter {unknown[0]!r}; filters are {', '.join(fields)} (and all)")
    data: dict[str, Any] = {}
    for name, value in body.items():
        if name == "in_input":
            if not isinstance(value, bool):
                raise InvalidInput('filter "in_input" must be true or false')
            data[name] = value
            continue
        values = value if name == "status" and isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in values):
            kinds = "a string or a list of strings" if name == "status" else "a string"
            raise InvalidInput(f'filter "{name}" must be {kinds}')
        data[name] = values if name == "status" else value
    if not any(data.values()) and not select_all:
        raise InvalidInput('an empty filter would select every run: name a filter, or send "all": true')
    form = RunFilterForm(data)
    if not form.is_valid():
        name, errors = next(iter(form.errors.items()))
        raise InvalidInput(f'filter "{name}": {" ".join(errors)}')
    return filtered_runs(form.cleaned_data)
