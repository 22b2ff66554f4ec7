"""The Runs pages: the filtered list with bulk actions by filter, a run's timeline and detail,
and the operations on a run (cancel, retry, re-run, signal, start), each a POST with CSRF,
permission-checked, audited, through the engine's API."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.forms.fields import InvalidJSONInput
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_POST

from durable_flow.exceptions import DurableFlowError, InvalidInput, RunNotFound, UnexpectedSignal
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.observe.queues import queue_names
from durable_flow.observe.run_filters import RunFilterForm
from durable_flow.observe.runs import run_detail as run_page
from durable_flow.observe.runs import workflow_names
from durable_flow.operations import api
from durable_flow.operations.audit import record_operation
from durable_flow.operations.forms import SignalForm, StartForm
from durable_flow.operations.runs import RETRYABLE

from .access import allowed, require, staff_page
from .runs_list import list_context

#: The run page's parts its live topic (`run:<id>`) re-renders every tick: the signal form's
#: fields are not among them (what was typed stays), only the names the run waits for beside them.
#: The action controls are all in the page, each marked with the state it is shown in
#: (`data-show-when`); `run-state` says the run's state and the page's script shows or hides
#: them by it, so no fragment depends on the user (their permissions and CSRF token stay put).
RUN_FRAGMENTS = [
    "run-state",
    "run-badge",
    "run-facts",
    "run-waits",
    "run-error",
    "run-timeline",
    "run-attempts",
    "run-signal-names",
    "run-signals",
    "run-children",
]


def _filters(request: HttpRequest) -> tuple[RunFilterForm, str]:
    form = RunFilterForm(request.GET)
    kept = [(k, v) for k in form.fields for v in request.GET.getlist(k) if v]
    return form, urlencode(kept)


@staff_page
def runs(request: HttpRequest) -> HttpResponse:
    """The run list: filters, search by id prefix (and inside inputs when asked), pages by
    keyset (`?after=` / `?before=` a cursor: no COUNT), bulk actions by filter. Its rows come
    from `runs_list.list_context`, as its live topic's do."""
    form, query = _filters(request)
    context: dict[str, object] = {"form": form, "page": None, "rows": [], "query": query}
    status = 400
    if form.is_valid():
        try:
            context.update(list_context(form, request.GET))
            status = 200
        except InvalidInput as exc:
            form.add_error(None, str(exc))
    context.update(
        workflows=workflow_names(),
        queues=queue_names(),
        statuses=RunStatus.choices,
        selected=form.cleaned_data.get("status") or [] if form.is_valid() else [],
    )
    return render(request, "dashboard/runs.html", {**context, **allowed(request)}, status=status)


@staff_page
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    """A run: its timeline, attempts with errors, input/output, parent/children, signals, actions."""
    return _run_page(request, _run_or_404(run_id))


def _run_page(
    request: HttpRequest,
    run: WorkflowRun,
    signal_form: SignalForm | None = None,
    status: int = 200,
    unexpected: UnexpectedSignal | None = None,
) -> HttpResponse:
    """The run's page; after a signal that was not sent, with the form as it was typed (and the
    question whether to send a name the run does not wait for)."""
    detail = run_page(run)
    awaited = detail["awaited_signals"]
    if signal_form is None:
        signal_form = SignalForm(initial={"name": awaited[0] if awaited else ""})
    _signal_widgets(signal_form)
    context = {
        "run": run,
        **detail,
        "signal_form": signal_form,
        "unexpected": unexpected,
        **run_state(run),
        **allowed(request),
    }
    return render(request, "dashboard/run_detail.html", context, status=status)


def _signal_widgets(form: SignalForm) -> None:
    """The signal form's fields as the page lays them out (ids the page's labels and tests use);
    an empty payload shows empty, not as JSON's `null`. A name the page pre-filled (not one sent
    back as typed) follows the run's first awaited name live until the user types in it."""
    if not form.is_bound:
        form.initial["payload"] = InvalidJSONInput("")
        form.fields["name"].widget.attrs["data-follow-awaited"] = ""
    form.fields["name"].widget.attrs.update({"id": "signal-name", "size": "12", "list": "awaited-signals"})
    form.fields["payload"].widget.attrs.update({"id": "signal-payload", "placeholder": '{"by": "me"}', "rows": "1"})


def run_state(run: WorkflowRun) -> dict[str, bool]:
    """What the run page's actions are shown by: `unfinished` (cancel, signal) and `retryable`."""
    return {"unfinished": not run.is_terminal, "retryable": run.status in RETRYABLE}


def run_fragments(run_id: str) -> dict[str, str] | None:
    """The run page's live fragments (`run:<id>`): its state (which actions show), badge, facts,
    waits, error, timeline, failed attempts, the signal names it waits for, the signals received
    and its children; None once the run is gone."""
    run = WorkflowRun.objects.filter(pk=run_id).first()
    if run is None:
        return None
    context = {"run": run, **run_page(run), **run_state(run)}
    return {name: render_to_string(f"dashboard/fragments/{name}.html", context) for name in RUN_FRAGMENTS}


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
    """Send a signal. A form that does not validate (bad JSON) comes back as typed, with the
    error; a name the run does not wait for comes back with a question, and is sent by a
    second POST with `confirm=1`."""
    run = _run_or_404(run_id)
    require(request, "signal")
    form = SignalForm(request.POST)
    if not form.is_valid():
        errors = "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items())
        messages.error(request, f"Signal not sent: {errors}")
        return _run_page(request, run, form, status=400)
    name, payload = form.cleaned_data["name"], form.cleaned_data["payload"]
    try:
        api.send_signal(run.pk, name, payload, confirm=request.POST.get("confirm") == "1")
    except UnexpectedSignal as exc:
        return _run_page(request, run, form, status=409, unexpected=exc)
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
