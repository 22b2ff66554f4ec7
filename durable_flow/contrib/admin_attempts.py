"""The run page's attempt history in the admin: one row per step attempt, with its worker,
times and error (the traceback in a `<pre>`), kept when a later attempt succeeds."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html

from durable_flow.models import StepAttempt


class StepAttemptInline(admin.TabularInline):
    """Every attempt of every step of the run, in order."""

    model = StepAttempt
    fk_name = "run"
    extra = 0
    can_delete = False
    verbose_name = "step attempt"
    fields = [
        "step",
        "attempt",
        "status",
        "worker",
        "dispatched_at",
        "started_at",
        "finished_at",
        "duration",
        "failure",
    ]
    readonly_fields = fields
    ordering = ["checkpoint__sequence", "attempt"]

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).select_related("checkpoint")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="Step")
    def step(self, obj: StepAttempt) -> str:
        return f"{obj.checkpoint.key} {obj.checkpoint.name}"

    @admin.display(description="Ran for")
    def duration(self, obj: StepAttempt) -> str:
        if obj.started_at is None or obj.finished_at is None:
            return "—"
        return f"{(obj.finished_at - obj.started_at).total_seconds() * 1000:.0f} ms"

    @admin.display(description="Error")
    def failure(self, obj: StepAttempt) -> str:
        if not obj.error:
            return "—"
        return format_html(
            "<b>{}</b>: {}<details><summary>traceback</summary><pre>{}</pre></details>",
            obj.error.get("type", ""),
            obj.error.get("message", ""),
            obj.error.get("traceback", ""),
        )
