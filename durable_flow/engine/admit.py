"""Admission of a step call: a slot from its queue (and its step-concurrency constraints), or
a place in the queue's waiting line, where it costs nothing until a grant dispatches it.

A decision may grant room to other waiters too (a rate window that reopened): those go to the
grants (`handoff`). A result's slot deferred to the end of its run's inline turn is given back
first (`release_order`), so the decision sees it free.

A call with a start timeout (its own `start_timeout`, else its queue's `start_timeout_s`) is
given a deadline as it joins the line (`StepCheckpoint.start_deadline`), which its turn waits
on like a sleep's end: the poller wakes the run then, even if nothing else happens, and the
replay gives the call up (`give_up`) unless a grant dispatched it first.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from durable_flow.admission.base import AdmissionRequest, Grant
from durable_flow.config.queues import QueueConfig
from durable_flow.definitions.step_concurrency import constraints_of
from durable_flow.engine.base import settle
from durable_flow.engine.turn import StepOptions
from durable_flow.engine.wait_causes import (
    START_TIMEOUT,
    Cause,
    admission_cause,
    held_by,
    paused_cause,
    seconds_text,
)
from durable_flow.exceptions import StartTimeoutError
from durable_flow.models import StepCheckpoint, StepStatus
from durable_flow.store import metric_counts
from durable_flow.store.counters import count_parked
from durable_flow.store.queues import stored_queue
from durable_flow.store.statements import insert

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.engine.base import Clock
    from durable_flow.engine.handoff import Grants
    from durable_flow.engine.release_order import Releases
    from durable_flow.store.pausing import PausedQueues

#: The keys a start timeout adds to a parked call's `wait_detail`, kept when its cause changes.
_GIVE_UP_KEYS = ("gives_up_at", "start_timeout_s", "on_timeout")


class Admitter:
    """Asks admission for a step call's slot, or parks the call in its queue's line; gives up
    a parked call whose start timeout ran out."""

    def __init__(
        self,
        admission: AdmissionBackend,
        paused_queues: PausedQueues,
        grants: Grants,
        releases: Releases,
        clock: Clock,
    ) -> None:
        """`grants` takes the room a decision grants to other waiters; `releases` gives back a
        deferred slot before a decision, and a place in line given up; `clock` dates deadlines."""
        self.admission = admission
        self.paused_queues = paused_queues
        self.grants = grants
        self.releases = releases
        self.clock = clock

    def admit(self, cp: StepCheckpoint, options: StepOptions | None = None) -> bool:
        """Ask the queue for a slot: True when admitted. Otherwise the call is parked in the
        queue's waiting line and costs nothing until a grant dispatches it (`handoff`), or its
        start timeout (`options`, else the queue's) runs out."""
        if cp.holds_slot:
            return True
        # Step concurrency gates the call whatever its queue (see `AdmissionRequest`).
        constraints = constraints_of(cp.run.step_concurrency)
        gated_queue = bool(cp.queue) and self.admission.handles(cp.queue)
        if not gated_queue and not constraints:
            return True
        self.releases.release_deferred_now()  # a result's slot, given back before anything is decided
        request = AdmissionRequest(
            queue=cp.queue,
            ticket=cp.ticket,
            priority=cp.priority,
            fairness_key=cp.fairness_key,
            constraints=constraints,
        )
        if gated_queue and self.paused_queues.is_paused(cp.queue):
            # A paused queue decides nothing: the call joins its line (keeping any place it had)
            # and `resume_queue` grants it; a slot it already holds is kept.
            if self.admission.reoffer(cp.queue, [request]):
                cp.holds_slot = True
                return True
            self._park(cp, paused_cause(cp.queue), options, None)
            return False
        decision = self.admission.try_admit(request)
        reopens = decision.retry_at_ms if decision.reason == "rate_limited" else None
        self.grants.take_grant(cp.queue, Grant(decision.granted, reopens))
        if decision.admitted:
            cp.holds_slot = True
            return True
        cause = admission_cause(decision, cp.queue, cp.run.workflow, cp.fairness_key, constraints)
        self._park(cp, cause, options, decision.limits)
        return False

    def _park(self, cp: StepCheckpoint, cause: Cause, options: StepOptions | None, limits: QueueConfig | None) -> None:
        """Record the call as waiting for a grant, and why (`wait_causes`), in the statement
        that parks it (counted once per attempt that joins the line:
        durable_flow_admissions_total{decision="parked"}). A call already in line (a turn's
        replay asks again) is rewritten only when its cause changed or the instant its detail
        named has passed (a rate window that reopened and filled again): one UPDATE, on the
        parked path only, at most once per window for a call that keeps waiting. A call joining
        the line with a start timeout gets its deadline in the same statement."""
        before, until = cp.wait_cause, (cp.wait_detail or {}).get("until")
        kept = {key: value for key, value in (cp.wait_detail or {}).items() if key in _GIVE_UP_KEYS}
        cp.wait_cause, detail = cause
        in_line = cp.pk is not None and cp.status == StepStatus.WAITING
        fresh = {"cause": cp.wait_cause, **detail, **(kept if in_line else {})}
        deadline = None if in_line and cp.start_deadline is not None else self._give_up_plan(cp, options, limits)
        if deadline is not None:
            fresh |= deadline
        if in_line:
            # Already in line: counted when it joined.
            reopened = until is not None and until < fresh.get("until", until)
            if deadline is not None or before != cp.wait_cause or reopened:
                cp.wait_detail = fresh
                cp.save(update_fields=["wait_cause", "wait_detail", "start_deadline"])
            return
        cp.wait_detail = fresh
        if cp.pk is None:
            insert(cp)
        else:
            cp.status = StepStatus.WAITING
            cp.save(update_fields=["status", "wait_cause", "wait_detail", "start_deadline"])
        count_parked(cp.queue)

    def _give_up_plan(
        self, cp: StepCheckpoint, options: StepOptions | None, limits: QueueConfig | None
    ) -> dict[str, Any] | None:
        """Set `cp.start_deadline` for a call joining the line (None when no start timeout
        applies: the call waits as long as it takes), and return what its wait detail records
        of it: when it gives up, after how long, and what it then does."""
        timeout_s: float | None = None
        outcome = options.on_start_timeout if options is not None else None
        if options is not None and options.start_timeout is not None:
            timeout_s = options.start_timeout.total_seconds()
        if cp.queue and (timeout_s is None or outcome is None):
            queue = limits if limits is not None and limits.name == cp.queue else stored_queue(cp.queue)
            if queue is not None:
                timeout_s = timeout_s if timeout_s is not None else queue.start_timeout_s
                outcome = outcome or queue.on_start_timeout
        cp.start_deadline = None
        if timeout_s is None:
            return None
        cp.start_deadline = self.clock() + timedelta(seconds=timeout_s)
        return {
            "gives_up_at": cp.start_deadline.isoformat(timespec="milliseconds"),
            "start_timeout_s": timeout_s,
            "on_timeout": outcome or "fail",
        }

    def give_up(self, cp: StepCheckpoint) -> bool:
        """The call's start timeout ran out while it waited: withdraw it from its queue's line
        (or, had a grant just given it a slot whose dispatch has not reached it yet, free that
        slot and hand it on: `release_settled`, the path a cancel takes, so a slot is never kept
        nor the cap passed), and settle it. True when it fails (`StartTimeoutError` at its
        `ctx.step`), False when it is skipped (its `ctx.step` returns None). Counted in
        `durable_flow_start_timeouts_total{queue, outcome}`."""
        now = self.clock()
        waited = dict(cp.wait_detail or {})
        timeout_s = float(waited.get("start_timeout_s") or 0)
        joined = cp.start_deadline - timedelta(seconds=timeout_s) if cp.start_deadline is not None else now
        waited_s = max(0.0, (now - joined).total_seconds())
        fails = waited.get("on_timeout", "fail") != "skip"
        reason = held_by(waited)
        where = f" on queue {cp.queue!r}" if cp.queue else ""
        message = (
            f"step {cp.name!r} gave up waiting for admission after {seconds_text(waited_s)}{where} "
            f"(start timeout {seconds_text(timeout_s)}): {reason}"
        )
        record = {
            "cause": START_TIMEOUT,
            "queue": cp.queue,
            "waited_s": round(waited_s, 3),
            "timeout_s": timeout_s,
            "held_by": reason,
            "outcome": "failed" if fails else "skipped",
            "waited": {key: value for key, value in waited.items() if key not in _GIVE_UP_KEYS},
        }
        if cp.queue or cp.run.step_concurrency:
            self.releases.release_settled(cp.queue, cp.ticket)
        cp.holds_slot, cp.start_deadline = False, None
        cp.wait_detail = {**record, "message": message}
        fields = ["holds_slot", "start_deadline", "wait_detail"]
        if fails:
            error = {"type": StartTimeoutError.__name__, "message": message, **record}
            settle(cp, StepStatus.FAILED, now, error=error, fields=fields)
        else:
            settle(cp, StepStatus.COMPLETED, now, fields=fields)
        metric_counts.count(metric_counts.START_TIMEOUTS, {"queue": cp.queue, "outcome": record["outcome"]})
        return fails
