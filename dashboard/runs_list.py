"""The run list's live topic, `runs:<query>`: the list's filters (and page) as the page's URL
has them, validated by the same form and bounded, and the list's rows re-rendered each tick
with the fragments the page itself includes (`fragments/runs-count.html`, `runs-table.html`),
so a run that finishes changes its row's badge without a reload."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from django.core.paginator import Paginator
from django.http import QueryDict

from durable_flow.observe.run_filters import RunFilterForm, filtered_runs
from durable_flow.observe.runs import run_row

from . import pages

#: Rows a page of the list shows.
PAGE_SIZE = 50
#: The highest page number a live topic may name (a larger one is not a page anyone reads).
MAX_PAGE = 10_000
FRAGMENTS = ["runs-count", "runs-table"]


def _page_number(params: QueryDict) -> int | None:
    raw = params.get("page") or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        return None
    return int(raw)


def canonical_query(raw: str) -> str | None:
    """The list's query in one spelling (the form's fields in order, blanks dropped, `page`
    last and only past the first), or None for a filter the form refuses or a bad page."""
    params = QueryDict(raw)
    form = RunFilterForm(params)
    number = _page_number(params)
    if not form.is_valid() or number is None:
        return None
    kept = [(k, v) for k in form.fields for v in params.getlist(k) if v]
    return urlencode(kept + ([("page", str(number))] if number > 1 else []))


def table_context(query: str) -> dict[str, Any] | None:
    """What the list's fragments show for a canonical query: its page of rows, the count, and
    the query the pager's links keep. None for an invalid one."""
    params = QueryDict(query)
    form = RunFilterForm(params)
    if not form.is_valid():
        return None
    page = Paginator(filtered_runs(form.cleaned_data), PAGE_SIZE).get_page(params.get("page"))
    kept = [(k, v) for k in form.fields for v in params.getlist(k) if v]
    return {"page": page, "rows": [run_row(run) for run in page.object_list], "query": urlencode(kept)}


def render_topic(_: Mapping[str, Any], query: str) -> dict[str, str] | None:
    """The `runs:<query>` topic's fragments."""
    context = table_context(query)
    return None if context is None else pages.fragments(FRAGMENTS, context)
