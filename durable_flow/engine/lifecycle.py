"""A run's life: start (and child start), finish, cancel, signals, and events reaching waits.

A run that ends withdraws its parked calls from their queues (`release_order`), cancels its
unfinished children and reports to its parent, waking it when its wave has settled (`wake`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction

from durable_flow.config.limits import RUN_ID_LENGTH, SIGNAL_NAME_LENGTH
from durable_flow.config.validation import storable_text
from durable_flow.definitions import quotas, step_concurrency
from durable_flow.definitions.events import Condition, payload
from durable_flow.definitions.quotas import QuotaSpec
from durable_flow.definitions.registry import WorkflowDefinition, resolve_workflow
from durable_flow.definitions.serialization import ensure_json
from durable_flow.engine import start_gate
from durable_flow.engine.base import settle
from durable_flow.engine.locking import locked_run, one, retry_on_conflict
from durable_flow.engine.turn import PENDING
from durable_flow.exceptions import ConcurrencyLimitError, DurableFlowError, InvalidInput, RunNotFound
from durable_flow.models import (
    SETTLED_STEP_STATUSES,
    TERMINAL_RUN_STATUSES,
    EventAction,
    RunStatus,
    Signal,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkflowRun,
    new_run_id,
)
from durable_flow.models.runs import PARKED, PARKED_STEP_STATUSES
from durable_flow.store import events as event_store
from durable_flow.store import metric_counts, run_bells, timer_bells
from durable_flow.store import quotas as quota_store
from durable_flow.store.statements import save_fields

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.config.settings import DurableFlowSettings
    from durable_flow.engine.base import Clock, TaskQueue
    from durable_flow.engine.release_order import Releases
    from durable_flow.engine.wake import Waker

logger = logging.getLogger("durable_flow.engine")

MAX_TAG = 200  # tags live in a JSON list; the bound keeps a `concurrency:<key>` tag storable anywhere


class Lifecycle:
    """Starting, finishing and cancelling runs; delivering signals."""

    def __init__(
        self,
        settings: DurableFlowSettings,
        admission: AdmissionBackend,
        transport: TaskQueue,
        clock: Clock,
        releases: Releases,
        waker: Waker,
    ) -> None:
        """`admission` plans a run's step-concurrency constraints; `releases` frees the tickets
        of the calls a finish or a cancel withdraws; `waker` wakes a run a signal or a child's
        end lets go on."""
        self.settings = settings
        self.admission = admission
        self.transport = transport
        self.clock = clock
        self.releases = releases
        self.waker = waker

    def now(self) -> datetime:
        """The engine's clock (a start's gate reads it: `start_gate`)."""
        return self.clock()

    @retry_on_conflict
    def start(
        self,
        workflow: WorkflowDefinition | str,
        input: Any = None,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        quota: QuotaSpec | Mapping[str, Any] | None = None,
        gate: start_gate.StartGate | None = None,
        priority: int = 0,
    ) -> WorkflowRun:
        """Create a run and queue its first turn (at `priority`, where the transport orders
        turns: `Transport.enqueue_first_turn`). Idempotent on `run_id`.

        Over its start quota (`quota`, else the workflow's) it raises `ConcurrencyLimitError`
        and creates nothing; an existing `run_id` is returned without a quota check. A workflow's
        debounce or singleton (or `gate`, a task's) may return a run that already exists instead
        (`start_gate`)."""
        definition = resolve_workflow(workflow)
        ensure_json(input, f"input of workflow {definition.name!r}", self.settings.max_payload_bytes)
        if isinstance(tags, str) or not isinstance(tags, Iterable):
            raise InvalidInput(f"tags must be a list of strings, got {type(tags).__name__}")
        tag_list = [storable_text(tag, "tag", MAX_TAG) for tag in tags]
        if run_id is not None:
            storable_text(run_id, "run_id", RUN_ID_LENGTH)
            existing = one(WorkflowRun.objects.filter(pk=run_id))
            if existing is not None:
                return existing
        new_id = run_id if run_id is not None else new_run_id()
        constraints = step_concurrency.plan_run(definition, input, new_id, self.settings.environment, self.admission)
        check = quotas.plan(definition.label_for(input), definition.quota, quota, input)
        gate = gate or start_gate.plan(definition, input, new_id)
        fields: dict[str, Any] = {
            "workflow": definition.name,
            "version": definition.version,
            "input": input,
            "status": RunStatus.PENDING,
            "step_concurrency": constraints,
            **quotas.run_fields(check, tag_list),
        }
        if run_id is not None or constraints:
            fields["id"] = new_id
        try:
            with transaction.atomic():
                # Debounce/singleton first: a start folded into a pending run takes no quota slot.
                if gate is not None and (resolved := gate.apply(self, fields)) is not None:
                    return resolved
                if check is not None:
                    # Under the key's lock: a same-id start that won meanwhile is returned, not refused.
                    if run_id is not None and (existing := one(WorkflowRun.objects.filter(pk=run_id))):
                        return existing
                    quota_store.enforce(check)
                run = WorkflowRun.objects.create(**fields)
                if run.status == RunStatus.PENDING and priority:
                    self.transport.enqueue_first_turn(run.id, priority)
                elif run.status == RunStatus.PENDING:
                    self.transport.enqueue_turn(run.id)
                else:  # a debounced run waits for the poller, rung if its period is short
                    timer_bells.parked(run.wake_at, self.clock(), self.settings.poller_interval_ms / 1000)
        except ConcurrencyLimitError as exc:
            quota_store.record_refusal(exc)
            raise
        except IntegrityError:
            if run_id is None:
                raise
            # A concurrent start with the same run_id won: return its run.
            return WorkflowRun.objects.get(pk=run_id)
        return run

    def start_child(
        self,
        parent: WorkflowRun,
        *,
        key: str,
        sequence: int,
        definition: WorkflowDefinition,
        input: Any,
        group: str,
    ) -> StepCheckpoint:
        """Create a child run (inside the parent's turn) and the parent's checkpoint for it."""
        ensure_json(input, f"input of child workflow {definition.name!r}", self.settings.max_payload_bytes)
        child_id = f"{parent.id}:{key}"
        if len(child_id) > RUN_ID_LENGTH:
            # Deep or long ids: stay deterministic (a replay must find the same child) and short.
            child_id = f"{hashlib.sha256(parent.id.encode()).hexdigest()[:40]}:{key}"
        child_checkpoint = partial(
            StepCheckpoint.objects.create,
            run=parent,
            key=key,
            sequence=sequence,
            kind=StepKind.CHILD,
            name=definition.name,
            input=input,
            group=group,
            child_run_id=child_id,
            dispatched_at=self.clock(),
        )
        check = None
        constraints: list[dict[str, Any]] = []
        if definition.concurrency and not WorkflowRun.objects.filter(pk=child_id).exists():
            constraints = step_concurrency.plan_run(
                definition, input, child_id, self.settings.environment, self.admission
            )
        if definition.quota is not None and not WorkflowRun.objects.filter(pk=child_id).exists():
            try:
                check = quotas.plan(definition.name, definition.quota, None, input)
                if check is not None:
                    quota_store.enforce(check)
            except ConcurrencyLimitError as exc:
                quota_store.record_refusal(exc)
                # Recorded on the parent's checkpoint: a replay raises the same refusal at
                # `ctx.child` instead of starting the child later.
                return child_checkpoint(
                    status=StepStatus.FAILED, error=quotas.refusal_error(exc), finished_at=self.clock()
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
                "step_concurrency": constraints,
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
        cp = child_checkpoint(status=StepStatus.DISPATCHED)
        if created:
            self.transport.enqueue_turn(child_id)
        elif child.is_terminal:
            self._record_child_outcome(cp, child)
        return cp

    def finish(
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
        run.finished_at = self.clock()
        save_fields(run, ["status", "output", "error", "wake_at", "finished_at", "turns", "updated_at"])
        run_bells.finished(run.pk)  # wakes the callers waiting for it (`durable_flow.wait`), once committed
        metric_counts.count(metric_counts.RUNS_FINISHED, {"workflow": run.workflow, "status": status})
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
            # to be granted a slot it cannot use.
            if cp.queue or run.step_concurrency:
                self.releases.release_settled(cp.queue, cp.ticket)
            cp.holds_slot = False
            cp.save(update_fields=["holds_slot"])
            settle(cp, StepStatus.CANCELLED, self.clock())
        if children:
            for child_id in run.children.exclude(status__in=TERMINAL_RUN_STATUSES).values_list("id", flat=True):
                self.cancel(child_id)
        if run.parent_id:
            # Lock the parent's row first, as a step result does: siblings finishing at once then
            # take turns, and the last one sees every sibling settled and wakes the parent.
            _, parent_cp = locked_run(run.parent_id, run.parent_step_key)
            if parent_cp is not None:
                self._record_child_outcome(parent_cp, run)
                self.waker.wake_if_group_settled(parent_cp)

    def _record_child_outcome(self, cp: StepCheckpoint, child: WorkflowRun) -> None:
        if cp.status in SETTLED_STEP_STATUSES:
            return
        if child.status == RunStatus.COMPLETED:
            settle(cp, StepStatus.COMPLETED, self.clock(), output=child.output)
        else:
            settle(cp, StepStatus.FAILED, self.clock(), error={"status": child.status, "error": child.error})

    @retry_on_conflict
    def cancel(self, run_id: str) -> WorkflowRun:
        """Cancel a run and its children. A run with a step executing goes to `cancelling`
        and becomes `cancelled` when that step's (ignored) result lands."""
        with transaction.atomic():
            run, _ = locked_run(run_id)
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            if run.is_terminal:
                return run
            in_flight = False
            for cp in run.checkpoints.exclude(status__in=SETTLED_STEP_STATUSES).select_for_update():
                if cp.kind == StepKind.STEP and cp.status == StepStatus.DISPATCHED:
                    in_flight = True
                    continue
                if cp.kind == StepKind.STEP and (cp.queue or run.step_concurrency):
                    self.releases.release_settled(cp.queue, cp.ticket)  # withdraw a waiter / free a slot
                    cp.holds_slot = False
                    cp.save(update_fields=["holds_slot"])
                settle(cp, StepStatus.CANCELLED, self.clock())
            for child_id in run.children.exclude(status__in=TERMINAL_RUN_STATUSES).values_list("id", flat=True):
                self.cancel(child_id)
            if in_flight:
                run.status = RunStatus.CANCELLING
                run.wake_at = None
                run.save(update_fields=["status", "wake_at", "updated_at"])
            else:
                self.finish(run, RunStatus.CANCELLED, error={"type": "Cancelled", "message": "cancelled"})
            return run

    def finish_cancelling(self, run: WorkflowRun) -> None:
        if run.status != RunStatus.CANCELLING:
            return
        if not run.checkpoints.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED).exists():
            self.finish(run, RunStatus.CANCELLED, error={"type": "Cancelled", "message": "cancelled"})

    @retry_on_conflict
    def send_signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """Deliver a signal; kept until the run waits for it, so one sent early is not lost."""
        storable_text(name, "signal name", SIGNAL_NAME_LENGTH)
        ensure_json(payload, f"payload of signal {name!r}", self.settings.max_payload_bytes)
        with transaction.atomic():
            run, _ = locked_run(run_id)
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            if run.is_terminal:
                raise DurableFlowError(f"run {run_id!r} is {run.status}; it takes no more signals")
            Signal.objects.create(run=run, name=name, payload=payload)
            waiting = run.checkpoints.filter(kind=StepKind.SIGNAL, name=name, status=StepStatus.DISPATCHED)
            if waiting.exists():
                self.waker.wake(run)

    def consume_signal(self, run: WorkflowRun, name: str, key: str) -> Any:
        """The oldest unconsumed signal `name` for the run, marked as taken by call `key`;
        `PENDING` when none has arrived."""
        signal = Signal.objects.filter(run=run, name=name, consumed_by="").order_by("id").first()
        if signal is None:
            return PENDING
        signal.consumed_by = key
        signal.save(update_fields=["consumed_by"])
        return signal.payload

    def find_event(self, name: str, match: Condition | None, began: datetime, event: Any) -> Any:
        """A new wait's look-back (inside its turn): the first event of `name` recorded since
        `began` for which `match` holds (`event`: the run's input), as its payload; `PENDING`
        when none has. Takes the name's lock to the turn's commit (`store.events`), so an event
        whose delivery reads the waits too early is seen here."""
        event_store.lock_name(name)
        for row in event_store.since(name, began):
            incoming = row_payload(row)
            if match is None or match.holds(event=event, incoming=incoming):
                return incoming
        return PENDING

    @retry_on_conflict
    def deliver_event(self, run_id: str, key: str, incoming: dict[str, Any]) -> bool:
        """Settle the run's wait `key` with the event `incoming` and wake the run, if the wait
        still waits (an event that comes twice, or after the wait timed out, changes nothing).
        Whether it resumed the wait."""
        with transaction.atomic():
            run, cp = locked_run(run_id, key)
            if run is None or cp is None or run.is_terminal:
                return False
            if cp.kind != StepKind.EVENT or cp.status != StepStatus.DISPATCHED:
                return False
            settle(cp, StepStatus.COMPLETED, self.clock(), output=incoming)
            event_store.record_delivery(incoming["id"], EventAction.RESUMED, run.workflow, run.id)
            self.waker.wake(run)
            return True


def row_payload(row: Any) -> dict[str, Any]:
    """An `Event` row as runs see it (`definitions.events.payload`)."""
    return payload(row.name, row.data, row.id, row.received_at)
