"""Bulk cancel / retry **by filter** on the runs changelist.

"Cancel all matching…" and "Retry all matching…" act on every run the changelist's current
filters, date drill-down and search match, not only the ticked rows of one page. The filters
travel in the URL's query string (`bulk/cancel/?status=failed&workflow=...`), never as a list of
ids in the POST body, so no selection size can hit `DATA_UPLOAD_MAX_NUMBER_FIELDS`. A GET shows a
confirmation page with the count first; the POST (CSRF-checked) runs `durable_flow.operations.bulk`, in
batches of 500 runs a transaction. The changelist's own "Select all N runs" with the cancel or
retry action lands on the same confirmation page. With no filter the page warns that this is
every unfinished (or failed) run. The form sends back when it was shown, so the POST acts on the
runs that count was about and reports them all: done, skipped (finished on their own in
between, for a cancel) and failed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db import DataError, NotSupportedError
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone

from durable_flow.models import WorkflowRun
from durable_flow.operations import bulk

#: Rows a page may show (and so be ticked): kept well under `DATA_UPLOAD_MAX_NUMBER_FIELDS`
#: (1,000 by default), so ticking a whole page never becomes a bare 400. Larger selections go
#: through the by-filter path, which posts no ids.
MAX_SHOW_ALL = max(100, min(500, (getattr(settings, "DATA_UPLOAD_MAX_NUMBER_FIELDS", None) or 10_000) - 100))
#: The changelist's status filter (`list_filter = ["status", ...]`): a cancel reads it apart, as
#: a run that finished since the confirmation no longer has the status it was selected by.
STATUS_PARAMS = ("status__exact", "status")


@dataclass(frozen=True)
class BulkOperation:
    """One bulk operation: who may do it, which runs it changes, and how it is named."""

    permission: str
    verb: str
    audit: str
    every: str


OPERATIONS = {
    "cancel": BulkOperation(
        "durable_flow.cancel_workflowrun", "Cancel", "Cancelled (bulk, by filter)", "all unfinished runs"
    ),
    "retry": BulkOperation(
        "durable_flow.retry_workflowrun", "Retry", "Retried (bulk, by filter)", "all failed or cancelled runs"
    ),
}


class BulkByFilterMixin:
    """Adds the by-filter bulk views to `WorkflowRunAdmin`."""

    list_max_show_all = MAX_SHOW_ALL

    def bulk_urls(self) -> list[Any]:
        view = self.admin_site.admin_view  # type: ignore[attr-defined]
        return [path("bulk/<str:operation>/", view(self.bulk_view), name="durable_flow_workflowrun_bulk")]

    def bulk_context(self, request: HttpRequest) -> dict[str, Any]:
        """What the changelist template needs for its "… all matching" links."""
        return {
            "bulk_query": _filters(request).urlencode(),
            "can_bulk_cancel": request.user.has_perm(OPERATIONS["cancel"].permission),
            "can_bulk_retry": request.user.has_perm(OPERATIONS["retry"].permission),
        }

    def bulk_redirect(self, request: HttpRequest, operation: str) -> HttpResponseRedirect:
        """From the changelist's "select all N" action: the confirmation page for its filters."""
        query = _filters(request).urlencode()
        url = reverse("admin:durable_flow_workflowrun_bulk", args=[operation])
        return HttpResponseRedirect(f"{url}?{query}" if query else url)

    def bulk_action(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun], operation: str, audit: str
    ) -> HttpResponse | None:
        """The cancel / retry admin actions: "Select all N runs" goes to the by-filter
        confirmation page; ticked rows (at most a page) go through the same batches."""
        if request.POST.get("select_across") == "1":
            return self.bulk_redirect(request, operation)
        if operation == "cancel":
            result = bulk.cancel_matching(queryset, request.user, audit)
        else:
            result = bulk.retry_matching(queryset, request.user, audit)
        self._report(request, operation, result, batches=False)
        return None

    def bulk_view(self, request: HttpRequest, operation: str) -> HttpResponse:
        """GET: how many runs match and would change; POST: do it, in batches."""
        op = OPERATIONS.get(operation)
        if op is None:
            raise Http404(f"no bulk operation {operation!r}")
        if not (self.has_view_permission(request) and request.user.has_perm(op.permission)):  # type: ignore[attr-defined]
            raise PermissionDenied
        back = reverse("admin:durable_flow_workflowrun_changelist")
        query = request.GET.urlencode()
        back = f"{back}?{query}" if query else back
        try:
            runs = self._matching(request)
            affected = bulk.cancellable(runs) if operation == "cancel" else bulk.retryable(runs)
            count = affected.count()
        except (IncorrectLookupParameters, DataError, NotSupportedError, OverflowError, ValueError) as exc:
            return self._confirmation(request, op, status=400, error=f"These filters are not valid: {exc}", back=back)
        if request.method != "POST":
            return self._confirmation(
                request, op, count=count, total=runs.count(), back=back, confirmed_at=timezone.now().isoformat()
            )
        # The confirmation form sends when it was shown; a POST without it (a script) acts on
        # the runs matching now.
        raw = request.POST.get("confirmed_at")
        confirmed_at = bulk.confirmation_time(raw) if raw is not None else None
        if raw is not None and confirmed_at is None:
            error = "The confirmation's time is not a time: confirm again."
            return self._confirmation(request, op, status=400, error=error, back=back)
        if operation == "cancel":
            statuses = [value for name in STATUS_PARAMS for value in request.GET.getlist(name)]
            unfiltered = self._matching(request, without=STATUS_PARAMS) if statuses else runs
            result = bulk.cancel_matching(
                unfiltered, request.user, op.audit, confirmed_at=confirmed_at, statuses=statuses
            )
        else:
            result = bulk.retry_matching(runs, request.user, op.audit, confirmed_at=confirmed_at)
        self._report(request, operation, result, batches=True)
        return HttpResponseRedirect(back)

    def _report(self, request: HttpRequest, operation: str, result: bulk.BulkResult, *, batches: bool) -> None:
        """One success message (`Cancel: 45 done, 7 already finished.`, and why those were left
        alone), and one warning naming the first few refusals."""
        op = OPERATIONS[operation]
        how = f" (in {result.batches} batch(es))" if batches else ""
        text = result.summary(op.verb)[:-1] + how + "."
        if result.skipped:
            text += (
                f" The {result.skipped} already finished had ended on their own before the cancel reached them."
                if operation == "cancel"
                else f" The {result.skipped} no longer failed or cancelled changed before the retry reached them."
            )
        self.message_user(request, text, messages.SUCCESS)  # type: ignore[attr-defined]
        if result.refused:
            shown = "; ".join(result.refused[:5])
            more = f" (and {len(result.refused) - 5} more)" if len(result.refused) > 5 else ""
            self.message_user(request, f"Refused {len(result.refused)}: {shown}{more}", messages.WARNING)  # type: ignore[attr-defined]

    def _matching(self, request: HttpRequest, without: tuple[str, ...] = ()) -> QuerySet[WorkflowRun]:
        """Every run the changelist shows for these filters, search and date drill-down (all
        pages); `without`: filter parameters left out. The changelist parses them, so a bad one
        is `IncorrectLookupParameters` (a NUL too: `UrlSafeAdmin`) and a refused lookup is
        `DisallowedModelAdminLookup` (400)."""
        if without:
            request = copy.copy(request)
            request.GET = request.GET.copy()
            for name in without:
                request.GET.pop(name, None)
        changelist = self.get_changelist_instance(request)  # type: ignore[attr-defined]
        return changelist.get_queryset(request)

    def _confirmation(
        self, request: HttpRequest, op: BulkOperation, *, status: int = 200, **context: Any
    ) -> HttpResponse:
        filters = [(key, value) for key, values in _filters(request).lists() for value in values]
        return TemplateResponse(
            request,
            "admin/durable_flow/workflowrun/bulk_confirmation.html",
            {
                **self.admin_site.each_context(request),  # type: ignore[attr-defined]
                "opts": WorkflowRun._meta,
                "title": f"{op.verb} all matching runs?",
                "verb": op.verb,
                "every": op.every,
                "filters": filters,
                **context,
            },
            status=status,
        )


def _filters(request: HttpRequest) -> Any:
    """The changelist's filters, search and drill-down from the query string (not its page,
    ordering or popup parameters, which select no runs)."""
    query = request.GET.copy()
    for name in ("p", "o", "all", "e", "_popup", "_to_field", "_changelist_filters"):
        query.pop(name, None)
    return query
