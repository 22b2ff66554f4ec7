"""The chaos soak's parts, shared by its variants (`test_soak.py`: random kills;
`test_soak_outages.py`: Redis and PostgreSQL outages): the soaked fleet, the workload, and the
verdict read once everything has settled.

`SOAK_RUNS` scales the number of runs (default 1,000, the size `make test` runs on the two stacks
the issue names; more is the long mode) and `SOAK_SEED` replays a chaos schedule.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import django_rq
from django.db import connection

from durable_flow import cancel, register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepAttempt, StepCheckpoint, WorkerHeartbeat, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.reliability.evidence import Evidence, Kill, Outage, busiest_window, max_overlap, read_evidence
from tests.support.redis_keys import delete_keys
from tests.workflows import soak_value

RUNS = int(os.environ.get("SOAK_RUNS", "1000"))
#: The runs of the variants beside the two named stacks (`db` on PostgreSQL, the outage soak):
#: an eighth of `RUNS`, at least 120, to keep `make test` within its budget.
SIDE_RUNS = max(120, RUNS // 8)
SEED = int(os.environ.get("SOAK_SEED", str(random.randrange(1_000_000))))
WORKERS = 3
#: Sized for 1,000 runs (the checks are the same at any size): the window alone, then 15 a
#: second, made them take over a minute; a killed worker's slots stay taken for HEARTBEAT_TTL_S,
#: so the caps (then 3 and 2) were often held mostly by the dead. Low enough to be reached when
#: the fleet keeps up (the peaks are printed; on a loaded machine they may stay below).
CAP, FAIR_CAP = 4, 3
WINDOW_LIMIT, WINDOW_MS = 30, 1000
#: A start is counted on the backend's clock a moment before the step stamps it (another clock
#: read, another thread's turn), so the window is checked over a span this much shorter than its
#: period: N per any period implies N per any shorter span.
STAMP_SLACK_MS = 250
STEP_MS = 30
TENANTS = 6
#: The soak fails as stuck when no run has settled for this long. Progress, not a total time: on
#: a busy machine the soak is slower, not stuck (the longest quiet spell by design is the `rq`
#: REDISPATCH_AFTER_S backstop, 20 s here).
STALL_S = 120.0

#: A worker silent this long is dead, in the soak (3 s in the other tests): on a busy machine a
#: live worker's heartbeat thread can be starved past 3 s, and the poller would re-drive its
#: steps as if it had been killed (a re-execution no kill explains). A killed worker's steps
#: come back this much later.
HEARTBEAT_TTL_S = 10

#: The worker and poller environment per stack. On `rq`, REDISPATCH_AFTER_S is shortened: a step
#: a live worker dropped is re-driven only by that check, e.g. one handed to a worker thread
#: in-process whose result met a PostgreSQL deadlock, or one whose result PostgreSQL refused
#: through RQ's three immediate retries (the outage soak). (A job popped by a worker killed before
#: registering it no longer needs it: the claim book has the poller re-queue it.)
STACKS = {
    "db": {"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_ADMISSION": "db"},
    "rq": {"DURABLE_FLOW_TRANSPORT": "rq", "DURABLE_FLOW_ADMISSION": "redis", "DURABLE_FLOW_REDISPATCH_AFTER_S": "20"},
}


def clear_rq() -> None:
    """Remove RQ's keys from the test's Redis database (never database 0, never other keys)."""
    redis = django_rq.get_connection("durable")
    assert redis.connection_pool.connection_kwargs.get("db", 0) != 0, "tests never touch Redis database 0"
    delete_keys(redis, "rq:*")


class Fleet:
    """The soaked processes: workers and one poller, each killed and replaced at random."""

    def __init__(self, spawn: Callable[..., ManagedProcess], env: dict[str, str]) -> None:
        self._spawn = spawn
        self._env = env
        #: Every process the fleet started, the killed ones included: their logs explain a re-run.
        self.spawned: list[ManagedProcess] = []
        self.workers = [self._worker() for _ in range(WORKERS)]
        self.poller = self._poller()
        self.kills: list[Kill] = []

    def _worker(self) -> ManagedProcess:
        return self._started(self._spawn("durable_worker", "--concurrency", "4", env=self._env))

    def _poller(self) -> ManagedProcess:
        return self._started(self._spawn("durable_poller", env=self._env))

    def _started(self, process: ManagedProcess) -> ManagedProcess:
        self.spawned.append(process)
        return process

    def log_lines(self, *needles: str) -> list[str]:
        """The fleet's log lines holding any of `needles` (a run id, a worker name), each
        prefixed with its process's pid: the poller's re-drives and their reasons, a worker's
        outage or failed heartbeat."""
        return [
            f"[pid {process.proc.pid}] {line}"
            for process in self.spawned
            for line in process.output().splitlines()
            if any(needle in line for needle in needles)
        ]

    def names(self) -> dict[int, str]:
        """Each process's pid -> its worker id (from its start line), or "poller"."""
        names = {}
        for process in self.spawned:
            text = process.output()
            found = re.search(r"^durable_worker (\S+): transport=", text, re.MULTILINE)
            names[process.proc.pid] = found.group(1) if found else ("poller" if "durable_poller" in text else "?")
        return names

    def kill_one(self, rng: random.Random) -> None:
        """Once the whole fleet is up, SIGKILL a worker (or, one time in four, the poller) and
        start its replacement.

        Up means each process printed its start line (after Django's set-up, before its first
        claim). A boot takes a second or two on an idle machine and many on a busy one: killing
        before the last replacement is up would keep the fleet booting, a soak of start-ups rather
        than of work. So at most one process is down at a time, and a busy machine kills less often.
        """
        fleet = [*self.workers, self.poller]
        try:
            wait_for(lambda: all(up(process) for process in fleet), timeout=STALL_S, interval=0.2)
        except AssertionError:
            # Which process never came up, and what it printed: the verdict's evidence.
            silent = "\n".join(
                f"[pid {process.proc.pid}, exit {process.proc.poll()}] {process.output()[-2000:]!r}"
                for process in fleet
                if not up(process)
            )
            raise AssertionError(f"the soaked fleet did not start up within {STALL_S} s:\n{silent}") from None
        index = -1
        if rng.random() < 0.25:
            victim, role = self.poller, "poller"
        else:
            index = rng.randrange(len(self.workers))
            victim, role = self.workers[index], "worker"
        if index < 0:
            self.poller = self._poller()
        else:
            self.workers[index] = self._worker()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(30)
        self.kills.append(Kill(pid=victim.proc.pid, at=time.time(), role=role))

    def dead(self) -> list[ManagedProcess]:
        """The current workers and poller that have exited (none should, unless killed)."""
        return [process for process in [*self.workers, self.poller] if process.proc.poll() is not None]


#: The line a worker (`durable_worker <id>: transport=...`) or the poller prints once it serves.
STARTED = re.compile(r"^(durable_worker \S+: transport=|durable_poller: every )", re.MULTILINE)


def up(process: ManagedProcess) -> bool:
    """Whether a worker or poller has started serving (not merely logged, e.g. a start-up retry)."""
    return STARTED.search(process.output()) is not None


def unique(name: str) -> str:
    """Queue names are fresh per test: Redis state outlives the test database."""
    return f"soak-{name}-{uuid.uuid4().hex[:8]}"


def expected_output(n: int) -> int:
    for stage in (1, 2, 3):
        n = soak_value(n, stage)
    return n


@dataclass
class Workload:
    """`runs` three-step runs through a capped, a sliding-window and a fair queue (tenant 0 floods
    the fair queue with half of them), and the few the soak cancels on the way."""

    log: Path
    rng: random.Random
    runs: int = RUNS
    queues: tuple[str, str, str] = field(default_factory=lambda: (unique("capped"), unique("window"), unique("fair")))
    inputs: dict[str, int] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    to_cancel: list[str] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)
    _progress: tuple[int, float] = (0, 0.0)

    def env(self, stack: str) -> dict[str, str]:
        """The fleet's environment: the stack, the evidence log, quick maintenance passes."""
        return {
            **STACKS[stack],
            "DURABLE_FLOW_SOAK_LOG": str(self.log),
            "DURABLE_FLOW_MAINTENANCE_S": "1",
            "DURABLE_FLOW_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
            "DURABLE_FLOW_LOG": "WARNING",
        }

    def register_queues(self) -> None:
        capped, window, fair = self.queues
        register_queue(capped, concurrency=CAP, retry_ms=200)
        register_queue(window, rate_limit={"limit": WINDOW_LIMIT, "period_ms": WINDOW_MS, "algorithm": "sliding"})
        register_queue(fair, concurrency=FAIR_CAP, retry_ms=200, fairness="key")

    def submit(self) -> None:
        capped, window, fair = self.queues
        for i in range(self.runs):
            tenant = 0 if i % 2 == 0 else 1 + i % (TENANTS - 1)
            payload = {"n": i, "capped": capped, "window": window, "fair": fair, "tenant": f"t{tenant}", "ms": STEP_MS}
            self.inputs[start("tests.soak", payload).id] = i
        self.to_cancel = self.rng.sample(self.run_ids, max(2, self.runs // 25))

    @property
    def run_ids(self) -> list[str]:
        return list(self.inputs)

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def cancel_two(self) -> None:
        """Cancel the next two of the chosen runs (those already finished stay as they are)."""
        for run_id in self.to_cancel[:2]:
            if cancel(run_id).status in (RunStatus.CANCELLING, RunStatus.CANCELLED):
                self.cancelled.add(run_id)
        del self.to_cancel[:2]

    def terminal(self) -> int:
        return WorkflowRun.objects.filter(
            pk__in=self.run_ids, status__in=[RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
        ).count()

    def settled(self) -> bool:
        return self.terminal() == len(self.inputs)

    def stalled(self) -> bool:
        """True when no run has settled for STALL_S (the clock restarts at each settled run)."""
        count, now = self.terminal(), time.monotonic()
        if count > self._progress[0] or not self._progress[1]:
            self._progress = (count, now)
        return now - self._progress[1] > STALL_S

    def wait_settled(self, engine: Engine, seed: int) -> float:
        """Wait for every run to end, then every slot and waiter to drain; the time it took."""
        while not self.settled():
            if self.stalled():
                raise AssertionError(
                    f"no soak run settled for {STALL_S:.0f}s, {self._progress[0]} of {len(self.inputs)} settled "
                    f"(seed {seed})\n{stuck_report(engine, self.run_ids, self.queues)}"
                )
            time.sleep(0.5)
        for queue in self.queues:
            wait_for(
                lambda q=queue: engine.admission.in_flight(q) == 0 and engine.admission.waiting(q) == 0,
                timeout=STALL_S,
                what=f"{queue}'s slots and waiters to drain (seed {seed})",
            )
        return self.elapsed()

    def check(
        self,
        label: str,
        seed: int,
        kills: list[Kill],
        settled_s: float,
        capsys: Any,
        outages: list[Outage] | None = None,
        fleet: Fleet | None = None,
    ) -> None:
        """Print the counts, then assert each guarantee (see `test_soak.py`'s docstring)."""
        runs = {run.id: run for run in WorkflowRun.objects.filter(pk__in=self.run_ids)}
        lost = [r for r in self.run_ids if runs[r].status not in (RunStatus.COMPLETED, RunStatus.CANCELLED)]
        wrong = [
            r
            for r, run in runs.items()
            if run.status == RunStatus.COMPLETED and run.output != expected_output(self.inputs[r])
        ]
        uncancelled = [r for r in self.cancelled if runs[r].status != RunStatus.CANCELLED]
        unasked = [r for r, run in runs.items() if run.status == RunStatus.CANCELLED and r not in self.cancelled]
        leaked = StepCheckpoint.objects.filter(run_id__in=self.run_ids, holds_slot=True).count()

        evidence = read_evidence(self.log, kills, outages)
        extra = ""
        if outages is not None:
            redis_down = sum(o.what == "redis" for o in outages)
            extra = f"outages {redis_down} Redis, {len(outages) - redis_down} PostgreSQL, "
        unexplained = evidence.unexplained_reexecutions()
        cap_peak, fair_peak = max_overlap(evidence.intervals(1)), max_overlap(evidence.intervals(3))
        window_peak = busiest_window(evidence.starts(2), (WINDOW_MS - STAMP_SLACK_MS) / 1000)
        # The counts: a duplicate is a step re-run that no kill or outage explains, a
        # breach a limit (cap, fair cap, window) whose peak went over it.
        breaches = (cap_peak > CAP) + (fair_peak > FAIR_CAP) + (window_peak > WINDOW_LIMIT)
        with capsys.disabled():
            print(
                f"\nsoak[{label}/{connection.vendor}] seed {seed}: runs {self.runs}, kills {len(kills)} "
                f"({sum(k.role == 'poller' for k in kills)} poller), {extra}cancelled {len(self.cancelled)}, "
                f"time {settled_s:.1f}s, lost {len(lost)}, duplicates {len(unexplained)}, leaked {leaked}, "
                f"breaches {breaches}; wrong outputs {len(wrong)}, "
                f"re-executions {evidence.reexecutions()} (after an outage {evidence.outage_reexecutions()}), "
                f"cap peak {cap_peak}/{CAP}, fair peak {fair_peak}/{FAIR_CAP}, "
                f"window peak {window_peak}/{WINDOW_LIMIT}"
            )

        assert not lost, f"runs not completed nor cancelled (seed {seed}):\n" + "\n".join(
            f"  {r}: {runs[r].status} {runs[r].error} checkpoints "
            f"{list(StepCheckpoint.objects.filter(run_id=r).values_list('key', 'attempt', 'status', 'error'))}"
            for r in lost[:5]
        )
        assert not wrong, f"runs with a wrong output: {wrong[:10]}"
        assert not uncancelled and not unasked, (uncancelled, unasked)
        assert leaked == 0
        assert not unexplained, f"steps re-run with no kill or outage to explain it (seed {seed}):\n" + "\n".join(
            reexecution_report(evidence, run_id, stage, fleet) for run_id, stage in unexplained[:5]
        )
        assert cap_peak <= CAP and fair_peak <= FAIR_CAP, (cap_peak, fair_peak)
        assert window_peak <= WINDOW_LIMIT, window_peak


def reexecution_report(evidence: Evidence, run_id: str, stage: int, fleet: Fleet | None) -> str:
    """Everything that tells why a step ran more than once, for the failure message: each
    execution (its process, start and end), the run's attempts, the heartbeats of the workers
    that held them, and the fleet's log lines about the run and those workers (the poller logs
    each re-drive with its reason)."""
    names = fleet.names() if fleet else {}
    killed = evidence.killed_pids
    lines = [f"  {run_id} stage {stage}:"]
    for execution in evidence.by_step()[(run_id, stage)]:
        end = f"{execution.end:.6f}" if execution.end is not None else "never"
        death = f", killed at {killed[execution.pid]:.6f}" if execution.pid in killed else ""
        lines.append(
            f"    ran in pid {execution.pid} ({names.get(execution.pid, '?')}): "
            f"start {execution.start:.6f} end {end}{death}"
        )
    workers = set()
    for cp in StepCheckpoint.objects.filter(run_id=run_id).order_by("sequence"):
        lines.append(f"    checkpoint {cp.key}: {cp.status} attempt {cp.attempt} worker {cp.worker!r} queue {cp.queue}")
        workers.add(cp.worker)
        for row in StepAttempt.objects.filter(checkpoint=cp).order_by("attempt"):
            workers.add(row.worker)
            lines.append(
                f"      attempt {row.attempt} {row.status} worker {row.worker!r} dispatched {_at(row.dispatched_at)} "
                f"started {_at(row.started_at)} finished {_at(row.finished_at)} late {row.late}"
            )
    workers.discard("")
    for beat in WorkerHeartbeat.objects.filter(worker_id__in=workers).order_by("worker_id"):
        lines.append(
            f"    heartbeat {beat.worker_id}: pid {beat.pid} started {_at(beat.started_at)} "
            f"last seen {_at(beat.last_seen)} stopped {_at(beat.stopped_at)}"
        )
    if fleet is not None:
        # The run's re-drives, and what the processes involved logged (outages, failed beats).
        pids = {str(e.pid) for e in evidence.by_step()[(run_id, stage)]}
        involved = [p for p in fleet.spawned if str(p.proc.pid) in pids]
        lines += [f"    {line}" for line in fleet.log_lines(run_id)[:20]]
        # Which processes held the names involved (a name passes to a new process once its last lapses).
        lines += [f"    {line}" for line in fleet.log_lines(*(f"durable_worker {w}:" for w in sorted(workers)))]
        for process in involved:
            trouble = [line for line in process.output().splitlines() if any(word in line for word in TROUBLE)]
            lines += [f"    [pid {process.proc.pid}] {line}" for line in trouble[:20]]
    return "\n".join(lines)


#: What in an executing process's log may explain a re-run: an outage it rode out, a heartbeat
#: or an engine failure, a re-drive.
TROUBLE = ("unavailable", "service back", "heartbeat", "failed", "re-dispatched", "retrying", " ERROR ")


def _at(value: datetime | None) -> str:
    """An instant as epoch seconds, comparable with the evidence log's stamps."""
    return f"{value.timestamp():.6f}" if value is not None else "-"


def stuck_report(engine: Engine, run_ids: list[str], queues: tuple[str, ...]) -> str:
    """What the runs that did not settle are waiting on, for the failure message."""
    lines = [
        f"queue {q}: in_flight {engine.admission.in_flight(q)}, waiting {engine.admission.waiting(q)}" for q in queues
    ]
    stuck = WorkflowRun.objects.filter(pk__in=run_ids).exclude(
        status__in=[RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
    )
    lines.append(f"{stuck.count()} runs not settled; the first ten:")
    for run in stuck[:10]:
        lines.append(f"  {run.id} {run.status} wake_at={run.wake_at} turns={run.turns}")
        for cp in run.checkpoints.order_by("sequence"):
            lines.append(
                f"    {cp.key} {cp.status} attempt={cp.attempt} worker={cp.worker!r} slot={cp.holds_slot}"
                f" queue={cp.queue} dispatched_at={cp.dispatched_at} wake_at={cp.wake_at}"
            )
    return "\n".join(lines)
