"""The public API. Each function uses this process's engine (built from settings)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_flow.models import WorkflowRun
    from durable_flow.queues import QueueConfig, RateLimit
    from durable_flow.quotas import QuotaSpec
    from durable_flow.registry import WorkflowDefinition


def start(
    workflow: WorkflowDefinition | str,
    input: Any = None,
    run_id: str | None = None,
    *,
    tags: Iterable[str] = (),
    quota: QuotaSpec | Mapping[str, Any] | None = None,
) -> WorkflowRun:
    """Start a run of `workflow` with a JSON `input`; returns the `WorkflowRun`.

    Idempotent on `run_id`: starting an id that exists returns that run, unchanged.
    Raises `WorkflowNotFound` for an unknown name and `InvalidInput` for non-JSON input.
    `quota` (`{"key": "tenant:acme", "limit": 8}`) overrides the workflow's start quota for this
    start; over it, `ConcurrencyLimitError` is raised at once and nothing is created.
    """
    from durable_flow.engine import get_engine

    return get_engine().start(workflow, input, run_id=run_id, tags=tags, quota=quota)


def cancel(run_id: str) -> WorkflowRun:
    """Cancel a run (and its children). Mid-step it goes to `cancelling`, then `cancelled`
    when the step's result lands; that late result is recorded and ignored."""
    from durable_flow.engine import get_engine

    return get_engine().cancel(run_id)


def get_run(run_id: str) -> WorkflowRun:
    """The run with that id, or `RunNotFound`."""
    from durable_flow.exceptions import RunNotFound
    from durable_flow.models import WorkflowRun

    try:
        return WorkflowRun.objects.get(pk=run_id)
    except WorkflowRun.DoesNotExist:
        raise RunNotFound(f"no run with id {run_id!r}") from None


def send_signal(run_id: str, name: str, payload: Any = None) -> None:
    """Deliver signal `name` to a run; a signal sent before the run waits for it is kept."""
    from durable_flow.engine import get_engine

    get_engine().send_signal(run_id, name, payload)


def redispatch_pending(run_id: str) -> int:
    """Re-send a run's in-flight steps whose jobs were lost; returns how many."""
    from durable_flow.engine import get_engine

    return get_engine().redispatch_pending(run_id)


def register_queue(
    name: str,
    *,
    concurrency: int | None = None,
    rate_limit: RateLimit | Mapping[str, Any] | None = None,
    retry_ms: int = 1000,
    fairness: str = "fifo",
    order: str = "fifo",
) -> QueueConfig:
    """Register (or replace) a flow-control queue at run time; `InvalidQueueConfig` on bad values."""
    from durable_flow.engine import get_engine
    from durable_flow.queues import QueueConfig

    config = QueueConfig.build(
        name=name, concurrency=concurrency, rate_limit=rate_limit, retry_ms=retry_ms, fairness=fairness, order=order
    )
    return get_engine().register_queue(config)
