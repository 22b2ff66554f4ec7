"""Reading the soak's evidence: the start/end stamps its steps write, and the kills it made.

Pure functions over plain data, so the verdicts are easy to read and to test on their own.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Execution:
    """One execution of a soak step in one process: it started, and it ended or its process died."""

    run: str
    stage: int
    pid: int
    start: float
    end: float | None = None


@dataclass
class Kill:
    """A SIGKILL the chaos loop sent; `at` is read after the process was reaped, so it is dead by then."""

    pid: int
    at: float
    role: str


@dataclass
class Outage:
    """A span (epoch seconds) when Redis or the database was down, as the outage soak made it."""

    what: str
    start: float
    end: float


#: How long after an outage ends a step that ran in it may still be re-run: its worker notices
#: the lost connection on its next statement, and backs off up to 5 s (`worker/outage.py`).
OUTAGE_REACH_S = 10.0

#: How long before a database outage starts a step that ended may still be re-run: its result
#: is recorded by the worker's next statements after the step function returns, and on a loaded
#: machine those can come a few seconds later, into the outage. A Redis outage has no such lead:
#: recording a result needs only the database (the `redis` admission slot is released after the
#: commit, and a release lost to the outage is repaired by the poller, not by re-running the step).
OUTAGE_LEAD_S = 5.0


@dataclass
class Evidence:
    executions: list[Execution] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)

    @property
    def killed_pids(self) -> dict[int, float]:
        return {kill.pid: kill.at for kill in self.kills}

    def by_step(self) -> dict[tuple[str, int], list[Execution]]:
        steps: dict[tuple[str, int], list[Execution]] = defaultdict(list)
        for execution in self.executions:
            steps[(execution.run, execution.stage)].append(execution)
        return steps

    def unexplained_reexecutions(self) -> list[tuple[str, int]]:
        """Steps that ran more than once in processes that were never killed.

        The engine runs a step at least once and records one result; a second execution is
        expected only when a process that held the step was killed, or when the service that
        records its result was down around the time it ran (the result was not recorded, so the
        step is dispatched again). Those executions are excused, so at most one execution per step
        may be left.
        """
        killed = self.killed_pids
        return [
            step
            for step, runs in self.by_step().items()
            if sum(1 for execution in runs if execution.pid not in killed and not self._in_outage(execution)) > 1
        ]

    def _in_outage(self, execution: Execution) -> bool:
        end = execution.end if execution.end is not None else execution.start
        return any(
            execution.start <= o.end + OUTAGE_REACH_S and end + (0 if o.what == "redis" else OUTAGE_LEAD_S) >= o.start
            for o in self.outages
        )

    def outage_reexecutions(self) -> int:
        """Executions excused by an outage alone (the at-least-once cost of the outages)."""
        killed = self.killed_pids
        return sum(
            sum(1 for e in runs if e.pid not in killed and self._in_outage(e))
            for runs in self.by_step().values()
            if len(runs) > 1
        )

    def reexecutions(self) -> int:
        """Executions beyond the first, over all steps (the at-least-once cost of the kills)."""
        return sum(len(runs) - 1 for runs in self.by_step().values())

    def spans(self, runs: set[str] | None = None) -> list[tuple[float, float]]:
        """(start, end) of every execution of any stage (of `runs` only, if given); one cut by a
        kill ends at the kill."""
        return self._spans([e for e in self.executions if runs is None or e.run in runs])

    def _spans(self, executions: list[Execution]) -> list[tuple[float, float]]:
        killed = self.killed_pids
        spans = []
        for execution in executions:
            end = execution.end if execution.end is not None else killed.get(execution.pid)
            if end is None:
                raise AssertionError(f"{execution} never ended and its process was not killed")
            spans.append((execution.start, end))
        return spans

    def starts(self, stage: int) -> list[float]:
        """When every execution of `stage` started (each one took its place in a rate window)."""
        return [execution.start for execution in self.executions if execution.stage == stage]

    def intervals(self, stage: int) -> list[tuple[float, float]]:
        """(start, end) of every execution of `stage`; one cut by a kill ends at the kill."""
        return self._spans([execution for execution in self.executions if execution.stage == stage])


def read_evidence(log: Path, kills: list[Kill], outages: list[Outage] | None = None) -> Evidence:
    """Pair each `start` line with the next `end` line of the same step in the same process."""
    evidence = Evidence(kills=list(kills), outages=list(outages or []))
    open_runs: dict[tuple[str, int, int], Execution] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        event, run, stage_text, pid_text, at_text = line.split()
        stage, pid, at = int(stage_text), int(pid_text), float(at_text)
        if event == "start":
            execution = Execution(run=run, stage=stage, pid=pid, start=at)
            open_runs[(run, stage, pid)] = execution
            evidence.executions.append(execution)
        else:
            open_runs.pop((run, stage, pid)).end = at
    return evidence


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    events = sorted([(begin, 1) for begin, _ in intervals] + [(end, -1) for _, end in intervals])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def over_limit(intervals: list[tuple[float, float]], limit: int) -> list[tuple[float, int]]:
    """Each instant the number of open intervals rises above `limit`, with that number (an end
    before a start at the same instant, as in `max_overlap`)."""
    events = sorted([(begin, 1) for begin, _ in intervals] + [(end, -1) for _, end in intervals])
    current, over = 0, []
    for at, delta in events:
        current += delta
        if delta > 0 and current > limit:
            over.append((at, current))
    return over


def open_at(intervals: list[tuple[float, float]], at: float) -> int:
    """How many intervals are open at instant `at`."""
    return sum(1 for begin, end in intervals if begin <= at <= end)


def most_in_trailing(stamps: list[float], window_s: float) -> int:
    """The most of the ascending `stamps` in any trailing window (at - window_s, at]."""
    most, first = 0, 0
    for last, at in enumerate(stamps):
        while stamps[first] <= at - window_s:
            first += 1
        most = max(most, last - first + 1)
    return most


def busiest_window(times: list[float], span_s: float) -> int:
    """The most `times` (epoch seconds) inside any half-open span of `span_s` seconds."""
    stamps = sorted(times)
    best = 0
    for index, begin in enumerate(stamps):
        best = max(best, bisect.bisect_left(stamps, begin + span_s) - index)
    return best
