"""The Django admin: runs to inspect and cancel, queues, worker heartbeats."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone

from durable_flow.conf import get_settings
from durable_flow.models import FlowQueue, StepCheckpoint, WorkerHeartbeat, WorkflowRun
from durable_flow.worker.heartbeat import dead_worker_cutoff


class CheckpointInline(admin.TabularInline):
    """The run's timeline: every call it made, in order."""

    model = StepCheckpoint
    extra = 0
    can_delete = False
    ordering = ["sequence"]
    fields = [
        "sequence",
        "key",
        "kind",
        "name",
        "status",
        "attempt",
        "queue",
        "dispatched_at",
        "wake_at",
        "finished_at",
        "output",
        "error",
    ]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(WorkflowRun)
class WorkflowRunAdmin(admin.ModelAdmin):
    list_display = ["id", "workflow", "status", "concurrency_key", "created_at", "updated_at", "wake_at", "turns"]
    list_filter = ["status", "workflow", "checkpoints__queue"]
    search_fields = ["id", "workflow", "=concurrency_key"]
    date_hierarchy = "created_at"
    readonly_fields = [
        "id",
        "workflow",
        "version",
        "status",
        "input",
        "output",
        "error",
        "wake_at",
        "tags",
        "concurrency_key",
        "parent",
        "parent_step_key",
        "turns",
        "created_at",
        "updated_at",
        "finished_at",
    ]
    inlines = [CheckpointInline]
    actions = ["cancel_selected"]
    change_form_template = "admin/durable_flow/workflowrun/change_form.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        from durable_flow.api import cancel

        count = 0
        for run in queryset:
            if not run.is_terminal:
                cancel(run.id)
                count += 1
        self.message_user(request, f"Cancelled {count} run(s).", messages.SUCCESS)

    def get_urls(self) -> list[Any]:
        return [
            path(
                "<path:object_id>/cancel/",
                self.admin_site.admin_view(self.cancel_view),
                name="durable_flow_workflowrun_cancel",
            ),
            *super().get_urls(),
        ]

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponseRedirect:
        """The detail page's cancel button (POST only, CSRF-checked by the admin view)."""
        from durable_flow.api import cancel

        run = get_object_or_404(WorkflowRun, pk=object_id)
        if request.method != "POST" or not self.has_change_permission(request, run):
            self.message_user(request, "Cancel needs a POST by a user who may change runs.", messages.ERROR)
        else:
            cancel(run.id)
            self.message_user(request, f"Run {run.id} is now {WorkflowRun.objects.get(pk=run.id).status}.")
        return HttpResponseRedirect(reverse("admin:durable_flow_workflowrun_change", args=[run.pk]))


@admin.register(FlowQueue)
class FlowQueueAdmin(admin.ModelAdmin):
    list_display = ["name", "config_summary", "waiting", "updated_at"]
    readonly_fields = ["name", "config", "updated_at"]
    exclude = ["next_arrival", "next_serve"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="Config")
    def config_summary(self, obj: FlowQueue) -> str:
        return ", ".join(f"{k}={v}" for k, v in obj.config.items() if v not in (None, "fifo") and k != "name")

    @admin.display(description="Waiting now")
    def waiting(self, obj: FlowQueue) -> int:
        return StepCheckpoint.objects.filter(queue=obj.name, status="waiting").count()


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(admin.ModelAdmin):
    list_display = [
        "worker_id",
        "alive",
        "transport",
        "mode",
        "live_limit",
        "in_flight",
        "throughput",
        "p95_ms",
        "last_seen",
    ]
    readonly_fields = [f.name for f in WorkerHeartbeat._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(boolean=True)
    def alive(self, obj: WorkerHeartbeat) -> bool:
        return obj.stopped_at is None and obj.last_seen >= dead_worker_cutoff(
            get_settings().heartbeat_ttl_s, timezone.now()
        )
