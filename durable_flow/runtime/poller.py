"""The timer poller: wakes parked runs whose `wake_at` is due, starts schedules' due ticks
(`durable_flow.runtime.schedules`), delivers events a dead sender left pending
(`durable_flow.runtime.events`), re-drives lost work, and keeps the hot tables vacuumed on
PostgreSQL (`durable_flow.runtime.vacuum`).

Each tick selects at most `BATCH_SIZE` due runs through the `(status, wake_at)` index, so its
cost follows the number of *due* runs, not of every parked one. Between ticks the poller sleeps
until the earliest `wake_at` still to come (read from the same index, `queries.next_wake`) or
for `INTERVAL_MS`, whichever comes first; a run parked meanwhile until sooner than that rings it
(`store.timer_bells`: PostgreSQL's `NOTIFY`, SQLite's doorbell) and it sleeps until that time
instead. So a sleep, a backoff or a timeout resumes at its `wake_at`, not at the next interval.
The rest of the pass (schedules, grants, maintenance, samples) keeps the interval's pace. Calls parked in a queue's
waiting line have no `wake_at`: grants dispatch them. The tick grants each queue's room as a
safety net (one backend call per queue, whatever the number of waiters), and the maintenance
pass re-offers the parked calls to the backend, for grants lost in a crash. On PostgreSQL the rows are
taken `FOR UPDATE SKIP LOCKED`, so several pollers can run at once and never wake the same
run twice; on SQLite the IMMEDIATE write transaction serialises them.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from datetime import datetime, timedelta
from typing import Any

from django.db import close_old_connections, connection, transaction
from django.db.models import QuerySet

from durable_flow.definitions.registry import step_concurrency_declared
from durable_flow.engine import Engine, get_engine, retry_on_conflict
from durable_flow.models import FlowQueue, RunStatus, WorkerHeartbeat, WorkflowRun, dead_worker_cutoff
from durable_flow.observe.sampling import Sampler
from durable_flow.runtime.events import EventDeliverer
from durable_flow.runtime.schedules import ScheduleTicker
from durable_flow.runtime.vacuum import VacuumPolicy, Vacuums
from durable_flow.store import metric_counts, queries, retention
from durable_flow.store.outage import Outage, transient_errors
from durable_flow.store.queries import AttemptStart
from durable_flow.store.quotas import prune_refusals
from durable_flow.store.timer_bells import TimerBell

logger = logging.getLogger("durable_flow.runtime.poller")
#: How long a stopping poller waits for a vacuum it started.
VACUUM_GRACE_S = 10.0
#: What the poller reads of a step it judges lost: which step, and the start it judged
#: (`queries.AttemptStart`: a re-drive goes ahead only while the step is still at it).
LOST_FIELDS = ("run_id", "key", "attempt", "worker", "started_at")


class TimerPoller:
    """Wakes due runs in batches; every few seconds also re-drives steps whose worker died."""

    def __init__(
        self,
        engine: Engine | None = None,
        batch_size: int | None = None,
        interval_ms: int | None = None,
        maintenance_every_s: float | None = None,
    ) -> None:
        self.engine = engine or get_engine()
        self.batch_size = batch_size or self.engine.settings.poller_batch_size
        self.interval_s = (interval_ms or self.engine.settings.poller_interval_ms) / 1000
        # DURABLE_FLOW["POLLER"]["MAINTENANCE_S"]: with the heartbeat TTL, it bounds how long a
        # dead worker's steps and popped jobs wait before they are re-driven.
        self.maintenance_every_s = maintenance_every_s or self.engine.settings.poller_maintenance_s
        self._stop = threading.Event()
        self._next_maintenance = 0.0
        # Until when (engine clock) no worker is judged dead: see `outage_seen`. None: judge now
        # (`maintain` called directly, as in tests and `--once`).
        self._judge_deaths_from: datetime | None = None
        self.sampler = Sampler(self.engine)
        self.schedules = ScheduleTicker(self.engine)
        self.events = EventDeliverer(self.engine)
        settings = self.engine.settings
        policy = VacuumPolicy(settings.vacuum_dead_rows, settings.vacuum_dead_fraction, settings.vacuum_min_interval_s)
        self.vacuums = Vacuums(policy)
        #: The engine-clock time of the last tick: what it found due was due by then.
        self.ticked_at: datetime | None = None
        # The sleep between ticks (`_sleep_until`): until `_planned` (on `time.monotonic`'s
        # scale), brought forward by a ring (`_rung`) for a run parked until sooner.
        self._plan_lock = threading.Lock()
        self._planned = math.inf
        self._rung_at = math.inf
        self._woken = threading.Event()
        self.bell = TimerBell(self._rung)

    @retry_on_conflict
    def tick(self) -> list[str]:
        """Wake one batch of due runs; return their ids."""
        now = self.ticked_at = self.engine.now()
        with transaction.atomic():
            due = queries.due_runs(now)
            if connection.features.has_select_for_update_skip_locked:
                due = due.select_for_update(skip_locked=True)
            run_ids = list(due.values_list("id", flat=True)[: self.batch_size])
            if not run_ids:
                return []
            WorkflowRun.objects.filter(id__in=run_ids).update(status=RunStatus.PENDING, wake_at=None, updated_at=now)
            for run_id in run_ids:
                self.engine.transport.enqueue_turn(run_id)
        return run_ids

    def grant_queues(self) -> int:
        """The safety net for grants: give each queue's room to its waiters (normally done at
        once by a release or the grant timer). Returns how many steps were dispatched."""
        granted = 0
        for name in FlowQueue.objects.filter(paused=False).values_list("name", flat=True):
            if self.engine.admission.handles(name):
                granted += self.engine.grant(name)
        if step_concurrency_declared():
            granted += self.engine.grant("")  # calls gated by step concurrency alone
        return granted

    def drain(self) -> int:
        """Tick until nothing is due (tests and `--once`)."""
        total = 0
        while woken := self.tick():
            total += len(woken)
        return total

    def outage_seen(self) -> None:
        """The poller starts, or its services fail or answer again (an outage it rides out):
        judge no worker dead for one heartbeat TTL from now.

        No worker could beat while the database was away, so every heartbeat may read as lapsed
        though its worker lives and still runs its steps; re-driving those would run each a
        second time beside the first (past its queue's cap). A worker that has still not beaten
        a TTL after the database came back is dead. At start too: this poller cannot know how
        long the database was gone before it (a supervisor restarts a poller after an outage).
        """
        self._judge_deaths_from = self.engine.now() + timedelta(seconds=self.engine.settings.heartbeat_ttl_s)

    def maintain(self) -> int:
        """Re-dispatch steps lost with their worker, and re-queue turns a broker lost."""
        settings = self.engine.settings
        now = self.engine.now()
        dead_cutoff = dead_worker_cutoff(settings.heartbeat_ttl_s, now)
        dead_workers = queries.dead_workers(dead_cutoff)
        if self._judge_deaths_from is not None and now < self._judge_deaths_from:
            dead_workers = dead_workers.none()  # an outage just ended: see `outage_seen`
        lost_after = now - timedelta(seconds=settings.redispatch_after_s)
        redriven = 0
        for run_id, lost in self._lost_steps(now, dead_workers, dead_cutoff, lost_after).items():
            # Each step only while it is still at the start judged lost: a live worker may have
            # taken it up since (`Dispatcher.redispatch_pending`'s `seen`).
            redrive = self.engine.redispatch_pending
            done = [key for key, (start, _) in lost.items() if redrive(run_id, seen={key: start})]
            if done:
                # One line a run: a step re-driven runs again, which an operator wants to know, and why.
                detail = "; ".join(f"step {key!r} {lost[key][1]}" for key in done)
                logger.warning("run %s: re-dispatched %d step(s): %s", run_id, len(done), detail)
            redriven += len(done)
        # Parked calls whose grant was lost (the granting process died before dispatching) or
        # whose place in line was lost (with a process, or with Redis) are offered again.
        for name in FlowQueue.objects.values_list("name", flat=True):
            if self.engine.admission.handles(name):
                redriven += self.engine.reoffer_waiting(name)
        if step_concurrency_declared():
            redriven += self.engine.reoffer_waiting("")  # calls gated by step concurrency alone
        # Tasks a dead worker had claimed become claimable now, not when their lease lapses.
        # After the re-dispatch above, so a re-claimed old attempt is already stale and skipped.
        self.engine.transport.reclaim_from(list(dead_workers.values_list("worker_id", flat=True)))
        # A cancelled run waits for its executing steps' results; one past its deadline will not
        # be re-dispatched for a cancelled run, so it is settled as cancelled here instead.
        overdue = queries.overdue_cancelled_steps(now).values_list("run_id", "key", "attempt")
        for run_id, key, attempt in list(overdue[: self.batch_size]):
            self.engine.record_result(run_id, key, attempt, cancelled=True)
        # A run whose first step a live worker runs optimistically reads pending, untouched since
        # it started: its turn is not lost, and a turn sent again would run the step twice.
        executing = {step.run_id for step in queries.running_steps(dead_cutoff)}
        stale = queries.stale_pending_runs(lost_after, executing)
        stale_ids = list(stale.values_list("id", flat=True)[: self.batch_size])
        if stale_ids:
            with transaction.atomic():
                # Touched, so each is re-sent once per REDISPATCH_AFTER_S, not on every pass.
                WorkflowRun.objects.filter(id__in=stale_ids, status=RunStatus.PENDING).update(updated_at=now)
                for run_id in stale_ids:
                    self.engine.transport.enqueue_turn(run_id)
        # The quota page's history of refused starts: rows past POLLER["REFUSAL_RETENTION_S"],
        # a few bounded batches per pass.
        prune_refusals(settings.refusal_retention_s, now)
        # Finished runs past their retention: a few short batches per pass (store/retention.py).
        purged = retention.purge_pass(settings, now)
        if purged.runs:
            logger.info(
                "retention deleted %d finished run(s) (%d row(s)) in %d batch(es), longest transaction %.0f ms",
                purged.runs,
                sum(purged.rows.values()),
                purged.batches,
                purged.longest_transaction_s * 1000,
            )
        metric_counts.flush()  # this process's counts (runs it finished, attempts it settled)
        metric_counts.retire(now)  # fold the metric rows of processes long gone
        # The hot tables' dead rows (PostgreSQL): a vacuum on a thread of its own when one passes
        # POLLER["VACUUM_DEAD_ROWS"] (durable_flow/runtime/vacuum.py).
        self.vacuums.maybe_vacuum()
        return redriven

    def _lost_steps(
        self, now: datetime, dead_workers: QuerySet[WorkerHeartbeat], dead_cutoff: datetime, lost_after: datetime
    ) -> dict[str, dict[str, tuple[AttemptStart, str]]]:
        """The in-flight steps to re-drive, by run and key, each with the start judged lost and
        why (for the log): its worker is dead, no worker took it, a live worker dropped it, or an
        earlier process of its worker's name ran it."""
        lost_by_run: dict[str, dict[str, tuple[AttemptStart, str]]] = {}
        dead = {
            worker: (seen, stopped, pid)
            for worker, seen, stopped, pid in dead_workers.values_list("worker_id", "last_seen", "stopped_at", "pid")
        }
        lost = queries.lost_steps(dead_workers, lost_after)
        for run_id, key, attempt, worker, started_at in lost.values_list(*LOST_FIELDS)[: self.batch_size]:
            if not worker:
                reason = "no worker took it in REDISPATCH_AFTER_S"
            elif worker in dead and dead[worker][1] is not None:
                reason = f"its worker {worker} (pid {dead[worker][2]}) stopped"
            else:
                seen, _, pid = dead.get(worker, (None, None, None))
                silent = f"last seen at {seen}, {(now - seen).total_seconds():.1f}s ago" if seen else "silent"
                reason = f"its worker {worker} (pid {pid}) is dead: {silent}"
            lost_by_run.setdefault(run_id, {})[key] = (
                AttemptStart(attempt, worker, started_at),
                f"(attempt {attempt}): {reason}",
            )
        for run_id, key, attempt, worker, started_at in self._dropped_by_live_workers(dead_cutoff, lost_after):
            lost_by_run.setdefault(run_id, {})[key] = (
                AttemptStart(attempt, worker, started_at),
                f"(attempt {attempt}): its live worker {worker} no longer runs it (dispatched REDISPATCH_AFTER_S ago)",
            )
        # A worker restarted under its name: what its previous process ran is lost with it.
        earlier = queries.steps_of_earlier_processes(queries.live_workers(dead_cutoff))
        for run_id, key, attempt, worker, started_at, began in earlier.values_list(*LOST_FIELDS, "process_began")[
            : self.batch_size
        ]:
            lost_by_run.setdefault(run_id, {})[key] = (
                AttemptStart(attempt, worker, started_at),
                f"(attempt {attempt}): started at {started_at} by an earlier process of {worker}, "
                f"whose current process began at {began}",
            )
        return lost_by_run

    def _dropped_by_live_workers(
        self, dead_cutoff: datetime, lost_after: datetime
    ) -> list[tuple[str, str, int, str, datetime]]:
        """Steps dispatched long ago to a worker that is alive but not executing them (it gave
        up on the job, e.g. after the database refused its result): re-drive those too."""
        old = queries.stale_dispatched_steps(lost_after)
        candidates = list(old.values_list(*LOST_FIELDS)[: self.batch_size])
        if not candidates:
            return []
        live = queries.live_workers(dead_cutoff).filter(worker_id__in={c[3] for c in candidates})
        beats: dict[str, tuple[datetime, set[str]]] = {
            worker: (seen, set(tasks)) for worker, seen, tasks in live.values_list("worker_id", "last_seen", "running")
        }
        # A step dispatched long ago may have been taken only now (it sat in the broker through
        # an outage, or its worker waits for the rate window): a beat from before the worker
        # started it cannot list it. Judged on the worker's next beat instead (its `last_seen` is
        # read before the list, `WorkerRuntime._beat`).
        return [
            (run_id, key, attempt, worker, started_at)
            for run_id, key, attempt, worker, started_at in candidates
            if worker in beats and beats[worker][0] > started_at and f"{run_id}/{key}/{attempt}" not in beats[worker][1]
        ]

    def request_stop(self, *_: Any) -> None:
        self._stop.set()
        self._woken.set()

    # -- sleeping until the next wake-up ---------------------------------------------------------
    def _in_monotonic(self, when: datetime | float) -> float:
        """`when` (engine clock: a datetime, or a Unix timestamp) on `time.monotonic`'s scale."""
        at = when.timestamp() if isinstance(when, datetime) else when
        return time.monotonic() + (at - self.engine.now().timestamp())

    def _rung(self, when: float) -> None:
        """A run was parked until `when` (a Unix timestamp; 0.0: look now): wake the sleep if
        that is sooner than planned. Called from the bell's thread."""
        at = self._in_monotonic(when)
        with self._plan_lock:
            self._rung_at = min(self._rung_at, at)
            if at < self._planned:
                self._woken.set()

    def _open_plan(self) -> None:
        """Before a tick: every ring from now on is kept for the next sleep (`_rung_at`), and
        wakes the sleep (it may come before the plan is read)."""
        with self._plan_lock:
            self._planned = math.inf
            self._rung_at = math.inf
            self._woken.clear()

    def next_wake(self, next_pass: float) -> float:
        """When to tick next (`time.monotonic`'s scale): the earliest `wake_at` after the last
        tick (`queries.next_wake`), or `next_pass` (the interval's next full pass) if that
        comes first."""
        upcoming = queries.next_wake(self.ticked_at) if self.ticked_at is not None else None
        return next_pass if upcoming is None else min(next_pass, self._in_monotonic(upcoming))

    def _sleep_until(self, planned: float) -> None:
        """Sleep until `planned`, or until a ring's time sooner than that, or a stop."""
        with self._plan_lock:
            self._planned = planned
        while not self._stop.is_set():
            with self._plan_lock:
                self._planned = min(self._planned, self._rung_at)
                target = self._planned
                self._woken.clear()
            left = target - time.monotonic()
            if left <= 0:
                return
            self._woken.wait(left)

    def run_forever(self) -> None:
        """Poll until SIGTERM/SIGINT: tick, then sleep until the next `wake_at` or the interval's
        next full pass; a tick that found a full batch loops without sleeping."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        outage = Outage("poller", logger)
        transient = transient_errors()
        while not self._stop.is_set():  # the database may be down at start-up too
            try:
                self.engine.persist_queues()
            except transient as exc:
                close_old_connections()
                self._stop.wait(outage.failed(exc))
                continue
            break
        self.outage_seen()
        self.engine.grant_timer.start()
        self.bell.start()
        next_pass = 0.0  # `time.monotonic`'s scale: the first loop takes the whole pass
        try:
            while not self._stop.is_set():
                self._open_plan()
                try:
                    woken = self.tick()
                    if time.monotonic() >= next_pass:
                        self.schedules.tick()  # declared schedules' due ticks (durable_flow/runtime/schedules.py)
                        self.events.sweep()  # events a dead sender left pending (durable_flow/runtime/events.py)
                        self.grant_queues()
                        if time.monotonic() >= self._next_maintenance:
                            self.maintain()
                            self._next_maintenance = time.monotonic() + self.maintenance_every_s
                        self.sampler.maybe_sample()  # the dashboard's history (durable_flow/observe/sampling.py)
                        next_pass = time.monotonic() + self.interval_s
                    planned = self.next_wake(next_pass) if len(woken) < self.batch_size else -math.inf
                except transient as exc:
                    # Database or broker down: back off (logged once per outage) and carry on.
                    self.outage_seen()  # so the first pass that succeeds judges no death either
                    close_old_connections()
                    self._stop.wait(outage.failed(exc))
                    continue
                except Exception:
                    logger.exception("poller tick failed; retrying")
                    planned = time.monotonic() + self.interval_s
                else:
                    if outage.ongoing:
                        self.outage_seen()  # the TTL counts from the services' return
                    outage.recovered()
                self._sleep_until(planned)
        finally:
            self.bell.stop()
        metric_counts.flush_quietly()  # a graceful stop loses no count
        # A vacuum under way gets a moment to end; past it, the process exits and the server
        # cancels the vacuum (nothing is lost: the next one starts over).
        self.vacuums.wait(VACUUM_GRACE_S)
