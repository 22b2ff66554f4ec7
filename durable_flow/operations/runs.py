"""Operations people perform: retry a finished run from where it failed; pause, resume and
resize a queue live.

`retry` works on the durable record only (locks, checkpoints, one queued turn), so it needs
nothing of the engine beyond its transport: the replay that follows re-admits and re-dispatches
the reset calls exactly as a first attempt would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Max

from durable_flow.config.limits import QUEUE_NAME_LENGTH
from durable_flow.config.queues import QueueConfig, RateLimit, Throttle, queue_from_dict, resized_windows
from durable_flow.config.validation import storable_text
from durable_flow.definitions.registry import get_step, get_workflow
from durable_flow.engine import get_engine, one, retry_on_conflict, start_gate
from durable_flow.exceptions import (
    ConcurrencyLimitError,
    QueueNotFound,
    RetryRefused,
    RunNotFound,
    StepNotFound,
    WorkflowNotFound,
)
from durable_flow.models import FlowQueue, RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.store import quotas as quota_store
from durable_flow.store.attempts import operator_retried

if TYPE_CHECKING:
    from durable_flow.definitions.quotas import QuotaCheck
    from durable_flow.definitions.registry import WorkflowDefinition

RETRYABLE = (RunStatus.FAILED, RunStatus.CANCELLED)


class _Unset:
    """Marks an option `update_queue` leaves as it is (None means "remove")."""


UNSET = _Unset()


@retry_on_conflict
def retry(run_id: str) -> WorkflowRun:
    """Resume a failed or cancelled run from where it stopped.

    Completed calls keep their checkpoints (and results); failed or cancelled steps go back to
    waiting for admission with a new attempt budget (their attempt count goes on, so the history
    shows attempt 4 after attempts 1-3); failed or cancelled child runs are retried with it; a
    cancelled sleep or signal wait starts over (a signal kept from before is consumed); a child
    start a quota refused, when the refusal ended the run, is attempted again. The run replays
    at once.

    The run becomes active again, so it passes the gates a start passes: its start quota (over
    it, `ConcurrencyLimitError`, and nothing changes; a retried child is checked against its
    own) and its singleton (`RetryRefused` while another run of its key is in progress).
    """
    # Planned before the transaction, as a start plans: a limit callable (a per-plan lookup)
    # then runs under no lock. A run's key is fixed at its start, so the plan still holds.
    plans = _quota_plans(run_id)
    try:
        with transaction.atomic():
            run = _reset(run_id, top_level=True, plans=plans)
    except ConcurrencyLimitError as exc:
        quota_store.record_refusal(exc)  # after the refused transaction rolled back, as a start does
        raise
    return run


def _reset(run_id: str, *, top_level: bool, plans: Mapping[str, QuotaCheck | None] | None = None) -> WorkflowRun:
    run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
    if run is None:
        raise RunNotFound(f"no run with id {run_id!r}")
    if run.status not in RETRYABLE:
        raise RetryRefused(f"run {run_id!r} is {run.status}; only failed or cancelled runs can be retried")
    try:
        definition = get_workflow(run.workflow)
    except WorkflowNotFound as exc:
        raise RetryRefused(f"run {run_id!r}: {exc}") from None
    if definition.version != run.version:
        raise RetryRefused(
            f"run {run_id!r} ran version {run.version!r} of {run.workflow!r}; this process has "
            f"{definition.version!r}, so its history would not replay (re-run it instead)"
        )
    if (
        top_level
        and run.parent_id
        and WorkflowRun.objects.filter(pk=run.parent_id)
        .exclude(status__in=(RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED))
        .exists()
    ):
        raise RetryRefused(f"run {run_id!r} is a child of finished run {run.parent_id!r}; retry the parent")
    _admit_again(run, definition, plans or {})
    unsettled = list(
        StepCheckpoint.objects.select_for_update().filter(run=run, status__in=(StepStatus.FAILED, StepStatus.CANCELLED))
    )
    last = run.checkpoints.aggregate(last=Max("sequence"))["last"]
    for cp in unsettled:
        if cp.kind == StepKind.STEP:
            operator_retried([cp.pk], get_engine().now())
            cp.status, cp.holds_slot, cp.wake_at, cp.finished_at = StepStatus.WAITING, False, None, None
            cp.start_deadline = None  # a start timeout counts from its new wait, not the one that gave up
            cp.max_attempts = cp.attempt + attempt_budget(cp.name)
            fields = ["status", "holds_slot", "wake_at", "finished_at", "max_attempts", "start_deadline"]
            cp.save(update_fields=fields)
        elif cp.kind == StepKind.CHILD and quota_store.is_refusal(cp):
            # No child was created. A refusal that ended the run (its last call) is asked again:
            # the replay starts the child if there is room now, or is refused as the first time.
            # One the workflow caught and went on from stays in its history.
            if cp.sequence == last:
                cp.delete()
        elif cp.kind == StepKind.CHILD and cp.child_run_id:
            child = WorkflowRun.objects.filter(pk=cp.child_run_id).values_list("status", flat=True).first()
            if child in RETRYABLE:
                _reset(cp.child_run_id, top_level=False)
            cp.status, cp.error, cp.finished_at = StepStatus.DISPATCHED, None, None
            cp.save(update_fields=["status", "error", "finished_at"])
        elif cp.kind in (StepKind.SLEEP, StepKind.SIGNAL) and cp.status == StepStatus.CANCELLED:
            # Cancel settled it and dropped its wake time: the replay checkpoints it afresh, so
            # the sleep (or a signal wait's timeout) starts over for its full duration, and a
            # signal wait waits again (consuming a signal kept from before the cancel).
            cp.delete()
        # A timed-out signal wait stays as recorded: the workflow saw SignalTimeout, and a replay
        # must see the same.
    run.status, run.output, run.error, run.finished_at, run.wake_at = RunStatus.PENDING, None, None, None, None
    run.save(update_fields=["status", "output", "error", "finished_at", "wake_at", "updated_at"])
    get_engine().transport.enqueue_turn(run.id)
    return run


def _quota_plans(run_id: str) -> dict[str, QuotaCheck | None]:
    """The quota check a retry of the run will pass, by run id (empty when there is none to plan,
    or the run cannot be retried: `_reset` says why)."""
    run = one(WorkflowRun.objects.filter(pk=run_id))
    if run is None or not run.concurrency_key:
        return {}
    try:
        definition = get_workflow(run.workflow)
    except WorkflowNotFound:
        return {}
    return {run.pk: quota_store.retry_plan(run, definition.quota, definition.label_for(run.input))}


def _admit_again(run: WorkflowRun, definition: WorkflowDefinition, plans: Mapping[str, QuotaCheck | None]) -> None:
    """Check the gates a start passes before `run` is active again: another run of its singleton
    key in progress (a task run's: its task's) is `RetryRefused`; a full start quota is
    `ConcurrencyLimitError` (checked with the run's plan from `plans`, else planned now: a
    retried child's)."""
    other = start_gate.retry_conflict(definition.control_for(run.input), run)
    if other is not None:
        raise RetryRefused(
            f"run {run.pk!r}: run {other!r} of its singleton key {run.start_key!r} is in progress; "
            f"retry it once that run has finished"
        )
    if run.pk in plans:
        check = plans[run.pk]
    else:
        check = quota_store.retry_plan(run, definition.quota, definition.label_for(run.input))
    if check is not None:
        quota_store.enforce(check, excluding=run.pk)


def attempt_budget(step_name: str) -> int:
    try:
        return get_step(step_name).retries + 1
    except StepNotFound:
        return 1


# -- queues ------------------------------------------------------------------------------------
def pause_queue(name: str) -> FlowQueue:
    """Pause a queue: from the next poll of every process on, it admits nothing. Steps already
    admitted run to completion; waiting calls keep waiting."""
    queue = _queue_row(name)
    FlowQueue.objects.filter(pk=name).update(paused=True)
    get_engine().paused_queues.forget()
    queue.paused = True
    return queue


def resume_queue(name: str) -> FlowQueue:
    """Resume a paused queue and hand its free slots out at once."""
    queue = _queue_row(name)
    FlowQueue.objects.filter(pk=name).update(paused=False)
    engine = get_engine()
    engine.paused_queues.forget()
    engine.grant(name)
    queue.paused = False
    return queue


def update_queue(
    name: str,
    *,
    concurrency: int | _Unset | None = UNSET,
    rate_limit: RateLimit | Mapping[str, Any] | list[Mapping[str, Any]] | _Unset | None = UNSET,
    throttle: Throttle | Mapping[str, Any] | _Unset | None = UNSET,
) -> QueueConfig:
    """Resize a queue live from any process: a new `concurrency`, `rate_limit` and/or `throttle`
    (None removes it; see `resized_windows` for a per-key window). Shrinking revokes no running
    step (the excess drains as results land); growing admits waiters at once. Exact across
    processes on the `db` and `redis` backends, which read the shared config at each decision;
    `local` applies it to this process only. A changed throttle starts from its stored
    timestamps (TATs): a tighter one spaces the next starts from where the old one left off."""
    current = queue_from_dict(_queue_row(name).config)
    windows = (current.rate_limit, current.key_rate_limit)
    if not isinstance(rate_limit, _Unset):
        windows = resized_windows(current, rate_limit)
    config = QueueConfig.build(
        name=name,
        concurrency=current.concurrency if isinstance(concurrency, _Unset) else concurrency,
        rate_limit=windows[0],
        key_rate_limit=windows[1],
        retry_ms=current.retry_ms,
        fairness=current.fairness,
        order=current.order,
        throttle=current.throttle if isinstance(throttle, _Unset) else throttle,
        start_timeout_s=current.start_timeout_s,
        on_start_timeout=current.on_start_timeout,
    )
    engine = get_engine()
    engine.register_queue(config)
    engine.grant(name)
    return config


def _queue_row(name: str) -> FlowQueue:
    storable_text(name, "queue name", QUEUE_NAME_LENGTH)
    queue = FlowQueue.objects.filter(pk=name).first()
    if queue is None:
        raise QueueNotFound(f"no queue named {name!r}")
    return queue
