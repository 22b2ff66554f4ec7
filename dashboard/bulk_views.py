"""Cancel or retry every run the run list's filter matches: a confirmation page that says the
filter in words (and warns when there is none: that is every unfinished run), then the POST,
through `durable_flow.operations.bulk`, whose result counts the runs done, skipped (finished
on their own since the confirmation) and failed, and says why they differ from the count
confirmed."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from durable_flow.observe.run_filters import KEY_SCOPES, RANGES, RunFilterForm, filtered_runs
from durable_flow.observe.waits import FILTER_CHOICES as WAIT_FILTERS
from durable_flow.operations import bulk as bulk_operations

from .access import require, staff_page

BULK_ACTIONS = {"cancel": "Cancel", "retry": "Retry"}
#: What each action selects, in words: the confirmation's warning when no filter narrows it.
EVERY = {"cancel": "all unfinished runs", "retry": "all failed or cancelled runs"}
SHOWN_REFUSALS = 5


def _when(value: datetime) -> str:
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S %Z")


def filter_words(data: dict[str, Any]) -> list[str]:
    """A valid run filter as an operator reads it: one phrase per condition, in the filter
    bar's order (`status is failed or cancelled`, `workflow is examples.import`, ...)."""
    words = []
    if data.get("q"):
        inside = ", or input containing it" if data.get("in_input") else ""
        words.append(f"run id starting with “{data['q']}”{inside}")
    if data.get("status"):
        words.append("status is " + " or ".join(data["status"]))
    if data.get("workflow"):
        words.append(f"workflow is {data['workflow']}")
    if data.get("queue"):
        words.append(f"has a step on queue {data['queue']}")
    if data.get("tag"):
        words.append(f"tagged “{data['tag']}”")
    if data.get("waiting"):
        words.append(f"waiting because of {dict(WAIT_FILTERS).get(data['waiting'], data['waiting'])}")
    if data.get("key") or data.get("key_scope"):
        scope = f" ({KEY_SCOPES[data['key_scope']]} scope)" if data.get("key_scope") else ""
        key = f"step-concurrency key “{data['key']}”" if data.get("key") else "a step-concurrency key"
        words.append(f"holding {key}{scope}")
    if data.get("range") in RANGES:
        words.append(f"started in the last {data['range']}")
    if data.get("since"):
        words.append(f"started at or after {_when(data['since'])}")
    if data.get("until"):
        words.append(f"started at or before {_when(data['until'])}")
    return words


@staff_page
def bulk(request: HttpRequest, action: str) -> HttpResponse:
    """GET: the filter in words, how many runs it selects, and a confirmation; POST: act on the
    runs that count was about (started by then), and say what happened to each of them."""
    if action not in BULK_ACTIONS:
        return HttpResponse("unknown bulk action", status=404)
    require(request, action)
    form = RunFilterForm(request.GET)
    if not form.is_valid():
        return HttpResponse("invalid filter", status=400)
    data = form.cleaned_data
    query = urlencode([(k, v) for k in form.fields for v in request.GET.getlist(k) if v])
    label = BULK_ACTIONS[action]
    if request.method != "POST":
        matching = filtered_runs(data)
        selected = bulk_operations.cancellable(matching) if action == "cancel" else bulk_operations.retryable(matching)
        context = {
            "action": action,
            "label": label,
            "count": selected.count(),
            "query": query,
            "filter_words": filter_words(data),
            "every": EVERY[action],
            "confirmed_at": timezone.now().isoformat(),
        }
        return render(request, "dashboard/bulk_confirm.html", context)
    # The confirmation form sends when it was shown; a POST without it acts on the runs matching now.
    raw = request.POST.get("confirmed_at")
    confirmed_at = bulk_operations.confirmation_time(raw) if raw is not None else None
    if raw is not None and confirmed_at is None:
        return HttpResponse("the confirmation's time is not a time: confirm again", status=400)
    message = f"{label} (dashboard, by filter)"
    if action == "cancel":
        unfiltered = filtered_runs({**data, "status": []})
        result = bulk_operations.cancel_matching(
            unfiltered, request.user, message, confirmed_at=confirmed_at, statuses=data.get("status") or []
        )
    else:
        result = bulk_operations.retry_matching(filtered_runs(data), request.user, message, confirmed_at=confirmed_at)
    _report(request, action, result)
    return HttpResponseRedirect(f"{reverse('dashboard:runs')}?{query}")


def _report(request: HttpRequest, action: str, result: bulk_operations.BulkResult) -> None:
    """The result in one line (`Cancel: 45 done, 7 already finished.`), why the skipped ones
    were left alone, and the first reasons of the failed ones."""
    text = result.summary(BULK_ACTIONS[action])
    if result.skipped:
        text += (
            f" The {result.skipped} already finished had ended on their own after you confirmed: nothing was left"
            " to cancel."
            if action == "cancel"
            else f" The {result.skipped} no longer failed or cancelled were retried or changed after you confirmed,"
            " so they were left as they are."
        )
    messages.success(request, text)
    if result.refused:
        shown = "; ".join(result.refused[:SHOWN_REFUSALS])
        more = f" (and {result.failed - SHOWN_REFUSALS} more)" if result.failed > SHOWN_REFUSALS else ""
        messages.error(request, f"Failed {result.failed}: {shown}{more}")
