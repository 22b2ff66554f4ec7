"""The Runs pages: the filtered list with bulk actions by filter, a run's timeline and detail,
and the operations on a run (cancel, retry, re-run, signal, start), each a POST with CSRF,
permission-checked, audited, through the engine's API."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from durable_flow.exceptions import DurableFlowError, InvalidInput, RunNotFound
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.observe.queues import queue_names
from durable_flow.observe.run_filters import RunFilterForm, filtered_runs
from durable_flow.observe.run_filters import run_page as list_page
from durable_flow.observe.runs import run_detail as run_page
from durable_flow.observe.runs import run_row, workflow_names
from durable_flow.operations import api
from durable_flow.operations import bulk as bulk_operations
from durable_flow.operations.audit import record_operation
from durable_flow.operations.forms import SignalForm, StartForm
from durable_flow.operations.runs import RETRYABLE

from .access import allowed, require, staff_page

BULK_ACTIONS = {"cancel": "Cancel", "retry": "Retry"}


def _filters(request: HttpRequest) -> tuple[RunFilterForm, str]:
    form = RunFilterForm(request.GET)
    kept = [(k, v) for k in form.fields for v in request.GET.getlist(k) if v]
    return form, urlencode(kept)


@staff_page
def runs(request: HttpRequest) -> HttpResponse:
    """The run list: filters, search by id prefix (and inside inputs when asked), pages by
    keyset (`?after=` / `?before=` a cursor: no COUNT), bulk actions by filter."""
    form, query = _filters(request)
    page = None
    if form.is_valid():
        try:
            page = list_page(filtered_runs(form.cleaned_data), request.GET.get("after"), request.GET.get("before"))
        except InvalidInput as exc:
            form.add_error(None, str(exc))
    if page is None:
        context = {"form": form, "page": None, "rows": [], "query": query, "workflows": workflow_names()}
        return render(request, "dashboard/runs.html", {**context, **allowed(request)}, status=400)
    context = {
        "form": form,
        "page": page,
        "rows": [run_row(run) for run in page.runs],
        "query": query,
        "workflows": workflow_names(),
        "queues": queue_names(),
        "statuses": RunStatus.choices,
        "selected": form.cleaned_data.get("status") or [],
    }
    return render(request, "dashboard/runs.html", {**context, **allowed(request)})


@staff_page
def bulk(request: HttpRequest, action: str) -> HttpResponse:
    """GET: how many runs the filter matches, and a confirmation; POST: act on all of them."""
    if action not in BULK_ACTIONS:
        return HttpResponse("unknown bulk action", status=404)
    require(request, action)
    form, query = _filters(request)
    if not form.is_valid():
        return HttpResponse("invalid filter", status=400)
    matching = filtered_runs(form.cleaned_data)
    matching = bulk_operations.cancellable(matching) if action == "cancel" else bulk_operations.retryable(matching)
    if request.method != "POST":
        context = {"action": action, "label": BULK_ACTIONS[action], "count": matching.count(), "query": query}
        return render(request, "dashboard/bulk_confirm.html", context)
    done, refused = _bulk(request, action, matching)
    text = f"{BULK_ACTIONS[action]}: {done} run(s)" + (f", {refused} refused" if refused else "") + "."
    messages.success(request, text)
    return HttpResponseRedirect(f"{reverse('dashboard:runs')}?{query}")


def _bulk(request: HttpRequest, action: str, matching: QuerySet[WorkflowRun]) -> tuple[int, int]:
    """Cancel or retry every matching run through `durable_flow.operations.bulk`: batches of 500 runs a
    transaction (set-based, a bounded number of queries each), one LogEntry per run."""
    message = f"{BULK_ACTIONS[action]} (dashboard, by filter)"
    if action == "cancel":
        result = bulk_operations.cancel_matching(matching, request.user, message)
    else:
        result = bulk_operations.retry_matching(matching, request.user, message)
    return result.done, len(result.refused)


@staff_page
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    """A run: its timeline, attempts with errors, input/output, parent/children, signals, actions."""
    run = _run_or_404(run_id)
    context = {
        "run": run,
        **run_page(run),
        "signal_form": SignalForm(),
        "retryable": run.status in RETRYABLE,
        **allowed(request),
    }
    return render(request, "dashboard/run_detail.html", context)


def _run_or_404(run_id: str) -> WorkflowRun:
    """The run a URL names; 404 for an id that names none, one the database cannot store too."""
    try:
        return api.get_run(run_id)
    except (RunNotFound, InvalidInput):
        raise Http404(f"no run with id {run_id!r}") from None


def _back(run_id: str) -> HttpResponseRedirect:
    return HttpResponseRedirect(reverse("dashboard:run", args=[run_id]))


@staff_page
def cancel(request: HttpRequest, run_id: str) -> HttpResponse:
    """GET: a confirmation page; POST: cancel the run and its children."""
    run = _run_or_404(run_id)
    require(request, "cancel")
    if request.method != "POST":
        return render(request, "dashboard/cancel_confirm.html", {"run": run})
    record_operation(request.user, api.cancel(run.pk), "Cancelled (dashboard)")
    messages.success(request, f"Run {run.pk} is now {api.get_run(run.pk).status}.")
    return _back(run.pk)


@staff_page
@require_POST
def retry(request: HttpRequest, run_id: str) -> HttpResponse:
    run = _run_or_404(run_id)
    require(request, "retry")
    try:
        record_operation(request.user, api.retry(run.pk), "Retried (dashboard)")
    except DurableFlowError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Retrying run {run.pk} from where it stopped.")
    return _back(run.pk)


@staff_page
@require_POST
def rerun(request: HttpRequest, run_id: str) -> HttpResponse:
    original = _run_or_404(run_id)
    require(request, "start")
    try:
        run = api.rerun(original.pk)
    except DurableFlowError as exc:
        messages.error(request, str(exc))
        return _back(original.pk)
    record_operation(request.user, run, f"Re-run of {original.pk} (dashboard)")
    messages.success(request, f"Started run {run.pk}, a re-run of {original.pk}.")
    return _back(run.pk)


@staff_page
@require_POST
def signal(request: HttpRequest, run_id: str) -> HttpResponse:
    run = _run_or_404(run_id)
    require(request, "signal")
    form = SignalForm(request.POST)
    if not form.is_valid():
        errors = "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items())
        messages.error(request, f"Signal not sent: {errors}")
        return _back(run.pk)
    name, payload = form.cleaned_data["name"], form.cleaned_data["payload"]
    try:
        api.send_signal(run.pk, name, payload)
    except DurableFlowError as exc:
        messages.error(request, f"Signal not sent: {exc}")
    else:
        record_operation(request.user, run, f"Sent signal {name!r} (dashboard)")
        messages.success(request, f"Sent signal {name!r}.")
    return _back(run.pk)


@staff_page
def start(request: HttpRequest) -> HttpResponse:
    """A form of the registered workflows with a JSON input; POST starts a run."""
    require(request, "start")
    form = StartForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            run = api.start(data["workflow"], data["input"], run_id=data["run_id"] or None)
        except DurableFlowError as exc:
            form.add_error(None, str(exc))
        else:
            record_operation(request.user, run, "Started (dashboard)")
            messages.success(request, f"Started run {run.pk}.")
            return _back(run.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "dashboard/start.html", {"form": form}, status=status)
