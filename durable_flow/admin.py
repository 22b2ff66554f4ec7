"""The Django admin: runs to inspect and cancel, queues, worker heartbeats, the JSON API's access tokens."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db import DataError, NotSupportedError
from django.db.models import CharField, QuerySet
from django.db.models.constants import LOOKUP_SEP
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from durable_flow.config.validation import storable_text
from durable_flow.contrib.admin_attempts import StepAttemptInline
from durable_flow.contrib.admin_bulk import BulkByFilterMixin
from durable_flow.contrib.admin_run_list import CappedCountPaginator, QueueFilter, WorkflowFilter, run_search
from durable_flow.contrib.admin_tokens import AccessTokenAdminMixin
from durable_flow.exceptions import DurableFlowError, InvalidInput
from durable_flow.models import (
    AccessToken,
    Event,
    EventDelivery,
    FlowQueue,
    QuotaRefusal,
    Schedule,
    StartRefusal,
    StepCheckpoint,
    WorkerHeartbeat,
    WorkflowRun,
)
from durable_flow.observe import queues, quotas, runs, workers
from durable_flow.observe.admission import step_concurrency
from durable_flow.operations.api import cancel, pause_queue, rerun, resume_queue, retry, send_signal, start
from durable_flow.operations.audit import record_operation
from durable_flow.operations.forms import SignalForm, StartForm
from durable_flow.operations.schedules import pause_schedule, resume_schedule


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


#: Lookups a changelist URL may not use: the database compiles the pattern (an invalid one fails
#: inside SQLite's or PostgreSQL's matcher), and the admin's own filters never build one.
REFUSED_LOOKUPS = frozenset({"regex", "iregex"})


class UrlSafeAdmin(admin.ModelAdmin):
    """The app's admins: a value from the URL the database cannot take is an invalid filter (the
    changelist's `?e=1` page), a refused lookup (400) or an object that does not exist, never a
    500."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        if lookup.rsplit(LOOKUP_SEP, 1)[-1] in REFUSED_LOOKUPS:
            return False
        return super().lookup_allowed(lookup, value, request)

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """A filter value no database stores (a NUL, which SQLite's LIKE would also read as the end
        of its pattern: "%" matches every row) or that the database refuses (a year of 20 digits)
        is a bad request the changelist reports as such."""
        if any("\x00" in f"{key}{value}" for key, values in request.GET.lists() for value in values):
            raise IncorrectLookupParameters("a filter value contains a NUL character")
        try:
            return super().get_changelist_instance(request)
        except (OverflowError, ValueError, NotSupportedError, DataError) as exc:
            raise IncorrectLookupParameters(str(exc)) from exc

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> tuple[Any, bool]:
        """Nothing for a term with a NUL (the autocomplete's `?term=`; the changelist refuses it
        first): it names no row, and PostgreSQL would refuse the query."""
        if "\x00" in search_term:
            return queryset.none(), False
        return super().get_search_results(request, queryset, search_term)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        """A ticked id with a NUL (only a forged form sends one) names no row: the action does
        nothing and says why, instead of a query PostgreSQL refuses. Django 6.1's
        `action_location` (and whatever a later version adds) is passed on."""
        if any("\x00" in pk for pk in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)):
            self.message_user(request, "A selected id contains a NUL character; nothing was done.", messages.ERROR)
            return None
        return super().response_action(request, queryset, *args, **kwargs)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        """None (the admin's "doesn't exist") for a text key the database cannot store, as for
        any other id that names no row."""
        field = self.model._meta.pk if from_field is None else self.model._meta.get_field(from_field)
        if isinstance(field, CharField) and field.max_length is not None:
            try:
                storable_text(object_id, field.name, field.max_length)
            except InvalidInput:
                return None
        return super().get_object(request, object_id, from_field)


@admin.register(WorkflowRun)
class WorkflowRunAdmin(BulkByFilterMixin, UrlSafeAdmin):
    list_display = ["id", "workflow", "status", "concurrency_key", "created_at", "updated_at", "wake_at", "turns"]
    # Fast on a long history (`contrib/admin_run_list.py`): choices from the registry and the
    # queue table, the queue by EXISTS, the search on indexes, a count that stops at a cap and
    # no total count; no date hierarchy (each view would sort every run's creation date).
    list_filter = ["status", WorkflowFilter, QueueFilter]
    search_fields = ["id"]  # shows the search box; `get_search_results` says what it matches
    search_help_text = "A run id or its start (case-sensitive), or a workflow, quota key or start key exactly."
    paginator = CappedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    readonly_fields = [
        "id",
        "workflow",
        "version",
        "status",
        "executing_now",
        "input",
        "output",
        "error",
        "wake_at",
        "tags",
        "concurrency_key",
        "start_key",
        "debounce_until",
        "step_concurrency",
        "parent",
        "parent_step_key",
        "rerun_of",
        "turns",
        "created_at",
        "updated_at",
        "finished_at",
    ]
    inlines = [CheckpointInline, StepAttemptInline]
    actions = ["cancel_selected", "retry_selected"]
    change_form_template = "admin/durable_flow/workflowrun/change_form.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun], search_term: str
    ) -> tuple[QuerySet[WorkflowRun], bool]:
        if "\x00" in search_term:
            return queryset.none(), False
        return run_search(queryset, search_term), False

    @admin.display(description="Executing now")
    def executing_now(self, obj: WorkflowRun) -> str:
        """From live workers' heartbeats: the one place that shows an optimistic first step."""
        return "; ".join(runs.executing_now(obj.pk)) or "—"

    # Runs change only through operations (cancel, re-run, signal), never by editing fields:
    # the change page is read-only and only finished runs may be deleted.
    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is not None and obj.is_terminal and super().has_delete_permission(request, obj)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_flow.cancel_workflowrun")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_flow.retry_workflowrun")

    def has_signal_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_flow.signal_workflowrun")

    def has_start_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_flow.start_workflowrun")

    @admin.action(description="Cancel selected runs", permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> HttpResponse | None:
        return self.bulk_action(request, queryset, "cancel", "Cancelled (admin action)")

    @admin.action(description="Retry selected failed or cancelled runs", permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> HttpResponse | None:
        return self.bulk_action(request, queryset, "retry", "Retried (admin action)")

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            *self.bulk_urls(),  # before `<path:object_id>/cancel/`, which would take "bulk/cancel/"
            path("start/", view(self.start_view), name="durable_flow_workflowrun_start"),
            path("<path:object_id>/cancel/", view(self.cancel_view), name="durable_flow_workflowrun_cancel"),
            path("<path:object_id>/rerun/", view(self.rerun_view), name="durable_flow_workflowrun_rerun"),
            path("<path:object_id>/retry/", view(self.retry_view), name="durable_flow_workflowrun_retry"),
            path("<path:object_id>/signal/", view(self.signal_view), name="durable_flow_workflowrun_signal"),
            *super().get_urls(),
        ]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "can_cancel": self.has_cancel_permission(request),
            "can_signal": self.has_signal_permission(request),
            "can_retry": self.has_retry_permission(request),
            "can_start": self.has_start_permission(request),
        }
        return super().change_view(request, object_id, form_url, extra_context)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "can_start": self.has_start_permission(request),
            **self.bulk_context(request),
        }
        return super().changelist_view(request, extra_context)

    def _page(self, request: HttpRequest, template: str, title: str, **context: Any) -> HttpResponse:
        return TemplateResponse(
            request,
            template,
            {**self.admin_site.each_context(request), "opts": self.model._meta, "title": title, **context},
        )

    def _run(self, request: HttpRequest, object_id: str) -> WorkflowRun:
        run = self.get_object(request, object_id)
        if run is None:
            raise Http404(f"no run with id {object_id!r}")
        return run

    def _to_run(self, run: WorkflowRun) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("admin:durable_flow_workflowrun_change", args=[run.pk]))

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: a confirmation page; POST (CSRF-checked by the admin view): cancel."""
        run = self._run(request, object_id)
        if not self.has_cancel_permission(request):
            raise PermissionDenied
        if request.method != "POST":
            return self._page(
                request, "admin/durable_flow/workflowrun/cancel_confirmation.html", f"Cancel run {run.pk}?", run=run
            )
        record_operation(request.user, cancel(run.id), "Cancelled")
        self.message_user(request, f"Run {run.id} is now {WorkflowRun.objects.get(pk=run.id).status}.")
        return self._to_run(run)

    def rerun_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: start a new run with the same workflow and input."""
        original = self._run(request, object_id)
        if not self.has_start_permission(request):
            raise PermissionDenied
        if request.method != "POST":
            return self._to_run(original)
        run = rerun(original.pk)
        record_operation(request.user, run, f"Re-run of {original.pk}")
        self.message_user(request, f"Started run {run.pk}, a re-run of {original.pk}.", messages.SUCCESS)
        return self._to_run(run)

    def retry_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: resume a failed or cancelled run from where it stopped."""
        run = self._run(request, object_id)
        if not self.has_retry_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            try:
                record_operation(request.user, retry(run.pk), "Retried")
            except DurableFlowError as exc:
                self.message_user(request, str(exc), messages.ERROR)
            else:
                self.message_user(request, f"Retrying run {run.pk}.", messages.SUCCESS)
        return self._to_run(run)

    def signal_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """A form to send a named signal with a JSON payload to the run."""
        run = self._run(request, object_id)
        if not self.has_signal_permission(request):
            raise PermissionDenied
        form = SignalForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            try:
                send_signal(run.pk, form.cleaned_data["name"], form.cleaned_data["payload"])
            except DurableFlowError as exc:
                form.add_error(None, str(exc))
            else:
                record_operation(request.user, run, f"Sent signal {form.cleaned_data['name']!r}")
                self.message_user(request, f"Sent signal {form.cleaned_data['name']!r}.", messages.SUCCESS)
                return self._to_run(run)
        return self._page(
            request, "admin/durable_flow/workflowrun/form.html", f"Send a signal to {run.pk}", form=form, run=run
        )

    def start_view(self, request: HttpRequest) -> HttpResponse:
        """A form listing the registered workflows, with a JSON input field."""
        if not self.has_start_permission(request):
            raise PermissionDenied
        form = StartForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            try:
                run = start(data["workflow"], data["input"], run_id=data["run_id"] or None)
            except DurableFlowError as exc:
                form.add_error(None, str(exc))
            else:
                record_operation(request.user, run, "Started from the admin")
                self.message_user(request, f"Started run {run.pk}.", messages.SUCCESS)
                return self._to_run(run)
        return self._page(request, "admin/durable_flow/workflowrun/form.html", "Start a workflow run", form=form)


@admin.register(FlowQueue)
class FlowQueueAdmin(UrlSafeAdmin):
    list_display = ["name", "config_summary", "paused", "waiting", "updated_at"]
    readonly_fields = ["name", "config", "updated_at"]
    exclude = ["next_arrival", "next_serve"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # queues change through settings or `register_queue`, not a form

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a queue row holds the db backend's counters; it goes with its config

    actions = ["pause_selected", "resume_selected"]

    def has_steer_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_flow.change_flowqueue")

    @admin.action(description="Pause selected queues", permissions=["steer"])
    def pause_selected(self, request: HttpRequest, queryset: QuerySet[FlowQueue]) -> None:

        for queue in queryset:
            record_operation(request.user, pause_queue(queue.name), "Paused")
        self.message_user(request, f"Paused {queryset.count()} queue(s).", messages.SUCCESS)

    @admin.action(description="Resume selected queues", permissions=["steer"])
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[FlowQueue]) -> None:

        for queue in queryset:
            record_operation(request.user, resume_queue(queue.name), "Resumed")
        self.message_user(request, f"Resumed {queryset.count()} queue(s).", messages.SUCCESS)

    @admin.display(description="Config")
    def config_summary(self, obj: FlowQueue) -> str:
        return ", ".join(f"{k}={v}" for k, v in obj.config.items() if v not in (None, "fifo") and k != "name")

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """Beside the queues: the busiest keys of each step-concurrency constraint."""
        return super().changelist_view(request, {**(extra_context or {}), "constraints": step_concurrency()})

    @admin.display(description="Waiting now")
    def waiting(self, obj: FlowQueue) -> int | str:
        return queues.waiting_calls(obj.name)


@admin.register(Schedule)
class ScheduleAdmin(UrlSafeAdmin):
    """Declared schedules (`@workflow(schedule=...)`): read-only but for pausing and resuming."""

    list_display = ["workflow", "cron", "timezone", "next_tick_at", "last_tick_at", "last_outcome", "paused"]
    list_filter = ["paused", "last_outcome"]
    readonly_fields = [
        "workflow",
        "cron",
        "timezone",
        "next_tick_at",
        "last_tick_at",
        "last_run_id",
        "last_outcome",
        "last_refused_tick_at",
        "last_refusal",
        "paused",
        "updated_at",
    ]
    actions = ["pause_selected", "resume_selected"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a schedule is declared in code, and its row made by the poller

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # only the actions below change a schedule

    def has_steer_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_flow.change_schedule")

    @admin.action(description="Pause selected schedules", permissions=["steer"])
    def pause_selected(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for schedule in queryset:
            record_operation(request.user, pause_schedule(schedule.workflow), "Paused")
        self.message_user(request, f"Paused {queryset.count()} schedule(s).", messages.SUCCESS)

    @admin.action(description="Resume selected schedules (at their next tick)", permissions=["steer"])
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for schedule in queryset:
            record_operation(request.user, resume_schedule(schedule.workflow), "Resumed")
        self.message_user(request, f"Resumed {queryset.count()} schedule(s).", messages.SUCCESS)


class EventDeliveryInline(admin.TabularInline):
    """What the event did: the runs it started (or whose start its quota refused), resumed and cancelled."""

    model = EventDelivery
    extra = 0
    can_delete = False
    fields = ["action", "workflow", "run_id", "created_at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Event)
class EventAdmin(UrlSafeAdmin):
    """Events `send_event` recorded (`durable_flow.definitions.events`): read-only; the runs each
    started, resumed or cancelled are listed on its page. Sent from code or the JSON API."""

    list_display = ["id", "name", "received_at", "pending", "delivered_at"]
    list_filter = ["pending", "name"]
    search_fields = ["=id", "name"]
    date_hierarchy = "received_at"
    readonly_fields = ["id", "name", "data", "received_at", "pending", "delivered_at"]
    inlines = [EventDeliveryInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # sent with send_event or the JSON API, which deliver it

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(UrlSafeAdmin):
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

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A stopped worker's record may go; a live one would only come back on its next beat.
        return obj is not None and obj.stopped_at is not None and super().has_delete_permission(request, obj)

    @admin.display(boolean=True)
    def alive(self, obj: WorkerHeartbeat) -> bool:
        return workers.is_alive(obj)


@admin.register(QuotaRefusal)
class QuotaRefusalAdmin(UrlSafeAdmin):
    """Start-quota refusals per key and minute, beside the key's active runs and limit now."""

    list_display = ["key", "minute", "refusals", "active_now", "limit_now"]
    list_filter = ["minute"]
    search_fields = ["=key"]
    date_hierarchy = "minute"
    ordering = ["-minute", "-refusals"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[QuotaRefusal]:
        """Each row's key's active runs and latest limit, in the list's one query (not two per row)."""
        return quotas.with_key_usage(super().get_queryset(request))

    @admin.display(description="Active now", ordering="active_runs")
    def active_now(self, obj: Any) -> int:
        return obj.active_runs

    @admin.display(description="Limit (latest start)")
    def limit_now(self, obj: Any) -> int | None:
        return obj.latest_limit


@admin.register(StartRefusal)
class StartRefusalAdmin(UrlSafeAdmin):
    """Each refused start (the dashboard's quota page shows them with filters and a chart),
    found by exact workflow or key; read-only, newest first, no full count of the history."""

    list_display = ["at", "workflow", "key", "active", "limit"]
    search_fields = ["=key", "=workflow"]
    ordering = ["-at", "-id"]
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(AccessToken)
class AccessTokenAdmin(AccessTokenAdminMixin, UrlSafeAdmin):
    """Personal access tokens of the JSON API: created (shown once) and revoked here."""
