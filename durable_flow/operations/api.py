"""The public API, exported by `durable_flow` itself. Each function uses this process's engine
(built from settings).

This module imports the engine and the models, so it loads once Django's app registry is ready:
`durable_flow/__init__.py` imports it on first use of one of its names, never at import time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from django.db import connection
from django.db.transaction import TransactionManagementError

from durable_flow import models
from durable_flow.config.limits import RUN_ID_LENGTH
from durable_flow.config.queues import QueueConfig
from durable_flow.config.validation import storable_text
from durable_flow.definitions.registry import WorkflowDefinition, get_workflow, startable_workflow
from durable_flow.engine import get_engine
from durable_flow.exceptions import InvalidInput, RunNotFound, UnexpectedSignal
from durable_flow.models import FlowQueue, WorkflowRun
from durable_flow.observe.waits import signal_names_awaited
from durable_flow.operations import runs
from durable_flow.operations.events import send_event, send_event_on  # noqa: F401  (the public API)
from durable_flow.operations.schedules import pause_schedule, resume_schedule  # noqa: F401  (the public API)
from durable_flow.store.run_bells import watchers

if TYPE_CHECKING:
    from durable_flow.config.queues import RateLimit
    from durable_flow.definitions.quotas import QuotaSpec
    from durable_flow.engine.start_gate import StartGate


def _run_id(run_id: object) -> str:
    """A run id the database can look up; `InvalidInput` otherwise (never a bare DataError)."""
    return storable_text(run_id, "run_id", RUN_ID_LENGTH)


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
    Raises `WorkflowNotFound` for an unknown name or a built-in one (the tasks backend's
    `durable_flow.task`) and `InvalidInput` for non-JSON input.
    `quota` (`{"key": "tenant:acme", "limit": 8}`) overrides the workflow's start quota for this
    start; over it, `ConcurrencyLimitError` is raised at once and nothing is created.
    """
    # Run id and tags are checked by the engine, which every start path goes through.
    return get_engine().start(startable_workflow(workflow), input, run_id=run_id, tags=tags, quota=quota)


def cancel(run_id: str) -> WorkflowRun:
    """Cancel a run (and its children). Mid-step it goes to `cancelling`, then `cancelled`
    when the step's result lands; that late result is recorded and ignored."""
    return get_engine().cancel(_run_id(run_id))


def get_run(run_id: str) -> WorkflowRun:
    """The run with that id, or `RunNotFound`."""
    try:
        return WorkflowRun.objects.get(pk=_run_id(run_id))
    except WorkflowRun.DoesNotExist:
        raise RunNotFound(f"no run with id {run_id!r}") from None


#: How often a wait reads its run again though nothing woke it: the safety net under the push
#: (a notification missed while its listener reconnected), and the pace where nothing pushes.
WAIT_SAFETY_POLL_S = 1.0
WAIT_POLL_S = 0.05


def wait(run_id: str, timeout: float | None = None) -> WorkflowRun:
    """Block until the run has ended (`completed`, `failed` or `cancelled`) and return it, read
    after its end; `TimeoutError` after `timeout` seconds (None: no limit), `RunNotFound` for an
    unknown id. Woken by the transaction that ends the run, in whatever process: PostgreSQL's
    `LISTEN`/`NOTIFY`, SQLite's doorbell; the run is read again every second all the same.

        run = durable_flow.start("checkout", order)
        receipt = durable_flow.wait(run.id, timeout=30).output

    Call it outside a transaction: a transaction's snapshot would not show the run's end.
    """
    run_id = _run_id(run_id)
    if connection.in_atomic_block:
        raise TransactionManagementError("durable_flow.wait() inside a transaction would never see the run end")
    deadline = None if timeout is None else time.monotonic() + timeout
    with watchers.watching(run_id) as rung:
        while True:
            run = get_run(run_id)
            if run.is_terminal:
                return run
            pause = WAIT_SAFETY_POLL_S if watchers.pushed else WAIT_POLL_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"run {run_id!r} is still {run.status} after {timeout} s")
                pause = min(pause, left)
            rung.wait(pause)
            rung.clear()


def send_signal(run_id: str, name: str, payload: Any = None, *, confirm: bool = True) -> None:
    """Deliver signal `name` to a run; a signal sent before the run waits for it is kept.
    `confirm=False` (an operator's form) first checks the run waits for `name` now, and raises
    `UnexpectedSignal` (naming what it waits for) if not, so a misspelt name is asked about
    before it is kept for good."""
    run_id = _run_id(run_id)
    if not confirm:
        awaited = signal_names_awaited(run_id)
        if name not in awaited:
            get_run(run_id)  # RunNotFound first
            raise UnexpectedSignal(run_id, name, awaited)
    get_engine().send_signal(run_id, name, payload)


def retry(run_id: str) -> WorkflowRun:
    """Resume a failed or cancelled run from where it stopped: completed steps keep their
    results, failed or cancelled calls get a new attempt budget, and the run replays.
    `RetryRefused` for a run in another state or whose workflow version changed."""
    return runs.retry(_run_id(run_id))


def rerun(run_id: str, *, new_run_id: str | None = None) -> WorkflowRun:
    """Start a new run of the same workflow with the same input; the new run keeps a link to
    the original (`rerun_of`). Idempotent on `new_run_id`, like `start`. A task run's re-run
    passes its task's quota, debounce and singleton, as `enqueue` does."""
    original = get_run(run_id)
    if new_run_id is not None:
        new_run_id = _run_id(new_run_id)
        taken = WorkflowRun.objects.filter(pk=new_run_id).values_list("rerun_of", flat=True).first()
        if taken is not None and taken != original.pk:
            # Idempotent for this re-run only: another run's id is not relabelled as a copy of this one.
            raise InvalidInput(f"run id {new_run_id!r} belongs to a run that is not a re-run of {original.pk!r}")
        if taken is not None:
            return get_run(new_run_id)
    quota: QuotaSpec | None = None
    gate: StartGate | None = None
    checks = get_workflow(original.workflow).start_checks
    if checks is not None:  # rules its input names (a task run's: its task's)
        new_run_id = new_run_id if new_run_id is not None else models.new_run_id()
        quota, gate = checks.checks(original.input, new_run_id)
    run = get_engine().start(
        original.workflow, original.input, run_id=new_run_id, tags=original.tags, quota=quota, gate=gate
    )
    # A start a debounce folded or a singleton skipped returns another run: no re-run of this one.
    if not run.rerun_of and run.pk != original.pk and getattr(run, "start_outcome", None) is None:
        WorkflowRun.objects.filter(pk=run.pk, rerun_of="").update(rerun_of=original.pk)
        run.rerun_of = original.pk
    return run


def redispatch_pending(run_id: str) -> int:
    """Re-send a run's in-flight steps whose jobs were lost; returns how many."""
    return get_engine().redispatch_pending(_run_id(run_id))


def register_queue(
    name: str,
    *,
    concurrency: int | None = None,
    rate_limit: RateLimit | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    retry_ms: int = 1000,
    fairness: str = "fifo",
    order: str = "fifo",
    throttle: Mapping[str, Any] | None = None,
    start_timeout_s: float | None = None,
    on_start_timeout: str = "fail",
) -> QueueConfig:
    """Register (or replace) a flow-control queue at run time; `InvalidQueueConfig` on bad values.
    `rate_limit` may be a list of a global and a per-key (`"per": "key"`) window.
    `start_timeout_s`: how long a call may wait in line before it gives up (`"fail"`: its
    `ctx.step` raises `StartTimeoutError`; `"skip"`: it returns None), unless the call says."""
    config = QueueConfig.build(
        name=name,
        concurrency=concurrency,
        rate_limit=rate_limit,
        retry_ms=retry_ms,
        fairness=fairness,
        order=order,
        throttle=throttle,
        start_timeout_s=start_timeout_s,
        on_start_timeout=on_start_timeout,
    )
    return get_engine().register_queue(config)


def pause_queue(name: str) -> FlowQueue:
    """Pause a queue: every process stops admitting to it within one poll; running steps finish
    and waiting calls keep waiting. `QueueNotFound` for an unknown name."""
    return runs.pause_queue(name)


def resume_queue(name: str) -> FlowQueue:
    """Resume a paused queue; its waiters are handed free slots within one poll."""
    return runs.resume_queue(name)


def update_queue(name: str, **changes: Any) -> QueueConfig:
    """Resize a queue live: `concurrency=`, `rate_limit=` and/or `throttle=` (None removes one).
    Shrinking never revokes running steps; growing admits waiters at once."""
    unknown = sorted(set(changes) - {"concurrency", "rate_limit", "throttle"})
    if unknown:
        raise InvalidInput(
            f"update_queue: unknown option(s) {', '.join(unknown)}; give concurrency, rate_limit or throttle"
        )
    return runs.update_queue(name, **changes)
