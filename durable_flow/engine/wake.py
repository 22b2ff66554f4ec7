"""Waking a parked run: its status set back to pending and a turn queued on the transport.

Everything that lets a run go on calls this: a signal, a settled child or fan-out wave, a step
sent back through admission, a result whose turn is not taken inline. It reads and writes only
the run's row, so the parts that wake runs need nothing else of each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from durable_flow.models import SETTLED_STEP_STATUSES, RunStatus, StepCheckpoint, WorkflowRun
from durable_flow.models.runs import WAKEABLE

if TYPE_CHECKING:
    from durable_flow.engine.base import Clock, TaskQueue


def group_settled(cp: StepCheckpoint) -> bool:
    """Whether every call of `cp`'s fan-out wave has settled (a lone call is its own wave)."""
    return not cp.group or not (
        StepCheckpoint.objects.filter(run_id=cp.run_id, group=cp.group)
        .exclude(status__in=SETTLED_STEP_STATUSES)
        .exists()
    )


class Waker:
    """Queues turns for parked runs."""

    def __init__(self, transport: TaskQueue, clock: Clock) -> None:
        self.transport = transport
        self.clock = clock

    def wake(self, run: WorkflowRun | str) -> bool:
        """Queue a turn for a parked run now. False if it is not parked (finished, or a turn is
        already queued)."""
        run_id = run if isinstance(run, str) else run.id
        woken = WorkflowRun.objects.filter(pk=run_id, status__in=WAKEABLE).update(
            status=RunStatus.PENDING, wake_at=None, updated_at=self.clock()
        )
        if woken:
            if not isinstance(run, str):
                run.status, run.wake_at = RunStatus.PENDING, None
            self.transport.enqueue_turn(run_id)
        return bool(woken)

    def wake_if_group_settled(self, cp: StepCheckpoint) -> None:
        """Wake `cp`'s run once its fan-out wave (or lone call) has settled."""
        if group_settled(cp):
            self.wake(cp.run_id)
