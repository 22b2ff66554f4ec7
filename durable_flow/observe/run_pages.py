"""Runs a page at a time, for the JSON API's list: newest first by `(created_at, id)`, each page
read after the last run of the one before (keyset), so a page costs the rows it shows whatever
the table holds, no total is counted, and runs started meanwhile never shift a later page.
Which runs a filter matches is `run_filters`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q, QuerySet

from durable_flow.models import WorkflowRun

#: What a line of the list does not show, so the page does not read it (a run's input and
#: output are up to a megabyte each).
UNLISTED_FIELDS = ("input", "output", "step_concurrency")


@dataclass(frozen=True)
class RunPage:
    """One page of runs, and where the next one starts."""

    runs: list[WorkflowRun]
    #: The last run's `(created_at, id)`: the next page is read after it. None on the last page.
    next_after: tuple[datetime, str] | None


def with_id_prefix(runs: QuerySet[WorkflowRun], prefix: str) -> QuerySet[WorkflowRun]:
    """The runs whose id starts with `prefix` (a range of the primary key's index)."""
    return runs.filter(pk__startswith=prefix)


def runs_page(runs: QuerySet[WorkflowRun], after: tuple[datetime, str] | None, size: int) -> RunPage:
    """Up to `size` of `runs`, newest first, after `(created_at, id)` when given. Reads one row
    more than it returns to know whether a next page exists."""
    ordered = runs.order_by("-created_at", "-pk").defer(*UNLISTED_FIELDS)
    if after is not None:
        created_at, run_id = after
        ordered = ordered.filter(Q(created_at__lt=created_at) | Q(created_at=created_at, pk__lt=run_id))
    rows = list(ordered[: size + 1])
    page = rows[:size]
    more = len(rows) > size
    return RunPage(runs=page, next_after=(page[-1].created_at, page[-1].pk) if more else None)
