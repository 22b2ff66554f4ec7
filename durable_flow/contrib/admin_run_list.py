"""The admin's run list kept fast on a long history: filters whose choices come from the
registry and the queue table (not a `SELECT DISTINCT` over every run), a queue filter that
probes each run's checkpoints with `EXISTS` (a join would repeat a run per call and need a
`DISTINCT` over every column), a search that reads indexes (the run id by prefix, the workflow,
the quota and start keys exactly), and a paginator that never counts past `COUNT_CAP` runs."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.http import HttpRequest

from durable_flow.models import WorkflowRun
from durable_flow.observe.queues import queue_names
from durable_flow.observe.run_filters import on_queue
from durable_flow.observe.runs import workflow_names

#: Matching runs the admin's list counts at most: past it, the list says so and its pages stop
#: there (narrow the filter to reach older runs), so no page counts the whole table.
COUNT_CAP = 1_000


class CappedCountPaginator(Paginator):
    """A paginator whose count stops at `COUNT_CAP`: `SELECT COUNT(*)` over at most that many
    matching rows (a LIMIT inside the count), however many match."""

    @cached_property
    def count(self) -> int:
        object_list = self.object_list
        if isinstance(object_list, QuerySet):
            return object_list.order_by()[:COUNT_CAP].count()
        return min(len(object_list), COUNT_CAP)


class WorkflowFilter(admin.SimpleListFilter):
    """By workflow, the choices from the registry."""

    title = "workflow"
    parameter_name = "workflow"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in workflow_names()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> QuerySet[WorkflowRun]:
        value = self.value()
        return queryset.filter(workflow=value) if value else queryset


class QueueFilter(admin.SimpleListFilter):
    """Runs with a call on a queue, the choices from the queue table, matched by `EXISTS`."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in queue_names()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> QuerySet[WorkflowRun]:
        value = self.value()
        return queryset.filter(on_queue(value)) if value else queryset


def run_search(queryset: QuerySet[WorkflowRun], term: str) -> QuerySet[WorkflowRun]:
    """Runs whose id starts with `term` (case-sensitive, on the primary key's index), or whose
    workflow, quota key or start key is `term` exactly (each on its index)."""
    term = term.strip()
    if not term:
        return queryset
    return queryset.filter(Q(pk__startswith=term) | Q(workflow=term) | Q(concurrency_key=term) | Q(start_key=term))
