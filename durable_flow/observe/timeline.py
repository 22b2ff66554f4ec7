"""A run's timeline: one row per step attempt (and per sleep, signal wait and child run) on a
time axis, each made of segments (queue wait, transport wait, execution, backoff, ...), under a
first row for the run's turns: when the workflow waited for a worker to replay it.

Computed from the durable record only (checkpoints, `StepAttempt` rows, signals), so it
draws the same for a run that is still going and for one finished a week ago. Positions are
percentages of the run's span, which the dashboard renders server-side as HTML (no JavaScript,
no chart library).

A queue wait is drawn only where the engine recorded one (the attempt's `waited`, or the
waiting call's `wait_detail`), labelled with its queue and cause; a call admitted at once has
none, whatever its queue. A long stretch where nothing but people are awaited (an operator's
delay, a signal, a sleep) is compressed to a short break marked with its duration, so it does
not squash the attempts around it to slivers (a stretch where nothing is drawn at all is
compressed the same way). Attempts are numbered per retry round: an
operator's retry gives the step a fresh budget, so its attempts read "retry 1 · attempt 1 of 2"
and the rows drawn before it keep their "attempt 2 of 2".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
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
from durable_flow.observe.waits import NO_WORKER, POLLER, START_TIMEOUT, describe, when

#: More rows than this are cut (a fan-out of thousands); the table below says how many.
MAX_ROWS = 300

SEGMENT_LABELS = {
    "queue": "queue wait",
    "transport": NO_WORKER,
    "poller": POLLER,
    "retried": "the retry's turn: waiting for a worker, then replay",
    "execution": "execution",
    "failed": "execution (failed)",
    "backoff": "backoff",
    "sleep": "sleep",
    "signal": "signal wait",
    "event": "event wait",
    "child": "child run",
    "lost": "lost (worker gone)",
    "turn": "turn: waiting for a worker, then replay",
    "operator": "operator's delay (stopped until retried)",
}


#: Segments during which only people (or the clock) are awaited: a long stretch of nothing
#: else is compressed (`_compress`).
IDLE_KINDS = frozenset({"operator", "signal", "event", "sleep"})
#: An idle stretch longer than this share of the run's span is compressed to `BREAK_SHARE`.
IDLE_SHARE, BREAK_SHARE = 0.2, 0.06


@dataclass
class Segment:
    kind: str
    start: datetime
    end: datetime
    left: float = 0.0
    width: float = 0.0
    #: Why it waited (a queue wait's queue and cause, in operator words).
    detail: str = ""

    @property
    def label(self) -> str:
        base = SEGMENT_LABELS[self.kind]
        return f"{base}: {self.detail}" if self.detail else base

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
    #: Which retry round the attempt is in (0: before any operator's retry), its number within
    #: the round and the round's budget.
    round: int = 0
    round_attempt: int = 0
    round_of: int = 0

    @property
    def attempt_label(self) -> str:
        """`attempt 2 of 2`, or `retry 1 · attempt 1 of 2` after an operator's retry."""
        if not self.attempt:
            return ""
        text = f"attempt {self.round_attempt or self.attempt} of {self.round_of or self.max_attempts}"
        return f"retry {self.round} · {text}" if self.round else text

    @property
    def start(self) -> datetime | None:
        return self.segments[0].start if self.segments else None

    @property
    def end(self) -> datetime | None:
        return self.segments[-1].end if self.segments else None


@dataclass
class Break:
    """A compressed idle stretch: where it is drawn and how long it really was."""

    start: datetime
    end: datetime
    left: float = 0.0
    width: float = 0.0

    @property
    def label(self) -> str:
        return f"{_amount((self.end - self.start).total_seconds())} idle"


@dataclass
class Timeline:
    start: datetime
    end: datetime
    rows: list[Row]
    cut: int
    ticks: list[tuple[float, str]]
    breaks: list[Break] = field(default_factory=list)
    unit: str = "s"
    #: The run's start as the axis names it (with its date when not today).
    origin: str = ""

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def _step_rows(cp: StepCheckpoint, attempts: list[StepAttempt], now: datetime) -> list[Row]:
    """One row per attempt: the queue wait the engine recorded (from when the call could be
    admitted: its creation, or the previous failure's backoff end, to dispatch), the wait for
    a worker to claim it, execution to the result, then the backoff before the next attempt.
    A wait that was no queue's: the poller's pass after a backoff, or an operator's retry
    waiting for its turn. Attempts are numbered per retry round (see the module)."""
    rows = []
    ready: datetime | None = cp.created_at
    after = ""  # what `ready` follows: "" (the call), "backoff" or "retried"
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
                _wait(row, ready, cp.dispatched_at, cp.wait_detail if not cp.wait_cause else None, after, now)
                end = cp.finished_at or now
                kind = "transport" if cp.status == StepStatus.DISPATCHED else "execution"
                row.segments.append(Segment(kind, cp.dispatched_at, end))
                row.error = cp.error if cp.status == StepStatus.FAILED else None
            ready = None
            continue
        row.status, row.worker, row.error = a.status, a.worker, a.error
        if a.status == AttemptStatus.RUNNING and n < latest:
            row.status = "lost"
        if a.dispatched_at:
            _wait(row, ready, a.dispatched_at, a.waited, after, now)
        if a.dispatched_at and a.started_at:
            row.segments.append(Segment("transport", a.dispatched_at, a.started_at))
        if a.started_at:
            end = a.finished_at or now
            kind = {"failed": "failed", "lost": "lost"}.get(row.status, "execution")
            row.segments.append(Segment(kind, a.started_at, end))
        if a.retry_at and a.finished_at:
            row.segments.append(Segment("backoff", a.finished_at, a.retry_at))
        ready, after = a.retry_at, "backoff"
        if a.operator_retry_at and a.finished_at:
            # Failed for good (or cancelled) until a person retried the run: their delay, then
            # the next attempt's wait counts from the retry.
            row.segments.append(Segment("operator", a.finished_at, max(a.operator_retry_at, a.finished_at)))
            ready, after = a.operator_retry_at, "retried"
    if cp.status in (StepStatus.WAITING, StepStatus.RETRYING) and not (
        cp.status == StepStatus.RETRYING and cp.wake_at and cp.wake_at > now
    ):
        # Waiting for admission now (first attempt, after a backoff or a retry): a bar growing
        # to now, labelled with the cause the engine recorded when it parked the call.
        row = Row(cp.key, cp.name, "step", "waiting", latest + 1, cp.max_attempts)
        begin = ready or cp.created_at
        if after and cp.wait_cause in ("", "backoff"):
            row.segments.append(Segment("poller" if after == "backoff" else "retried", begin, max(now, begin)))
        else:
            row.segments.append(Segment("queue", begin, max(now, begin), detail=describe(cp.wait_detail, now)))
        rows.append(row)
    elif cp.finished_at and (cp.wait_detail or {}).get("cause") == START_TIMEOUT:
        # Gave up waiting for admission (its start timeout): the wait it gave up, and why.
        row = Row(cp.key, cp.name, "step", str(cp.wait_detail.get("outcome", "")), latest + 1, cp.max_attempts)
        waited = cp.wait_detail.get("waited_s")
        joined = cp.finished_at - timedelta(seconds=waited) if isinstance(waited, int | float) else None
        begin = min(joined or ready or cp.created_at, cp.finished_at)
        row.segments.append(Segment("queue", begin, cp.finished_at, detail=describe(cp.wait_detail, now)))
        row.error = cp.error if cp.status == StepStatus.FAILED else None
        rows.append(row)
    _number_rounds(rows, attempts, cp.max_attempts)
    return rows


def _wait(row: Row, ready: datetime | None, dispatched: datetime, waited: Any, after: str, now: datetime) -> None:
    """The wait before an attempt's dispatch: a queue wait where the engine recorded one, the
    poller's pass after a backoff, an operator's retry waiting for its turn; else none (the
    call was admitted when it was made)."""
    if ready is None or ready >= dispatched:
        return
    if isinstance(waited, dict) and waited:
        row.segments.append(Segment("queue", ready, dispatched, detail=describe(waited, now)))
    elif after == "backoff":
        row.segments.append(Segment("poller", ready, dispatched))
    elif after == "retried":
        row.segments.append(Segment("retried", ready, dispatched))


def _number_rounds(rows: list[Row], attempts: list[StepAttempt], max_attempts: int) -> None:
    """Number each attempt within its retry round: a round ends at an attempt an operator
    retried (`operator_retry_at`). A finished round's budget is the attempts it used (it ended
    failed for good, or cancelled); the current round's is what the step may still use."""
    ends = sorted(a.attempt for a in attempts if a.operator_retry_at)
    for row in rows:
        n = row.attempt
        round_ = sum(1 for e in ends if e < n)
        first = ends[round_ - 1] + 1 if round_ else 1
        last = ends[round_] if round_ < len(ends) else max(max_attempts, n)
        row.round, row.round_attempt, row.round_of = round_, n - first + 1, last - first + 1


def _other_row(cp: StepCheckpoint, now: datetime) -> Row:
    kind = {StepKind.SLEEP: "sleep", StepKind.SIGNAL: "signal", StepKind.EVENT: "event", StepKind.CHILD: "child"}[
        cp.kind
    ]
    status = cp.status
    if status == StepStatus.DISPATCHED:  # a sleep, signal or event wait or child still going
        status = {"sleep": "sleeping", "signal": "waiting", "event": "waiting", "child": "running"}[kind]
    row = Row(cp.key, cp.name, kind, status, error=cp.error)
    # A sleep still going is drawn up to now (an hour-long sleep would squash every other bar);
    # its wake time is a note.
    end = cp.finished_at or now
    if cp.kind == StepKind.SLEEP and cp.wake_at and cp.finished_at:
        end = min(cp.finished_at, cp.wake_at)  # settled by the turn that woke it: that wait is the turn's
    if cp.kind == StepKind.SLEEP and cp.wake_at and not cp.finished_at:
        row.note = f"wakes at {when(cp.wake_at, now)}"
    if cp.kind == StepKind.SIGNAL and not cp.finished_at:
        # The real wake: the signal, or its timeout (with its date when not today).
        row.note = f"waits for signal `{cp.name}`, " + (
            f"times out {when(cp.wake_at, now)}" if cp.wake_at else "no timeout"
        )
    if cp.kind == StepKind.EVENT and not cp.finished_at:
        row.note = f"waits for event `{cp.name}`, " + (
            f"times out {when(cp.wake_at, now)}" if cp.wake_at else "no timeout"
        )
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
        elif cp.kind == StepKind.PATCH:
            continue  # a `ctx.patched` marker: a decision, not a wait
        else:
            rows.append(_other_row(cp, now))
    total = len(rows)
    rows = rows[:MAX_ROWS]
    start = run.created_at
    end = max([run.finished_at or now, *(r.end for r in rows if r.end)])
    span = max((end - start).total_seconds(), 0.001)
    scale = _Scale(start, span, _idle_stretches(rows, start, end, span))
    for row in rows:
        for seg in row.segments:
            seg.left = round(scale.at(seg.start), 3)
            seg.width = round(max(scale.at(seg.end) - seg.left, 0.25), 3)
            seg.width = min(seg.width, 100 - seg.left) if seg.left < 100 else 0.25
    breaks = [Break(b, e, round(scale.at(b), 3), round(scale.at(e) - scale.at(b), 3)) for b, e in scale.gaps]
    unit = _unit(span)
    ticks = [(i * 25.0, _offset(scale.seconds_at(i * 25.0), unit)) for i in range(5)]
    return Timeline(
        start=start,
        end=end,
        rows=rows,
        cut=max(total - MAX_ROWS, 0),
        ticks=ticks,
        breaks=breaks,
        unit=unit,
        origin=when(start, now),
    )


def _idle_stretches(rows: list[Row], start: datetime, end: datetime, span: float) -> list[tuple[datetime, datetime]]:
    """Stretches longer than `IDLE_SHARE` of the span in which no segment but an idle one
    (`IDLE_KINDS`) is drawn: the gaps between the busy segments' union."""
    busy = sorted((s.start, s.end) for r in rows for s in r.segments if s.kind not in IDLE_KINDS and s.end > s.start)
    if not busy:
        return []
    gaps, reach = [], start
    for b, e in [*busy, (end, end)]:
        if (b - reach).total_seconds() > IDLE_SHARE * span:
            gaps.append((reach, b))
        reach = max(reach, e)
    return gaps


class _Scale:
    """Seconds since the run's start to a percentage of the axis, piecewise: each compressed
    gap takes `BREAK_SHARE` of the width, the rest of the time shares what is left evenly."""

    def __init__(self, start: datetime, span: float, gaps: list[tuple[datetime, datetime]]) -> None:
        self.start, self.span = start, span
        idle = sum((e - b).total_seconds() for b, e in gaps)
        self.gaps = gaps if gaps and span - idle > 0.001 else []
        self.rate = (100 - BREAK_SHARE * 100 * len(self.gaps)) / (span - idle) if self.gaps else 100 / span
        # (seconds, percent) at each piece's end, from the start.
        self.knots: list[tuple[float, float]] = [(0.0, 0.0)]
        for b, e in self.gaps:
            sb, se = (b - start).total_seconds(), (e - start).total_seconds()
            self.knots.append((sb, self.knots[-1][1] + (sb - self.knots[-1][0]) * self.rate))
            self.knots.append((se, self.knots[-1][1] + BREAK_SHARE * 100))

    def at(self, moment: datetime) -> float:
        """The percentage of the axis `moment` is drawn at."""
        t = min(max((moment - self.start).total_seconds(), 0.0), self.span)
        for (s0, p0), (s1, p1) in zip(self.knots, self.knots[1:], strict=False):
            if t <= s1:
                return p0 + (t - s0) * ((p1 - p0) / (s1 - s0) if s1 > s0 else 0.0)
        s0, p0 = self.knots[-1]
        return min(p0 + (t - s0) * self.rate, 100.0)

    def seconds_at(self, percent: float) -> float:
        """The inverse of `at`, in seconds since the start (the axis' ticks)."""
        for (s0, p0), (s1, p1) in zip(self.knots, self.knots[1:], strict=False):
            if percent <= p1:
                return s0 + (percent - p0) * ((s1 - s0) / (p1 - p0) if p1 > p0 else 0.0)
        s0, p0 = self.knots[-1]
        return min(s0 + (percent - p0) / self.rate, self.span)


#: An axis' unit: its size in seconds and how it is written.
UNITS = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0}


def _unit(span: float) -> str:
    """One unit for the whole axis, chosen by its span."""
    if span < 1:
        return "ms"
    if span < 120:
        return "s"
    if span < 7200:
        return "min"
    return "h"


def _offset(seconds: float, unit: str) -> str:
    value = seconds / UNITS[unit]
    return f"+{value:.0f} ms" if unit == "ms" else f"+{value:.1f} {unit}"


def _amount(seconds: float) -> str:
    """A duration in its own best unit (a break's label)."""
    unit = _unit(seconds)
    return _offset(seconds, unit).lstrip("+")
