"""Run lists a page at a time, for the dashboard's run list and the JSON API's: newest first by
`(created_at, id)`, each page read from a keyset position (after the last run of the page
before, or before the first run of the page after), so a page costs the rows it shows whatever
the table holds, no total is counted, and runs started meanwhile never shift a later page.
Which runs a filter matches is `run_filters`; how a position is spelt in a URL is the caller's
(the dashboard's readable `cursor_of`, the API's opaque cursor)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q, QuerySet
from django.utils.dateparse import parse_datetime

from durable_flow.exceptions import InvalidInput
from durable_flow.models import WorkflowRun

#: Runs a page shows unless the caller asks for another size.
PAGE_SIZE = 50
#: What a line of a list does not show, so a page does not read it (a run's input and output
#: are up to a megabyte each).
UNLISTED_FIELDS = ("input", "output", "step_concurrency")

#: A run's place in the lists' order: its `(created_at, id)`.
Position = tuple[datetime, str]


@dataclass(frozen=True)
class RunPage:
    """One page of a run list, newest first: its runs, and the positions the pages before
    (`newer`: read before it) and after (`older`: read after it) start from; None at either end."""

    runs: list[WorkflowRun]
    newer: Position | None
    older: Position | None

    @property
    def complete(self) -> bool:
        """Whether this page is the whole list (so its length is the number of matches)."""
        return self.newer is None and self.older is None

    @property
    def newer_cursor(self) -> str | None:
        return cursor_of(self.newer) if self.newer else None

    @property
    def older_cursor(self) -> str | None:
        return cursor_of(self.older) if self.older else None


def position(run: WorkflowRun) -> Position:
    return run.created_at, run.pk


def cursor_of(at: Position) -> str:
    """A position as the dashboard's page cursor: `<created_at ISO>~<id>`."""
    return f"{at[0].isoformat()}~{at[1]}"


def parse_cursor(cursor: str) -> Position:
    """`cursor_of`'s text back to a position; `InvalidInput` for anything else."""
    at, sep, run_id = cursor.partition("~")
    moment = parse_datetime(at) if sep else None
    if moment is None or moment.tzinfo is None:
        raise InvalidInput(f"not a page cursor: {cursor[:80]!r}")
    return moment, run_id


def run_page(
    runs: QuerySet[WorkflowRun],
    after: Position | None = None,
    before: Position | None = None,
    size: int = PAGE_SIZE,
) -> RunPage:
    """A page of `runs` (newest first, ties by id) by keyset: the `size` runs after `after`
    (older ones), or before `before` (newer ones), or the first page. Never a COUNT: each page
    reads its own rows and one more, from the creation-time index, so page 1,000 costs what page
    1 does. Input, output and constraints are not read (`UNLISTED_FIELDS`)."""
    if after and before:
        raise InvalidInput("a page is after a cursor or before one, not both")
    runs = runs.defer(*UNLISTED_FIELDS)
    if before:
        at, run_id = before
        # `created_at >= at` alone bounds the index range; the OR breaks ties by id.
        newer = runs.filter(created_at__gte=at).filter(Q(created_at__gt=at) | Q(pk__lt=run_id))
        rows = list(newer.order_by("created_at", "-pk")[: size + 1])
        more = len(rows) > size
        rows = rows[:size][::-1]
        return RunPage(rows, position(rows[0]) if more and rows else None, position(rows[-1]) if rows else None)
    if after:
        at, run_id = after
        runs = runs.filter(created_at__lte=at).filter(Q(created_at__lt=at) | Q(pk__gt=run_id))
    rows = list(runs.order_by("-created_at", "pk")[: size + 1])
    more = len(rows) > size
    rows = rows[:size]
    return RunPage(rows, position(rows[0]) if after and rows else None, position(rows[-1]) if more else None)
