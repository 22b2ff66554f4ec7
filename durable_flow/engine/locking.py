"""Locking: every state change of a run happens in a transaction that first locks its row.

A turn and a result landing for the same run then never interleave. The row is always
locked before any of its checkpoints, so two operations on one run cannot deadlock each other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, TypeVar

from django.db import OperationalError, transaction
from django.db.models import Model, QuerySet

from durable_flow.models import StepCheckpoint, WorkflowRun
from durable_flow.store import statements

logger = logging.getLogger("durable_flow.engine")

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=Model)


def retry_on_conflict(fn: Callable[P, R]) -> Callable[P, R]:
    """Retry a top-level engine operation that lost a lock race (a PostgreSQL deadlock or
    serialisation failure, or SQLite's busy timeout). Each try is its own transaction."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(8):
            try:
                return fn(*args, **kwargs)
            except OperationalError as exc:
                if transaction.get_connection().in_atomic_block or attempt == 7:
                    raise
                logger.warning("retrying %s after a lock conflict: %s", fn.__name__, exc)
                time.sleep(0.01 * (2**attempt))
        raise AssertionError("unreachable")

    return wrapper


def one(queryset: QuerySet[M]) -> M | None:
    """The single row a unique filter matches, or None. Unlike `.first()`, adds no ORDER BY:
    these lookups run on every turn and result, and the sort is pure overhead."""
    return next(iter(queryset.order_by()[:1]), None)


def locked_run(run_id: str, key: str | None = None) -> tuple[WorkflowRun | None, StepCheckpoint | None]:
    """Lock the run's row, then (when `key` is given) its checkpoint `key`, in that order.

    Call inside `transaction.atomic()`. Returns `(run, checkpoint)`, either None when missing;
    the checkpoint is None too when no `key` is asked for. (Both statements are precompiled:
    `durable_flow.store.statements`.)
    """
    run = statements.lock_run(run_id)
    if key is None:
        return run, None
    return run, statements.lock_checkpoint(run_id, key)


def locked_run_for_result(run_id: str, key: str) -> tuple[WorkflowRun | None, dict[str, StepCheckpoint]]:
    """Lock the run's row, then read checkpoint `key` under it: two statements, in one round
    trip on PostgreSQL (`statements.lock_run_for_result`).

    When `key` is a lone call (no fan-out wave), its result always takes the run's next turn
    inline, which replays over every checkpoint: then all of them come back in the same
    statement, so the turn reads nothing more. A call in a wave comes back alone (a wave's
    result reads the rest only when the wave has settled). Returns `(run, checkpoints by key)`.
    """
    return statements.lock_run_for_result(run_id, key)
