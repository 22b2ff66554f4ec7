"""A run's timeline: one row per step attempt (and per sleep, signal wait and child run) on a
time axis, each made of segments (queue wait, transport wait, execution, backoff, ...), under a
first row for the run's turns: when the workflow waited for a worker to replay it.

Computed from the durable record only (checkpoints, `StepAttempt` rows, signals), so it
draws the same for a run that is still going and for one finished a week ago. Positions are
percentages of the run's span, which the dashboard renders server-side as HTML (no JavaScript,
no chart library).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone

from durable_flow.models import (
    AttemptStatus,
    RunStatus,
    StepAttempt,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkflowRun,
)

#: More rows than this are cut (a fan-out of thousands); the table below says how many.
MAX_ROWS = 300

SEGMENT_LABELS = {
    "queue": "queue wait (admission)",
    "transport": "transport wait",
    "execution": "execution",
    "failed": "execution (failed)",
    "backoff": "backoff",
    "sleep": "sleep",
    "signal": "signal wait",
    "child": "child run",
    "lost": "lost (worker gone)",
    "turn": "turn: waiting for a worker, then replay",
    "operator": "operator's delay (stopped until retried)",
}


@dataclass
class Segment:
    kind: str
    start: datetime
    end: datetime
    left: float = 0.0
    width: float = 0.0

    @property
    def label(self) -> str:
        return SEGMENT_LABELS[self.kind]

    @property
    def seconds(self) -> float:
        return max((self.end - self.start).total_seconds(), 0.0)


@dataclass
class Row:
    """One bar of the timeline: a step attempt, a sleep, a signal wait or a child run."""

    key: str
    name: str
    kind: str
    status: str
    attempt: int = 0
    max_attempts: int = 0
    worker: str = ""
    error: dict[str, Any] | None = None
    child_run_id: str = ""
    note: str = ""
    segments: list[Segment] = field(default_factory=list)

    @property
    def start(self) -> datetime | None:
        return self.segments[0].start if self.segments else None

    @property
    def end(self) -> datetime | None:
        return self.segments[-1].end if self.segments else None


@dataclass
class Timeline:
    start: datetime
    end: datetime
    rows: list[Row]
    cut: int
    ticks: list[tuple[float, str]]

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def _step_rows(cp: StepCheckpoint, attempts: list[StepAttempt], now: datetime) -> list[Row]:
    """One row per attempt: queue wait from when the call could be admitted (its creation, or
    the previous failure's backoff end) to dispatch, transport wait to the worker's start,
    execution to the result, then the backoff before the next attempt."""
    rows = []
    ready: datetime | None = cp.created_at
    by_n = {a.attempt: a for a in attempts}
    latest = max([cp.attempt, *by_n]) if (cp.attempt or by_n) else 0
    for n in range(1, latest + 1):
        a = by_n.get(n)
        row = Row(cp.key, cp.name, "step", "", n, cp.max_attempts)
        rows.append(row)
        if a is None:
            # Written before attempt history existed, or dispatched and not started yet.
            row.status = cp.status if n == cp.attempt else "unknown"
            if n == cp.attempt and cp.dispatched_at:
                if ready and ready < cp.dispatched_at:
                    row.segments.append(Segment("queue", ready, cp.dispatched_at))
                end = cp.finished_at or now
                kind = "transport" if cp.status == StepStatus.DISPATCHED else "execution"
                row.segments.append(Segment(kind, cp.dispatched_at, end))
                row.error = cp.error if cp.status == StepStatus.FAILED else None
            ready = None
            continue
        row.status, row.worker, row.error = a.status, a.worker, a.error
        if a.status == AttemptStatus.RUNNING and n < latest:
            row.status = "lost"
        if a.dispatched_at and ready and ready < a.dispatched_at:
            row.segments.append(Segment("queue", ready, a.dispatched_at))
        if a.dispatched_at and a.started_at:
            row.segments.append(Segment("transport", a.dispatched_at, a.started_at))
        if a.started_at:
            end = a.finished_at or now
            kind = {"failed": "failed", "lost": "lost"}.get(row.status, "execution")
            row.segments.append(Segment(kind, a.started_at, end))
        if a.retry_at and a.finished_at:
            row.segments.append(Segment("backoff", a.finished_at, a.retry_at))
        ready = a.retry_at
        if a.operator_retry_at and a.finished_at:
            # Failed for good (or cancelled) until a person retried the run: their delay, then
            # the next attempt's queue wait counts from the retry.
            row.segments.append(Segment("operator", a.finished_at, max(a.operator_retry_at, a.finished_at)))
            ready = a.operator_retry_at
    if cp.status == StepStatus.WAITING:
        # Waiting for admission now (first attempt, or after a backoff): a bar growing to now.
        row = Row(cp.key, cp.name, "step", "waiting", latest + 1, cp.max_attempts)
        row.segments.append(Segment("queue", ready or cp.created_at, now))
        rows.append(row)
    return rows


def _other_row(cp: StepCheckpoint, now: datetime) -> Row:
    kind = {StepKind.SLEEP: "sleep", StepKind.SIGNAL: "signal", StepKind.CHILD: "child"}[cp.kind]
    status = cp.status
    if status == StepStatus.DISPATCHED:  # a sleep, signal wait or child still going
        status = {"sleep": "sleeping", "signal": "waiting", "child": "running"}[kind]
    row = Row(cp.key, cp.name, kind, status, error=cp.error)
    # A sleep still going is drawn up to now (an hour-long sleep would squash every other bar);
    # its wake time is a note.
    end = cp.finished_at or now
    if cp.kind == StepKind.SLEEP and cp.wake_at and cp.finished_at:
        end = min(cp.finished_at, cp.wake_at)  # settled by the turn that woke it: that wait is the turn's
    if cp.kind == StepKind.SLEEP and cp.wake_at and not cp.finished_at:
        row.note = "wakes at " + cp.wake_at.strftime("%H:%M:%S.") + f"{cp.wake_at.microsecond // 1000:03d}"
    row.segments.append(Segment(kind, cp.created_at, max(end, cp.created_at)))
    if cp.kind == StepKind.CHILD and cp.child_run_id:
        row.child_run_id = cp.child_run_id
    return row


def _wake_times(run: WorkflowRun, checkpoints: list[StepCheckpoint]) -> list[datetime]:
    """When the run could go on: its start, and each call's end (a result, a signal, a child's
    end; a sleep's due time, since the turn that woke it is what settles it)."""
    times = [run.created_at]
    for cp in checkpoints:
        if cp.finished_at is None:
            continue
        if cp.kind == StepKind.SLEEP and cp.wake_at:
            times.append(min(cp.wake_at, cp.finished_at))
        else:
            times.append(cp.finished_at)
    return sorted(times)


def turn_row(run: WorkflowRun, checkpoints: list[StepCheckpoint], now: datetime, executing: bool = False) -> Row:
    """The run's turns, derived from the durable record (no per-turn row is written, to keep
        turns at their few statements): a turn ran when it wrote its calls' checkpoints
        (`created_at`) or finished the run; it could have run from the latest wake before it that
        no earlier turn saw. The bar between the two is waiting for a worker (or the poller, for a
        sleep) plus the replay up to the call. A run that is pending now draws a bar growing to now.

        A turn after a step's result usually runs inline, in the result's transaction: its bar is
        the replay alone, a short one. A turn that made no new call leaves no trace, so a bar
        starts at the latest wake: a lower bound when results arrived while a turn was queued. An
    operator's retry queues a turn that re-admits the reset steps; that wait shows in their rows.
    `executing`: a live worker runs the pending run's first step optimistically (nothing of it
    is written, so the bar cannot split the turn's wait from the step's run)."""
    row = Row("", "Workflow turns", "turn", "", note=f"{run.turns} replayed")
    wakes = _wake_times(run, checkpoints)
    ran = sorted(cp.created_at for cp in checkpoints)
    if run.finished_at and run.status in (RunStatus.COMPLETED, RunStatus.FAILED):
        ran.append(run.finished_at)
    last: datetime | None = None
    for at in ran:
        woken = [w for w in wakes if w <= at and (last is None or w > last)]
        if woken:
            row.segments.append(Segment("turn", woken[-1], at))
        last = at
    if run.status == RunStatus.PENDING:
        # Pending: a turn is queued, since the run was last set pending (its start, a wake, a retry).
        queued = max(run.updated_at, run.created_at)
        row.segments.append(Segment("turn", queued, max(now, queued)))
        row.status = "running" if executing else "waiting"
        if executing:
            row.note += "; its first step is executing, not recorded yet (see Executing now)"
    return row


def build_timeline(run: WorkflowRun, now: datetime | None = None, executing: bool = False) -> Timeline:
    """Every step attempt, sleep, signal wait and child of `run`, placed on one time axis
    (`executing`: see `turn_row`)."""
    now = now or timezone.now()
    checkpoints = list(StepCheckpoint.objects.filter(run=run).order_by("sequence")[: MAX_ROWS + 1])
    attempts: dict[int, list[StepAttempt]] = {}
    for a in StepAttempt.objects.filter(run=run).order_by("attempt"):
        attempts.setdefault(a.checkpoint_id, []).append(a)
    turns = turn_row(run, checkpoints, now, executing)
    rows: list[Row] = [turns] if turns.segments else []
    for cp in checkpoints:
        if cp.kind == StepKind.STEP:
            rows.extend(_step_rows(cp, attempts.get(cp.pk, []), now))
        else:
            rows.append(_other_row(cp, now))
    total = len(rows)
    rows = rows[:MAX_ROWS]
    start = run.created_at
    end = max([run.finished_at or now, *(r.end for r in rows if r.end)])
    span = max((end - start).total_seconds(), 0.001)
    for row in rows:
        for seg in row.segments:
            seg.left = round(max((seg.start - start).total_seconds(), 0.0) / span * 100, 3)
            seg.width = round(max(seg.seconds / span * 100, 0.25), 3)
            seg.width = min(seg.width, 100 - seg.left) if seg.left < 100 else 0.25
    ticks = [(i * 25.0, _offset(span * i / 4)) for i in range(5)]
    return Timeline(start=start, end=end, rows=rows, cut=max(total - MAX_ROWS, 0), ticks=ticks)


def _offset(seconds: float) -> str:
    if seconds < 1:
        return f"+{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"+{seconds:.1f} s"
    return f"+{seconds / 60:.1f} min"
