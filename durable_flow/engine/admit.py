"""Admission of a step call: a slot from its queue (and its step-concurrency constraints), or
a place in the queue's waiting line, where it costs nothing until a grant dispatches it.

A decision may grant room to other waiters too (a rate window that reopened): those go to the
grants (`handoff`). A result's slot deferred to the end of its run's inline turn is given back
first (`release_order`), so the decision sees it free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from durable_flow.admission.base import AdmissionRequest, Grant
from durable_flow.definitions.step_concurrency import constraints_of
from durable_flow.engine.wait_causes import Cause, admission_cause, paused_cause
from durable_flow.models import StepCheckpoint, StepStatus
from durable_flow.store.counters import count_parked
from durable_flow.store.statements import insert

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.engine.handoff import Grants
    from durable_flow.engine.release_order import Releases
    from durable_flow.store.pausing import PausedQueues


class Admitter:
    """Asks admission for a step call's slot, or parks the call in its queue's line."""

    def __init__(
        self, admission: AdmissionBackend, paused_queues: PausedQueues, grants: Grants, releases: Releases
    ) -> None:
        """`grants` takes the room a decision grants to other waiters; `releases` gives back a
        deferred slot before a decision."""
        self.admission = admission
        self.paused_queues = paused_queues
        self.grants = grants
        self.releases = releases

    def admit(self, cp: StepCheckpoint) -> bool:
        """Ask the queue for a slot: True when admitted. Otherwise the call is parked in the
        queue's waiting line and costs nothing until a grant dispatches it (`handoff`)."""
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
            self._park(cp, paused_cause(cp.queue))
            return False
        decision = self.admission.try_admit(request)
        reopens = decision.retry_at_ms if decision.reason == "rate_limited" else None
        self.grants.take_grant(cp.queue, Grant(decision.granted, reopens))
        if decision.admitted:
            cp.holds_slot = True
            return True
        self._park(cp, admission_cause(decision, cp.queue, cp.run.workflow, cp.fairness_key, constraints))
        return False

    def _park(self, cp: StepCheckpoint, cause: Cause) -> None:
        """Record the call as waiting for a grant, and why (`wait_causes`), in the statement
        that parks it (counted once per attempt that joins the line:
        durable_flow_admissions_total{decision="parked"}). A call already in line (a turn's
        replay asks again) is rewritten only when its cause changed or the instant its detail
        named has passed (a rate window that reopened and filled again): one UPDATE, on the
        parked path only, at most once per window for a call that keeps waiting."""
        before, until = cp.wait_cause, (cp.wait_detail or {}).get("until")
        cp.wait_cause, detail = cause
        fresh = {"cause": cp.wait_cause, **detail}
        if cp.pk is not None and cp.status == StepStatus.WAITING:
            # Already in line: counted when it joined.
            if before != cp.wait_cause or (until is not None and until < fresh.get("until", until)):
                cp.wait_detail = fresh
                cp.save(update_fields=["wait_cause", "wait_detail"])
            return
        cp.wait_detail = fresh
        if cp.pk is None:
            insert(cp)
        else:
            cp.status = StepStatus.WAITING
            cp.save(update_fields=["status", "wait_cause", "wait_detail"])
        count_parked(cp.queue)
