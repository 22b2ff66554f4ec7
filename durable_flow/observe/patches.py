"""Which runs still need a `ctx.patched` change's old branch: the check that tells when the
branch can be removed (`manage.py durable_patches`).

A run's side of a change is recorded the first time its replay reaches `ctx.patched(id)` (a
`patch` checkpoint, `True` for the new path, `False` for the old one). A run that took the
old path, and is not finished, needs the old branch. So may a run that has not reached the
call yet and whose turns before the deploy ran the old code past the change: nothing records
that until new code replays it, so every unfinished run without the marker that was created
before the deploy is counted too. A run created after the deploy was run by the new code from
its first turn: it takes the new path wherever its `patched` call sits. The deploy's time is
the first run that took the new path, unless `deployed_at` says when the last old worker
stopped (later, if an old worker still took turns after a new one had begun).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Min

from durable_flow.models import TERMINAL_RUN_STATUSES, StepCheckpoint, StepKind, WorkflowRun

SHOWN_IDS = 20  # run ids listed per patch; the counts are whole


@dataclass(frozen=True)
class PatchState:
    """One change (`patch_id`) of one workflow."""

    workflow: str
    patch_id: str
    new_path: int  # runs that recorded the new path, finished or not
    deployed_at: datetime  # runs created before it without the marker may hold old history
    old_path: int  # unfinished runs that recorded the old path
    unmarked: int  # unfinished runs created before `deployed_at` that have not reached the call
    run_ids: tuple[str, ...]  # some of the runs counted in `old_path` and `unmarked`

    @property
    def removable(self) -> bool:
        """Whether the old branch (and the `ctx.patched` call) can go: no unfinished run may
        still replay history written by the old code past the change."""
        return not self.old_path and not self.unmarked


def patch_states(
    workflow: str | None = None, patch_id: str | None = None, deployed_at: datetime | None = None
) -> list[PatchState]:
    """Every change some run has reached (narrowed to `workflow`, `patch_id`). `deployed_at`
    defaults, per change, to the first time a run recorded its new path: the earliest moment
    the new code ran."""
    markers = StepCheckpoint.objects.filter(kind=StepKind.PATCH)
    if workflow is not None:
        markers = markers.filter(run__workflow=workflow)
    if patch_id is not None:
        markers = markers.filter(name=patch_id)
    changes = (
        markers.values_list("run__workflow", "name").annotate(first=Min("created_at")).order_by("run__workflow", "name")
    )
    states = []
    for name, change, first_seen in changes:
        these = StepCheckpoint.objects.filter(kind=StepKind.PATCH, name=change, run__workflow=name)
        first_new = these.filter(output=True).aggregate(first=Min("created_at"))["first"]
        cutoff = deployed_at or first_new or first_seen
        unfinished = WorkflowRun.objects.filter(workflow=name).exclude(status__in=TERMINAL_RUN_STATUSES)
        old = unfinished.filter(pk__in=these.filter(output=False).values("run_id"))
        unmarked = unfinished.filter(created_at__lt=cutoff).exclude(pk__in=these.values("run_id"))
        ids = [*old.values_list("pk", flat=True)[:SHOWN_IDS]]
        ids += unmarked.values_list("pk", flat=True)[: SHOWN_IDS - len(ids)]
        states.append(
            PatchState(
                workflow=name,
                patch_id=change,
                new_path=these.filter(output=True).count(),
                deployed_at=cutoff,
                old_path=old.count(),
                unmarked=unmarked.count(),
                run_ids=tuple(sorted(ids)),
            )
        )
    return states
