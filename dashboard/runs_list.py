"""The run list's page and its live topic, `runs:<query>`: the list's filters (and keyset
cursor) as the page's URL has them, validated by the same form and bounded, and the list's rows
rendered by one function for the page and for every tick, with the fragments the page itself
includes (`fragments/runs-count.html`, `runs-table.html`), so a run that finishes changes its
row's badge without a reload and the page and its topic cannot drift apart."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from django.http import QueryDict

from durable_flow.exceptions import InvalidInput
from durable_flow.observe.run_filters import RunFilterForm, filtered_runs
from durable_flow.observe.run_pages import parse_cursor, run_page
from durable_flow.observe.runs import run_row

from . import pages

#: The keyset cursors a page's URL may carry (`observe.run_filters.run_page`).
CURSORS = ("after", "before")
#: The longest cursor a URL may carry: an ISO time, `~` and a run id.
MAX_CURSOR = 300
FRAGMENTS = ["runs-count", "runs-table"]


def _cursor(params: QueryDict) -> list[tuple[str, str]] | None:
    """The one cursor the query carries, checked, as query pairs; None for a bad one."""
    given = [(name, params[name]) for name in CURSORS if params.get(name)]
    if len(given) > 1:
        return None
    for _, value in given:
        if len(value) > MAX_CURSOR:
            return None
        try:
            parse_cursor(value)
        except InvalidInput:
            return None
    return given


def canonical_query(raw: str) -> str | None:
    """The list's query in one spelling (the form's fields in order, blanks dropped, the cursor
    last), or None for a filter the form refuses or a bad cursor."""
    params = QueryDict(raw)
    form = RunFilterForm(params)
    cursor = _cursor(params)
    if not form.is_valid() or cursor is None:
        return None
    return urlencode([(k, v) for k in form.fields for v in params.getlist(k) if v] + cursor)


def list_context(form: RunFilterForm, params: QueryDict) -> dict[str, Any]:
    """What the list's fragments show for a valid form and the URL's cursor: its page of rows
    the filter query the pager's links keep, and the page's live topic query (the filter and
    its cursor). `InvalidInput` for a bad cursor."""
    after, before = (parse_cursor(params[name]) if params.get(name) else None for name in CURSORS)
    page = run_page(filtered_runs(form.cleaned_data), after, before)
    kept = [(k, v) for k in form.fields for v in params.getlist(k) if v]
    cursor = [(name, params[name]) for name in CURSORS if params.get(name)]
    return {
        "page": page,
        "rows": [run_row(run) for run in page.runs],
        "query": urlencode(kept),
        "live_query": urlencode(kept + cursor),
    }


def render_topic(_: Mapping[str, Any], query: str) -> dict[str, str] | None:
    """The `runs:<query>` topic's fragments; None for a query that is no longer valid."""
    params = QueryDict(query)
    form = RunFilterForm(params)
    if not form.is_valid():
        return None
    try:
        context = list_context(form, params)
    except InvalidInput:
        return None
    return pages.fragments(FRAGMENTS, context)
