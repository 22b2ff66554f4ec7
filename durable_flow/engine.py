"""The engine: starts runs, replays turns, admits and dispatches steps, records results.

Every state change happens in a database transaction that first locks the run's row, so a
turn and a result landing for the same run never interleave. Transports are told what to run
inside that transaction (the `db` transport writes its task rows there; the others enqueue
on commit), so a crash can never leave a checkpoint that says "dispatched" with no task, or a
task whose checkpoint was rolled back.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from functools import wraps
from typing import Any, ParamSpec, TypeVar

from django.db import DatabaseError, DataError, IntegrityError, OperationalError, transaction
from django.db.models import Model, QuerySet
from django.utils import timezone
from django.utils.module_loading import import_string

from durable_flow import quotas
from durable_flow.admission.base import AdmissionBackend, AdmissionRequest
from durable_flow.conf import BackendSpec, DurableFlowSettings, get_settings
from durable_flow.context import _PENDING, EngineUnavailable, StepOptions, Suspend, WorkflowContext
from durable_flow.exceptions import (
    ConcurrencyLimitError,
    DurableFlowError,
    NonDeterminismError,
    RunNotFound,
    StepNotFound,
)
from durable_flow.models import (
    SETTLED_STEP_STATUSES,
    TERMINAL_RUN_STATUSES,
    FlowQueue,
    RunStatus,
    Signal,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkflowRun,
)
from durable_flow.queues import QueueConfig
from durable_flow.quotas import QuotaSpec
from durable_flow.registry import StepDefinition, WorkflowDefinition, get_step, get_workflow, resolve_workflow
from durable_flow.serialization import ensure_json, error_info
from durable_flow.transports.base import Transport

logger = logging.getLogger("durable_flow.engine")

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=Model)

WAKEABLE = (RunStatus.SUSPENDED, RunStatus.RUNNING)
PARKED_STEP_STATUSES = (StepStatus.WAITING, StepStatus.RETRYING)
PARKED = frozenset(PARKED_STEP_STATUSES)
MAX_RUN_ID = WorkflowRun._meta.get_field("id").max_length or 200


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


def ms_to_datetime(epoch_ms: int) -> datetime:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)


def build_backend(spec: BackendSpec) -> Any:
    """Instantiate a backend class from its settings spec.

    A class with a `from_options(options)` classmethod is built by it; otherwise its
    constructor gets the options as lower-case keyword arguments.
    """
    cls = import_string(spec.path)
    factory = getattr(cls, "from_options", None)
    if factory is not None:
        return factory(dict(spec.options))
    return cls(**{key.lower(): value for key, value in spec.options.items()})


class Engine:
    """One process's engine: settings, the admission backend and the transport."""

    def __init__(
        self,
        admission: AdmissionBackend,
        transport: Transport,
        settings: DurableFlowSettings | None = None,
        clock: Callable[[], datetime] = timezone.now,
    ) -> None:
        self.settings = settings or get_settings()
        self.admission = admission
        self.transport = transport
        self.clock = clock
        self.instance_id = ""
        for config in self.settings.queues:
            self.admission.register(config)
        on_freed = getattr(self.admission, "on_freed", None)
        if on_freed is not None:
            on_freed(self.wake_waiters)
        transport.bind(self)

    def now(self) -> datetime:
        return self.clock()

    # -- queues -------------------------------------------------------------------------
    def register_queue(self, config: QueueConfig) -> QueueConfig:
        """Add or replace a queue on this process's backend and persist it for the others."""
        self.admission.register(config)
        write_queues([config])
        return config

    def persist_queues(self) -> None:
        """Write the settings' queues to `FlowQueue` (at migrate and at worker/poller start)."""
        write_queues(self.settings.queues)

    # -- starting runs ------------------------------------------------------------------
    @retry_on_conflict
    def start(
        self,
        workflow: WorkflowDefinition | str,
        input: Any = None,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        quota: QuotaSpec | Mapping[str, Any] | None = None,
    ) -> WorkflowRun:
        """Create a run and queue its first turn. Idempotent on `run_id`.

        Over its start quota (`quota`, else the workflow's) it raises `ConcurrencyLimitError`
        and creates nothing; an existing `run_id` is returned without a quota check."""
        definition = resolve_workflow(workflow)
        ensure_json(input, f"input of workflow {definition.name!r}", self.settings.max_payload_bytes)
        tag_list = [str(tag) for tag in tags]
        if run_id is not None:
            if not isinstance(run_id, str) or not run_id or len(run_id) > 200:
                raise DurableFlowError("run_id must be a non-empty string of at most 200 characters")
            existing = one(WorkflowRun.objects.filter(pk=run_id))
            if existing is not None:
                return existing
        check = quotas.plan(definition.name, definition.quota, quota, input)
        fields: dict[str, Any] = {
            "workflow": definition.name,
            "version": definition.version,
            "input": input,
            "status": RunStatus.PENDING,
            **quotas.run_fields(check, tag_list),
        }
        if run_id is not None:
            fields["id"] = run_id
        try:
            with transaction.atomic():
                if check is not None:
                    # Under the key's lock: a same-id start that won meanwhile is returned, not refused.
                    if run_id is not None and (existing := one(WorkflowRun.objects.filter(pk=run_id))):
                        return existing
                    check.enforce()
                run = WorkflowRun.objects.create(**fields)
                self.transport.enqueue_turn(run.id)
        except IntegrityError:
            if run_id is None:
                raise
            # A concurrent start with the same run_id won: return its run.
            return WorkflowRun.objects.get(pk=run_id)
        return run

    def start_child(
        self, parent: WorkflowRun, *, key: str, sequence: int, definition: WorkflowDefinition, input: Any, group: str
    ) -> StepCheckpoint:
        """Create a child run (inside the parent's turn) and the parent's checkpoint for it."""
        ensure_json(input, f"input of child workflow {definition.name!r}", self.settings.max_payload_bytes)
        child_id = f"{parent.id}:{key}"
        if len(child_id) > MAX_RUN_ID:
            # Deep or long ids: stay deterministic (a replay must find the same child) and short.
            child_id = f"{hashlib.sha256(parent.id.encode()).hexdigest()[:40]}:{key}"
        check = None
        if definition.quota is not None and not WorkflowRun.objects.filter(pk=child_id).exists():
            try:
                check = quotas.plan(definition.name, definition.quota, None, input)
                if check is not None:
                    check.enforce()
            except ConcurrencyLimitError as exc:
                # Recorded on the parent's checkpoint: a replay raises the same refusal at
                # `ctx.child` instead of starting the child later.
                return self.create_checkpoint(
                    parent,
                    key=key,
                    sequence=sequence,
                    kind=StepKind.CHILD,
                    name=definition.name,
                    status=StepStatus.FAILED,
                    input=input,
                    group=group,
                    child_run_id=child_id,
                    error=quotas.refusal_error(exc),
                    dispatched_at=self.now(),
                    finished_at=self.now(),
                )
        child, created = WorkflowRun.objects.get_or_create(
            pk=child_id,
            defaults={
                "workflow": definition.name,
                "version": definition.version,
                "input": input,
                "status": RunStatus.PENDING,
                "parent": parent,
                "parent_step_key": key,
                **quotas.run_fields(check, list(parent.tags)),
            },
        )
        if not created and (child.parent_id != parent.id or child.parent_step_key != key):
            # A run started by someone else under the id this child would take: adopting it would
            # hand the parent a stranger's output, or leave it waiting for a run that never reports.
            raise DurableFlowError(
                f"cannot start child {child_id!r} of run {parent.id!r}: a run with that id already exists "
                f"and is not this run's child (run ids of the form '<parent>:<n>' are reserved for children)"
            )
        cp = self.create_checkpoint(
            parent,
            key=key,
            sequence=sequence,
            kind=StepKind.CHILD,
            name=definition.name,
            status=StepStatus.DISPATCHED,
            input=input,
            group=group,
            child_run_id=child_id,
            dispatched_at=self.now(),
        )
        if created:
            self.transport.enqueue_turn(child_id)
        elif child.is_terminal:
            self._record_child_outcome(cp, child)
        return cp

    # -- turns --------------------------------------------------------------------------
    @retry_on_conflict
    def run_turn(self, run_id: str) -> WorkflowRun | None:
        """Replay the run's workflow from the top until it finishes or must wait."""
        try:
            with transaction.atomic():
                run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
                if run is None:
                    return None
                return self._replay(run)
        except EngineUnavailable as exc:
            # Rolled back, run untouched: surface the real error so the caller retries the turn
            # (a lock conflict is retried here; a worker leaves the task to be claimed again).
            raise (exc.__cause__ or DatabaseError(str(exc))) from None

    def _replay(self, run: WorkflowRun) -> WorkflowRun:
        """One turn of a run whose row this transaction has locked."""
        if run.status in TERMINAL_RUN_STATUSES or run.status == RunStatus.CANCELLING:
            return run
        try:
            definition = get_workflow(run.workflow)
        except DurableFlowError as exc:
            self._finish(run, RunStatus.FAILED, error=error_info(exc))
            return run
        if definition.version != run.version:
            exc = NonDeterminismError(
                f"run {run.id} started under version {run.version!r} of {run.workflow!r}, "
                f"but this process has version {definition.version!r}"
            )
            self._finish(run, RunStatus.FAILED, error=error_info(exc))
            return run
        checkpoints = {cp.key: cp for cp in run.checkpoints.all()}
        ctx = WorkflowContext(self, run, checkpoints)
        run.turns += 1
        try:
            output = definition.fn(ctx, run.input)
            ensure_json(output, f"output of workflow {run.workflow!r}", self.settings.max_payload_bytes)
        except Suspend:
            run.status = RunStatus.RUNNING if ctx.in_flight else RunStatus.SUSPENDED
            run.wake_at = ctx.wake_at
            run.save(update_fields=["status", "wake_at", "turns", "updated_at"])
            return run
        except DatabaseError as exc:
            # The workflow's code touched the database and failed (or aborted the transaction):
            # not a verdict on the run. Roll the turn back and retry it.
            raise EngineUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any workflow error fails the run, durably
            logger.info("run %s failed: %s", run.id, exc)
            self._finish(run, RunStatus.FAILED, error=error_info(exc), checkpoints=checkpoints)
            return run
        self._finish(run, RunStatus.COMPLETED, output=output, checkpoints=checkpoints)
        return run

    def _finish(
        self,
        run: WorkflowRun,
        status: str,
        output: Any = None,
        error: Any = None,
        *,
        checkpoints: dict[str, StepCheckpoint] | None = None,
    ) -> None:
        """Settle the run; withdraw its parked calls from their queues and cancel its unfinished
        children; report to its parent. `checkpoints`, when the caller has them (a turn), spares
        the queries."""
        run.status = status
        run.output = output
        run.error = error
        run.wake_at = None
        run.finished_at = self.now()
        run.save(update_fields=["status", "output", "error", "wake_at", "finished_at", "turns", "updated_at"])
        # A run that ends (say, failing on one child of a fan) takes its unfinished children
        # with it, rather than leave them running for nobody.
        if checkpoints is None:
            parked = list(run.checkpoints.filter(kind=StepKind.STEP, status__in=PARKED_STEP_STATUSES))
            children = True
        else:
            parked = [cp for cp in checkpoints.values() if cp.kind == StepKind.STEP and cp.status in PARKED]
            children = any(cp.kind == StepKind.CHILD for cp in checkpoints.values())
        for cp in parked:
            # A step waiting for a slot or its backoff will never run now: leave no waiter behind
            # to stand in front of live callers until its TTL.
            if cp.queue:
                self.admission.release(cp.queue, cp.ticket)
            cp.holds_slot = False
            cp.save(update_fields=["holds_slot"])
            self.settle(cp, StepStatus.CANCELLED)
        if children:
            for child_id in run.children.exclude(status__in=TERMINAL_RUN_STATUSES).values_list("id", flat=True):
                self.cancel(child_id)
        if run.parent_id:
            # Lock the parent's row first, as a step result does: siblings finishing at once then
            # take turns, and the last one sees every sibling settled and wakes the parent. (The
            # checkpoint query's Meta-ordering join used to take this lock only by accident.)
            list(WorkflowRun.objects.select_for_update().filter(pk=run.parent_id).values_list("pk", flat=True))
            parent_cp = (
                StepCheckpoint.objects.select_for_update()
                .filter(run_id=run.parent_id, key=run.parent_step_key)
                .order_by("pk")
                .first()
            )
            if parent_cp is not None:
                self._record_child_outcome(parent_cp, run)
                self._wake_if_group_settled(parent_cp)

    def _record_child_outcome(self, cp: StepCheckpoint, child: WorkflowRun) -> None:
        if cp.status in SETTLED_STEP_STATUSES:
            return
        if child.status == RunStatus.COMPLETED:
            self.settle(cp, StepStatus.COMPLETED, output=child.output)
        else:
            self.settle(cp, StepStatus.FAILED, error={"status": child.status, "error": child.error})

    # -- checkpoints (called by the context during a turn) -----------------------------------
    def create_checkpoint(self, run: WorkflowRun, **fields: Any) -> StepCheckpoint:
        return StepCheckpoint.objects.create(run=run, **fields)

    def create_step_checkpoint(
        self,
        run: WorkflowRun,
        *,
        key: str,
        sequence: int,
        step: StepDefinition[Any],
        input: Any,
        options: StepOptions,
        group: str,
    ) -> StepCheckpoint:
        ensure_json(input, f"input of step {step.name!r}", self.settings.max_payload_bytes)
        retries = step.retries if options.retries is None else options.retries
        # Not saved yet: admission decides whether it is written as dispatched or as waiting,
        # so a step that goes straight out costs one INSERT.
        return StepCheckpoint(
            run=run,
            key=key,
            sequence=sequence,
            kind=StepKind.STEP,
            name=step.name,
            status=StepStatus.WAITING,
            input=input,
            max_attempts=retries + 1,
            queue=options.queue,
            priority=options.priority,
            fairness_key=options.fairness_key,
            group=group,
            timeout_s=options.timeout.total_seconds() if options.timeout else None,
        )

    def settle(self, cp: StepCheckpoint, status: str, output: Any = None, error: Any = None) -> None:
        cp.status = status
        cp.output = output
        cp.error = error
        cp.wake_at = None
        cp.finished_at = self.now()
        cp.save(update_fields=["status", "output", "error", "wake_at", "finished_at"])

    def admit(self, cp: StepCheckpoint) -> datetime | None:
        """Ask the queue for a slot; None when admitted, else when to retry."""
        if not cp.queue or cp.holds_slot or not self.admission.handles(cp.queue):
            return None
        decision = self.admission.try_admit(
            AdmissionRequest(queue=cp.queue, ticket=cp.ticket, priority=cp.priority, fairness_key=cp.fairness_key)
        )
        if decision.admitted:
            cp.holds_slot = True
            return None
        if cp.pk is None:
            cp.save()
        elif cp.status != StepStatus.WAITING:
            cp.status = StepStatus.WAITING
            cp.save(update_fields=["status"])
        assert decision.retry_at_ms is not None
        return ms_to_datetime(decision.retry_at_ms)

    def step_timeout(self, cp: StepCheckpoint) -> float | None:
        if cp.timeout_s is not None:  # set at creation from ctx.step(timeout=...)
            return cp.timeout_s
        try:
            definition = get_step(cp.name)
        except StepNotFound:
            return None
        return definition.timeout.total_seconds() if definition.timeout else None

    def dispatch(self, cp: StepCheckpoint, *, timeout_redispatch: bool = False) -> None:
        """Send a new attempt of the step to the transport (inside the turn's transaction)."""
        now = self.now()
        cp.attempt += 1
        if timeout_redispatch:
            # A timed-out attempt is retried in place: it keeps its slot and its attempt budget.
            cp.max_attempts += 1
        cp.status = StepStatus.DISPATCHED
        cp.dispatched_at = now
        cp.worker = ""
        timeout = self.step_timeout(cp)
        cp.wake_at = now + timezone.timedelta(seconds=timeout) if timeout else None
        if cp.pk is None:
            cp.save()
        else:
            cp.save(
                update_fields=["attempt", "max_attempts", "status", "dispatched_at", "worker", "wake_at", "holds_slot"]
            )
        self.transport.enqueue_step(cp.run_id, cp.key, cp.attempt, cp.priority)

    def consume_signal(self, run: WorkflowRun, name: str, key: str) -> Any:
        signal = Signal.objects.filter(run=run, name=name, consumed_by="").order_by("id").first()
        if signal is None:
            return _PENDING
        signal.consumed_by = key
        signal.save(update_fields=["consumed_by"])
        return signal.payload

    # -- step execution (on a worker) ---------------------------------------------------------
    def execute_step(self, run_id: str, key: str, attempt: int, worker_id: str = "") -> str:
        """Run one attempt of a dispatched step and record its result. Returns what happened:
        `completed`, `failed`, `skipped` (stale or cancelled) or `missing`."""
        cp = one(StepCheckpoint.objects.select_related("run").filter(run_id=run_id, key=key))
        if cp is None:
            return "missing"
        if cp.status != StepStatus.DISPATCHED or cp.attempt != attempt:
            return "skipped"
        if cp.run.status in (RunStatus.CANCELLING, RunStatus.CANCELLED) or cp.run.is_terminal:
            self.record_result(run_id, key, attempt, cancelled=True)
            return "skipped"
        adopt = getattr(self.admission, "adopt", None)
        if cp.holds_slot and cp.queue and adopt is not None and not adopt(cp.queue, cp.ticket):
            # The slot went with a dead process and may be someone else's now: running anyway
            # would exceed the cap, so the step goes back through admission.
            self.readmit(run_id, key, attempt)
            return "skipped"
        if worker_id:
            StepCheckpoint.objects.filter(pk=cp.pk, attempt=attempt).update(worker=worker_id)
        try:
            definition = get_step(cp.name)
            output = definition.fn(cp.input)
            ensure_json(output, f"output of step {cp.name!r}", self.settings.max_payload_bytes)
        except Exception as exc:  # noqa: BLE001 - a step's failure is data, recorded durably
            self.record_result(run_id, key, attempt, error=error_info(exc))
            return "failed"
        try:
            self.record_result(run_id, key, attempt, output=output)
        except DataError as exc:
            # The database refused the output (a value it cannot store): a failed attempt, not a
            # result to re-run the step for forever.
            self.record_result(run_id, key, attempt, error=error_info(exc))
            return "failed"
        return "completed"

    @retry_on_conflict
    def readmit(self, run_id: str, key: str, attempt: int) -> None:
        """Send a dispatched attempt whose slot was lost back to admission (a new attempt follows)."""
        with transaction.atomic():
            run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
            cp = one(StepCheckpoint.objects.select_for_update().filter(run_id=run_id, key=key))
            if run is None or cp is None or cp.status != StepStatus.DISPATCHED or cp.attempt != attempt:
                return
            if run.status == RunStatus.CANCELLING or run.is_terminal:
                # Cancelled meanwhile: the attempt that never ran is the last thing it waited for.
                cp.holds_slot = False
                cp.save(update_fields=["holds_slot"])
                self.settle(cp, StepStatus.CANCELLED)
                self._finish_cancelling(run)
                return
            cp.status, cp.holds_slot, cp.wake_at = StepStatus.WAITING, False, None
            cp.max_attempts += 1  # the lost attempt never ran; it does not use up a retry
            cp.save(update_fields=["status", "holds_slot", "wake_at", "max_attempts"])
            self.wake(run)

    @retry_on_conflict
    def record_result(
        self,
        run_id: str,
        key: str,
        attempt: int,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
        cancelled: bool = False,
    ) -> None:
        """Checkpoint a step attempt's result exactly once, release its slot, wake the run.

        A duplicate (an RQ job retried, a timed-out attempt answering late) is kept on
        `late_result` and changes nothing else.
        """
        with transaction.atomic():
            run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
            cp = one(StepCheckpoint.objects.select_for_update().filter(run_id=run_id, key=key))
            if run is None or cp is None:
                return
            if cp.status != StepStatus.DISPATCHED or (error is not None and cp.attempt != attempt):
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                cp.save(update_fields=["late_result"])
                return
            self._release(cp)
            if cancelled or run.status in (RunStatus.CANCELLING, RunStatus.CANCELLED) or run.is_terminal:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                cp.save(update_fields=["late_result"])
                self.settle(cp, StepStatus.CANCELLED)
                self._finish_cancelling(run)
                return
            if error is not None and cp.attempt < cp.max_attempts:
                cp.status = StepStatus.RETRYING
                cp.error = error
                cp.wake_at = self.now() + get_step_backoff(cp.name, cp.attempt)
                cp.save(update_fields=["status", "error", "wake_at", "holds_slot"])
                self._continue(run)  # the turn parks the run until the backoff is up
                return
            if error is not None:
                self.settle(cp, StepStatus.FAILED, error=error)
            else:
                self.settle(cp, StepStatus.COMPLETED, output=output)
            if self._group_settled(cp):
                self._continue(run)

    def _release(self, cp: StepCheckpoint) -> None:
        if cp.holds_slot:
            cp.holds_slot = False
            cp.save(update_fields=["holds_slot"])
            self.admission.release(cp.queue, cp.ticket)

    @staticmethod
    def _group_settled(cp: StepCheckpoint) -> bool:
        """Whether every call of `cp`'s fan-out wave has settled (a lone call is its own wave)."""
        return not cp.group or not (
            StepCheckpoint.objects.filter(run_id=cp.run_id, group=cp.group)
            .exclude(status__in=SETTLED_STEP_STATUSES)
            .exists()
        )

    def _wake_if_group_settled(self, cp: StepCheckpoint) -> None:
        if self._group_settled(cp):
            self.wake(cp.run_id)

    def _continue(self, run: WorkflowRun) -> None:
        """A result is in: take the run's next turn now, in the transaction that recorded it and
        under the lock it holds, instead of queuing a turn for a worker to pick up later. Saves
        a job, a transaction and a replay's worth of reads per step."""
        if run.status not in WAKEABLE:
            return
        try:
            with transaction.atomic():  # a savepoint: the result above stays recorded either way
                self._replay(run)
        except EngineUnavailable as exc:
            logger.warning("run %s: inline turn failed (%s); queuing it instead", run.id, exc)
            run.refresh_from_db(fields=["status", "wake_at", "turns"])
            self.wake(run)

    def wake(self, run: WorkflowRun | str) -> bool:
        """Queue a turn for a parked run now. False if it is not parked (finished, or a turn is
        already queued)."""
        run_id = run if isinstance(run, str) else run.id
        woken = WorkflowRun.objects.filter(pk=run_id, status__in=WAKEABLE).update(
            status=RunStatus.PENDING, wake_at=None, updated_at=self.now()
        )
        if woken:
            if not isinstance(run, str):
                run.status, run.wake_at = RunStatus.PENDING, None
            self.transport.enqueue_turn(run_id)
        return bool(woken)

    def wake_waiters(self, queue: str, limit: int = 2) -> int:
        """Early wake: a slot freed on `queue`, so retry its rightful next blocked runs now
        instead of at their `retry_ms` tick.

        A backend that can name its next waiters (`next_waiters`) is asked, so the run woken is
        the one admission will pick; otherwise the best-placed by priority and age. One spare
        wake covers a waiter that has gone away; the rest keep their tick.
        """
        next_waiters = getattr(self.admission, "next_waiters", None)
        with transaction.atomic():
            if next_waiters is not None:
                run_ids = [ticket.rsplit("/", 1)[0] for ticket in next_waiters(queue, limit)]
            else:
                run_ids = list(
                    StepCheckpoint.objects.filter(queue=queue, status=StepStatus.WAITING)
                    .order_by("-priority", "id")
                    .values_list("run_id", flat=True)[:limit]
                )
            return sum(self.wake(run_id) for run_id in dict.fromkeys(run_ids))

    # -- cancel, signals, redispatch ------------------------------------------------------------
    @retry_on_conflict
    def cancel(self, run_id: str) -> WorkflowRun:
        """Cancel a run and its children. A run with a step executing goes to `cancelling`
        and becomes `cancelled` when that step's (ignored) result lands."""
        with transaction.atomic():
            run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            if run.is_terminal:
                return run
            in_flight = False
            for cp in run.checkpoints.exclude(status__in=SETTLED_STEP_STATUSES).select_for_update():
                if cp.kind == StepKind.STEP and cp.status == StepStatus.DISPATCHED:
                    in_flight = True
                    continue
                if cp.kind == StepKind.STEP and cp.queue:
                    self.admission.release(cp.queue, cp.ticket)  # withdraw a waiter / free a slot
                    cp.holds_slot = False
                    cp.save(update_fields=["holds_slot"])
                self.settle(cp, StepStatus.CANCELLED)
            for child_id in run.children.exclude(status__in=TERMINAL_RUN_STATUSES).values_list("id", flat=True):
                self.cancel(child_id)
            if in_flight:
                run.status = RunStatus.CANCELLING
                run.wake_at = None
                run.save(update_fields=["status", "wake_at", "updated_at"])
            else:
                self._finish(run, RunStatus.CANCELLED, error={"type": "Cancelled", "message": "cancelled"})
            return run

    def _finish_cancelling(self, run: WorkflowRun) -> None:
        if run.status != RunStatus.CANCELLING:
            return
        if not run.checkpoints.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED).exists():
            self._finish(run, RunStatus.CANCELLED, error={"type": "Cancelled", "message": "cancelled"})

    @retry_on_conflict
    def send_signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """Deliver a signal; kept until the run waits for it, so one sent early is not lost."""
        if not isinstance(name, str) or not name or len(name) > 200:
            raise DurableFlowError("a signal name must be a non-empty string of at most 200 characters")
        ensure_json(payload, f"payload of signal {name!r}", self.settings.max_payload_bytes)
        with transaction.atomic():
            run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            if run.is_terminal:
                raise DurableFlowError(f"run {run_id!r} is {run.status}; it takes no more signals")
            Signal.objects.create(run=run, name=name, payload=payload)
            waiting = run.checkpoints.filter(kind=StepKind.SIGNAL, name=name, status=StepStatus.DISPATCHED)
            if waiting.exists():
                self.wake(run)

    @retry_on_conflict
    def redispatch_pending(self, run_id: str, older_than_s: float = 0.0, keys: Iterable[str] | None = None) -> int:
        """Re-send the run's in-flight steps (for jobs a broker lost), or only those named by
        `keys`. Each gets a new attempt and keeps its slot; whichever attempt answers first wins."""
        with transaction.atomic():
            run = one(WorkflowRun.objects.select_for_update().filter(pk=run_id))
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            cutoff = self.now() - timezone.timedelta(seconds=older_than_s)
            count = 0
            in_flight = run.checkpoints.filter(
                kind=StepKind.STEP, status=StepStatus.DISPATCHED, dispatched_at__lte=cutoff
            )
            if keys is not None:
                in_flight = in_flight.filter(key__in=list(keys))
            for cp in in_flight.select_for_update():
                self.dispatch(cp, timeout_redispatch=True)
                count += 1
            if run.status == RunStatus.PENDING:
                self.transport.enqueue_turn(run.id)
            return count


def get_step_backoff(name: str, attempt: int) -> timezone.timedelta:
    try:
        return get_step(name).backoff_for(attempt)
    except StepNotFound:
        return timezone.timedelta(seconds=2 ** max(0, attempt - 1))


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine() -> Engine:
    """This process's engine, built from settings on first use."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                settings = get_settings()
                _engine = Engine(
                    admission=build_backend(settings.admission),
                    transport=build_backend(settings.transport),
                    settings=settings,
                )
    return _engine


def set_engine(engine: Engine | None) -> None:
    """Replace (or with None, forget) this process's engine; used by tests."""
    global _engine
    _engine = engine


def write_queues(queues: Iterable[QueueConfig], using: str = "default") -> None:
    """Upsert queue configs into `FlowQueue`, where every process and the admin read them."""
    for config in queues:
        FlowQueue.objects.using(using).update_or_create(name=config.name, defaults={"config": config.as_dict()})


def persist_configured_queues(sender: Any = None, **kwargs: Any) -> None:
    """post_migrate handler: make the settings' queues visible in the admin at once."""
    try:
        write_queues(get_settings().queues, using=kwargs.get("using", "default"))
    except DatabaseError:  # the table may not exist yet when migrating backwards
        logger.debug("could not persist queues", exc_info=True)
