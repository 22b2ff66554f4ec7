"""Cancel or retry every run the run list's filter matches: a confirmation page that says the
filter in words (and warns when there is none: that is every unfinished run), then the POST,
through `durable_flow.operations.bulk`, whose result counts the runs done, skipped (finished
on their own since the confirmation) and failed, and says why they differ from the count
confirmed.

The confirmation page is live (topic `bulk:<action>:<filter>`): its count and a sample of the
runs it would change follow the runs while it is open; the filter and the form stay as they
are, and the form sends back the time of the count it last showed (live.js keeps its
`confirmed_at` at each tick's time), so the POST acts on the runs that count was about."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from durable_flow.observe.run_filters import KEY_SCOPES, RANGES, RunFilterForm, filtered_runs
from durable_flow.observe.waits import FILTER_CHOICES as WAIT_FILTERS
from durable_flow.operations import bulk as bulk_operations

from .access import require, staff_page
from .live import register_topic
from .pages import fragments

BULK_ACTIONS = {"cancel": "Cancel", "retry": "Retry"}
#: What each action selects, in words: the confirmation's warning when no filter narrows it.
EVERY = {"cancel": "all unfinished runs", "retry": "all failed or cancelled runs"}
SHOWN_REFUSALS = 5
#: Runs the confirmation lists by name (newest first): a sample of what the count is about.
SAMPLE_SIZE = 10
#: The confirmation's parts its live topic re-renders: the heading, the count with its sample,
#: and the button (which says the count); not the filter or the rest of the form.
BULK_FRAGMENTS = ["bulk-heading", "bulk-matching", "bulk-button"]


def _when(value: datetime) -> str:
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S %Z")


def filter_words(data: Mapping[str, Any]) -> list[str]:
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
        context = {
            **bulk_context(action, data),
            "query": query,
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


def bulk_context(action: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """What the confirmation shows for a valid filter: the filter in words, how many runs
    `action` would change now, and the newest `SAMPLE_SIZE` of them."""
    matching = filtered_runs(dict(data))
    selected = bulk_operations.cancellable(matching) if action == "cancel" else bulk_operations.retryable(matching)
    return {
        "action": action,
        "label": BULK_ACTIONS[action],
        "every": EVERY[action],
        "filter_words": filter_words(data),
        "count": selected.count(),
        "sample": list(selected.order_by("-created_at", "-id")[:SAMPLE_SIZE]),
        "sample_size": SAMPLE_SIZE,
    }


def _topic_filter(argument: str) -> tuple[str, RunFilterForm, list[tuple[str, str]]] | None:
    """`cancel:status=failed` → the action, its valid filter form and the filter's query pairs;
    None for an unknown action or a filter the form refuses."""
    action, _, raw = argument.partition(":")
    if action not in BULK_ACTIONS:
        return None
    params = QueryDict(raw)
    form = RunFilterForm(params)
    if not form.is_valid():
        return None
    return action, form, [(k, v) for k in form.fields for v in params.getlist(k) if v]


def canonical_topic(argument: str) -> str | None:
    """The `bulk:` topic's argument in one spelling (the action, then the filter's fields in
    order, blanks dropped), or None when it is refused."""
    parsed = _topic_filter(argument)
    if parsed is None:
        return None
    action, _, kept = parsed
    return f"{action}:{urlencode(kept)}"


def render_topic(_: Mapping[str, Any], argument: str) -> dict[str, str] | None:
    """The `bulk:<action>:<filter>` topic's fragments; None for an argument no longer valid."""
    parsed = _topic_filter(argument)
    if parsed is None:
        return None
    action, form, _ = parsed
    return fragments(BULK_FRAGMENTS, bulk_context(action, form.cleaned_data))


register_topic("bulk", render_topic, argument=canonical_topic, uses_snapshot=False)  # reads only its runs


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
