"""The run list's filters: one validated form turns the query string into a queryset, so the
page, its pagination links and the bulk actions "by filter" all select the same runs."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django import forms
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.utils import timezone

from durable_flow.models import RunStatus, StepCheckpoint, WorkflowRun

#: The time-range presets of the filter bar, as `?range=` values.
RANGES = {"15m": timedelta(minutes=15), "1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
PAGE_SIZE = 50


class RunFilterForm(forms.Form):
    """The filter bar. Every field is optional; an invalid value is a 400 with the form's error."""

    q = forms.CharField(required=False, max_length=200, label="Run id or input")
    status = forms.MultipleChoiceField(required=False, choices=RunStatus.choices)
    workflow = forms.CharField(required=False, max_length=200)
    queue = forms.CharField(required=False, max_length=100)
    tag = forms.CharField(required=False, max_length=200)
    range = forms.ChoiceField(
        required=False, choices=[("", "any time")] + [(key, f"last {key}") for key in RANGES], label="Started"
    )
    since = forms.DateTimeField(required=False, label="From")
    until = forms.DateTimeField(required=False, label="To")

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        for name in ("q", "workflow", "queue", "tag"):
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
        runs = runs.filter(pk__in=StepCheckpoint.objects.filter(queue=data["queue"]).values("run_id"))
    if data.get("tag"):
        # A JSON list's text holds `"tag"` (quoted) on SQLite and PostgreSQL alike; JSON
        # containment is not available on SQLite.
        runs = runs.annotate(tags_text=Cast("tags", TextField())).filter(tags_text__contains=json.dumps(data["tag"]))
    if data.get("range"):
        runs = runs.filter(created_at__gte=timezone.now() - RANGES[data["range"]])
    if data.get("since"):
        runs = runs.filter(created_at__gte=data["since"])
    if data.get("until"):
        runs = runs.filter(created_at__lte=data["until"])
    if data.get("q"):
        text = data["q"]
        runs = runs.annotate(input_text=Cast("input", TextField())).filter(
            Q(pk=text) | Q(pk__startswith=text) | Q(input_text__icontains=text)
        )
    return runs.order_by("-created_at", "pk")


def run_row(run: WorkflowRun) -> dict[str, Any]:
    """What one line of the run list shows."""
    end = run.finished_at or timezone.now()
    error = run.error or {}
    return {
        "run": run,
        "duration_s": max((end - run.created_at).total_seconds(), 0.0),
        "error": (error.get("message") or "")[:160] if isinstance(error, dict) else str(error)[:160],
        "error_type": error.get("type", "").rsplit(".", 1)[-1] if isinstance(error, dict) else "",
    }


def workflow_names() -> list[str]:
    return sorted(WorkflowRun.objects.order_by().values_list("workflow", flat=True).distinct())
