"""The worker loop: claim tasks from a transport's source, run them on a thread pool under
the controller's live limit, heartbeat, and shut down gracefully.

SIGTERM (or Ctrl-C) stops claiming, lets in-flight tasks finish for up to `grace_s`, and
hands the rest back to the transport (their leases are released, so another worker takes
them at once); a second SIGTERM hands back at once. SIGKILL loses nothing either: the
unfinished tasks' leases lapse and the poller re-dispatches steps whose worker's heartbeat
stopped.

The control loop is shared by every transport: the live limit comes from a
`ConcurrencyController` (fixed, or adaptive), which is fed each task's latency and outcome
and ticked every `tick_ms` with a resource sample; the heartbeat reports what it decided.

The runtime is the `TaskRunner` its source sees (`durable_flow/transports/runner.py`, the one
module transports know of the worker). A source may implement optional hooks: `open(runner)`/
`close(worker_id)` around the loop (RQ registers its worker record), `execute(runner, task) ->
bool` to run a task its own way (RQ goes through `Job.perform`), and `failed(worker_id, task,
exc)` when the engine could not record an outcome (RQ retries or parks the job; without the
hook the task is left to its lease). Which of the engine's fast paths the runtime takes is the
source's declared `capabilities`; a step the engine hands this process's thread
(`inline_handoff.HandedStep`) is run here next and never reaches the source.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import close_old_connections, connections
from django.utils import timezone

from durable_flow.engine import inline_handoff
from durable_flow.runtime.concurrency import ConcurrencyController
from durable_flow.runtime.heartbeat import Heartbeat, WorkerStats, new_worker_id
from durable_flow.store import counters, metric_counts
from durable_flow.store.outage import Outage, cluster_failover_errors, service_unreachable_errors, transient_errors
from durable_flow.store.queries import idle_peer_exists
from durable_flow.transports.runner import ClaimedTask, EngineRunner, SettlingHook, TaskSource

if TYPE_CHECKING:
    from durable_flow.engine import Engine

logger = logging.getLogger("durable_flow.worker")

#: How often (s) a task thread tidies its database connection (`close_old_connections`: drop it
#: past CONN_MAX_AGE, health-check it with `CONN_HEALTH_CHECKS`). Not before every task: the
#: check is a `SELECT 1` round trip, and a busy thread's connection was just used. A thread
#: whose last task failed is checked before its next task.
TIDY_EVERY_S = 1.0

#: How long (s) a worker thread rides out an admission backend out of reach under a turn
#: (`WorkerRuntime._execute_task`): long enough for a Redis Cluster master's failover, short
#: enough that a longer outage leaves the task to its source (the `rq` source's retries, the
#: `db` source's lease) rather than hold the thread.
TURN_OUTAGE_BUDGET_S = 60.0


class WorkerRuntime(EngineRunner):
    """One worker process: a thread pool, a controller, a heartbeat; the runner its source
    hands tasks to."""

    def __init__(
        self,
        engine: Engine,
        source: TaskSource,
        controller: ConcurrencyController,
        *,
        worker_id: str | None = None,
        grace_s: float = 30.0,
        idle_wait_s: float = 0.2,
    ) -> None:
        super().__init__(engine, worker_id or new_worker_id())
        self.source = source
        self.controller = controller
        self.grace_s = grace_s
        self.idle_wait_s = idle_wait_s
        self.stats = WorkerStats()
        self.heartbeat = Heartbeat(self.worker_id, source.transport, source.queues, self.stats, controller)
        self._stop = threading.Event()
        self._changed = threading.Condition()
        #: What this process runs: tasks claimed from the source, and steps the engine handed
        #: to a thread (`inline_handoff.HandedStep`: no transport holds them).
        self._running: dict[int, ClaimedTask | inline_handoff.HandedStep] = {}
        #: The step a turn runs before writing anything (`engine/optimistic.py`), by the turn's
        #: task, while it runs: listed as running in the heartbeat, the one place that shows it.
        self._optimistic_steps: dict[int, str] = {}
        self._running_lock = threading.Lock()
        self._handed_back: set[int] = set()
        #: Tasks handed back at shutdown whose threads were left running.
        self.abandoned = 0
        self._beat_outage = Outage(f"worker {self.worker_id} heartbeat", logger)
        #: What an admission backend raises out of reach: not a database error (a turn that
        #: meets the database down is left to its source).
        self._admission_unreachable = (*service_unreachable_errors(), *cluster_failover_errors())
        #: Waits out one backoff of a turn's admission outage; True if the worker is stopping.
        self._outage_wait: Callable[[float], bool] = self._stop.wait
        self._tidy = threading.local()
        self._handed = threading.local()  # the step a result's release handed to this thread
        #: Another worker of this transport ran nothing at its last heartbeat (read with ours,
        #: on a source whose capabilities include `spreads_handoffs`): see `_spreading`.
        self._peer_idle = False
        self._peer_idle_lock = threading.Lock()

    # -- control ---------------------------------------------------------------------------
    def request_stop(self, signum: int | None = None, *_: object) -> None:
        """Stop claiming; finish or hand back what is running."""
        if isinstance(signum, int):  # logged, so a stop by a supervisor is visible in the log
            logger.warning("worker %s: received %s: stopping", self.worker_id, signal.Signals(signum).name)
        if self._stop.is_set():
            logger.warning("second stop request: handing back in-flight tasks now")
            self.grace_s = 0
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    # -- the loop --------------------------------------------------------------------------
    def run(self, *, burst: bool = False, max_tasks: int | None = None) -> int:
        """Work until stopped (or, with `burst`, until no task is left). Returns tasks done."""
        heartbeat_every = self.engine.settings.heartbeat_interval_s
        next_beat = 0.0
        next_tick = time.monotonic() + self.controller.tick_ms / 1000
        outage = Outage(f"worker {self.worker_id} ({self.source.transport})", logger)
        transient = transient_errors()
        while not self._stop.is_set():  # Redis or the database may be down at start-up too
            try:
                self.source.open(self)
                self.heartbeat.beat()
            except transient as exc:
                close_old_connections()
                self._stop.wait(outage.failed(exc))
                continue
            outage.recovered()
            break
        pool = ThreadPoolExecutor(max_workers=self.controller.max_limit, thread_name_prefix="df-task")
        self.engine.grant_timer.start()  # grants room the instant a rate window reopens
        counters.start_background_writes()  # no counter UPDATE between a result and its handed step
        metric_counts.set_process(self.worker_id)  # this process's metric rows: flushed with each beat
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + heartbeat_every
                if now >= next_tick:
                    self._tick()
                    next_tick = now + self.controller.tick_ms / 1000
                if max_tasks is not None and self.stats.done >= max_tasks:
                    break
                free = self.controller.limit - self.stats.in_flight
                if max_tasks is not None:
                    free = min(free, max_tasks - self.stats.done - self.stats.in_flight)
                if free <= 0:
                    with self._changed:
                        self._changed.wait(0.05)
                    continue
                # Never block past the next heartbeat or tick.
                wait_s = max(0.0, min(self.idle_wait_s, next_beat - now, next_tick - now))
                try:
                    tasks = self.source.claim(self.worker_id, free, wait_s)
                except transient as exc:
                    # Broker or database down: keep the process (and its running tasks) alive,
                    # back off, and claim again when it returns. Nothing is lost: a job popped
                    # just before the error is in RQ's started registry or the source's claim book.
                    self.source.outage_seen()  # the claim that succeeds next judges no lease lapsed
                    close_old_connections()
                    self._stop.wait(outage.failed(exc))
                    continue
                if outage.ongoing:
                    self.source.outage_seen()  # the wait counts from the service's return
                outage.recovered()
                if not tasks:
                    if burst and self.stats.in_flight == 0:
                        break
                    continue
                for task in tasks:
                    self.stats.started()
                    with self._running_lock:
                        self._running[id(task)] = task
                    pool.submit(self._execute, task)
            self.abandoned = self._drain()
        finally:
            # Tasks handed back are abandoned to their threads: do not wait for them.
            pool.shutdown(wait=not self.abandoned, cancel_futures=True)
            counters.stop_background_writes()
            metric_counts.flush_quietly()  # a graceful stop loses no count
            try:
                self.heartbeat.beat(stopped=True)
            except Exception:  # the database is down at exit: the row's last_seen lapses instead
                logger.warning("could not record the stop in the heartbeat row", exc_info=True)
            try:
                self.source.close(self.worker_id)
            except Exception:  # the broker is down at exit: its record lapses on its own
                logger.warning("could not unregister from the %s transport", self.source.transport, exc_info=True)
            connections.close_all()
        return self.stats.done

    def _drain(self) -> int:
        """Wait up to `grace_s` for in-flight tasks (heartbeating meanwhile, so a long step is
        not declared lost), then hand back what is left; returns how many were handed back."""
        deadline = time.monotonic() + self.grace_s
        next_beat = time.monotonic() + self.engine.settings.heartbeat_interval_s
        while self.stats.in_flight > 0 and time.monotonic() < deadline:
            with self._changed:
                self._changed.wait(0.05)
            if time.monotonic() >= next_beat:
                self._beat()
                next_beat = time.monotonic() + self.engine.settings.heartbeat_interval_s
            deadline = min(deadline, time.monotonic() + self.grace_s)  # a second SIGTERM sets grace_s = 0
        with self._running_lock:
            unfinished = list(self._running.values())
            for task in unfinished:
                self._handed_back.add(id(task))
        # A step handed over in-process has no transport task to give back: it is stamped with
        # this worker, whose stopped heartbeat has the poller re-drive it.
        leftover = [task for task in unfinished if isinstance(task, ClaimedTask)]
        if leftover:
            logger.warning("handing back %d unfinished task(s)", len(leftover))
            self.source.hand_back(self.worker_id, leftover)
        return len(unfinished)

    def run_turn(self, run_id: str, *, in_settling_transaction: SettlingHook = None) -> str:
        """Run a turn; unless stopping, on a source that allows it
        (`SourceCapabilities.turn_steps_inline`), this thread accepts the first step the turn
        admits and runs it next (`engine/inline_handoff.py`): no step task, no second claim."""
        capabilities = self.source.capabilities
        if self._stop.is_set() or not capabilities.turn_steps_inline:
            return super().run_turn(run_id, in_settling_transaction=in_settling_transaction)
        task: ClaimedTask | None = getattr(self._handed, "task", None)
        if capabilities.optimistic_first_step and task is not None and task.first_delivery:
            try:
                status = self.engine.run_first_turn(
                    run_id,
                    self.worker_id,
                    on_step=partial(self._optimistic_steps.__setitem__, id(task)),
                    in_settling_transaction=in_settling_transaction,
                )
            finally:
                self._optimistic_steps.pop(id(task), None)
            if status is not None:
                return status
        with inline_handoff.accepting(self.worker_id, turns=True) as taken:
            try:
                return super().run_turn(run_id, in_settling_transaction=in_settling_transaction)
            finally:
                self._handed.steps = taken

    def run_step(
        self, run_id: str, step_key: str, attempt: int, *, in_settling_transaction: SettlingHook = None
    ) -> str:
        """Run a step attempt; unless stopping, this thread accepts the step its result's
        release is granted to, and runs it next (`engine/inline_handoff.py`)."""
        return self._run_step(run_id, step_key, attempt, in_settling_transaction=in_settling_transaction)

    def _run_step(
        self,
        run_id: str,
        step_key: str,
        attempt: int,
        *,
        in_settling_transaction: SettlingHook = None,
        dispatched: Any = None,
    ) -> str:
        def execute() -> str:
            return self.engine.execute_step(
                run_id,
                step_key,
                attempt,
                worker_id=self.worker_id,
                in_settling_transaction=in_settling_transaction,
                dispatched=dispatched,
            )

        if self._stop.is_set():
            return execute()
        if self._spreading():
            with self.source.sent_elsewhere():
                return execute()
        with inline_handoff.accepting(self.worker_id) as taken:
            try:
                return execute()
            finally:
                self._handed.steps = taken

    def _spreading(self) -> bool:
        """Whether this thread declines the step its result's release grants, sending it through
        the transport instead: while another step runs in this process and another worker was
        idle at the last heartbeat. A granted step stays on the thread that freed its slot, so
        without this every slot of a queue can end up in one process, its handoffs contending
        for one interpreter while the other processes idle: each handoff waits on the others'
        Python as well as its own (`bench/contention.py`'s cap-2 scenario shows it; figures in
        docs/benchmark-history.md). Once each process runs one, every handoff is inline again.

        One step per idle peer seen: the first thread to decline uses the sighting up, and the
        next heartbeat looks again. Otherwise two threads finishing together both decline, the
        idle process claims both, and the pair bounces between the processes, each bounce a
        wait for the next poll where nothing wakes a claimer (SQLite)."""
        with self._peer_idle_lock:
            if self._peer_idle and self.stats.in_flight > 1:
                self._peer_idle = False
                return True
            return False

    def _run_inline(self, step: inline_handoff.HandedStep) -> bool:
        """A step the engine handed to this thread (no transport task); True unless it failed."""
        outcome = self._run_step(step.run_id, step.step_key, step.attempt, dispatched=step.dispatched)
        return outcome != "failed"

    def _execute(self, task: ClaimedTask) -> None:
        """Run a claimed task, then each step the engine handed to this thread in turn."""
        current: ClaimedTask | inline_handoff.HandedStep | None = task
        while current is not None:
            self._execute_one(current)
            current = self._take_handed()

    def _execute_task(self, task: ClaimedTask) -> bool:
        """Run a claimed task through its source. A turn whose admission backend cannot be
        reached (a Redis Cluster master failing over) is run again with backoff, for up to
        `TURN_OUTAGE_BUDGET_S`, logged once per outage: the turn rolled back and its step has not
        run, and its source's own retry comes too soon for an election (the `rq` source retries
        a job at once, three times, then leaves it to `REDISPATCH_AFTER_S`). A step is not run
        again here: its code may have run."""
        if task.kind != "turn":
            return self.source.execute(self, task)
        outage = Outage(f"worker {self.worker_id}: admission under a turn of run {task.run_id}", logger)
        waited = 0.0
        while True:
            try:
                ok = self.source.execute(self, task)
            except self._admission_unreachable as exc:
                delay = outage.failed(exc)
                if waited + delay > TURN_OUTAGE_BUDGET_S or self._outage_wait(delay):
                    raise  # stopping, or out of budget: the source's retry takes over
                waited += delay
                continue
            outage.recovered()
            return ok

    def _take_handed(self) -> inline_handoff.HandedStep | None:
        steps: list[inline_handoff.HandedStep] = getattr(self._handed, "steps", None) or []
        self._handed.steps = None
        if not steps:
            return None
        step = steps[0]
        self.stats.started()
        with self._running_lock:
            self._running[id(step)] = step
        return step

    def _execute_one(self, task: ClaimedTask | inline_handoff.HandedStep) -> None:
        started = time.monotonic()
        ok = False
        inline = isinstance(task, inline_handoff.HandedStep)
        self._handed.steps = None
        self._handed.task = None if inline else task  # what `run_turn` is running (its delivery)
        try:
            self._tidy_connection()
            if isinstance(task, inline_handoff.HandedStep):
                ok = self._run_inline(task)
            else:
                ok = self._execute_task(task)
        except BaseException as exc:  # anything: the pool keeps it on a future nobody reads
            self._tidy.due = 0.0  # the connection may be broken: check it before the next task
            # The engine could not record the outcome (database down?). The source decides
            # (`failed`); by default the task stays leased and is re-claimed when its lease
            # lapses. Either way the step's result is idempotent.
            logger.exception("task %s failed in the engine", task)
            if isinstance(task, inline_handoff.HandedStep):
                self._resend_handed(task)
            elif id(task) not in self._handed_back:
                self._report(self.source.failed, task, exc)
        else:
            if id(task) not in self._handed_back and not inline:
                self._report(self.source.done, task)
        finally:
            with self._running_lock:
                self._running.pop(id(task), None)
            latency_ms = (time.monotonic() - started) * 1000
            self.stats.finished(latency_ms)
            self.controller.record(latency_ms, ok, "step" if inline else task.kind)
            with self._changed:
                self._changed.notify_all()

    def _resend_handed(self, step: inline_handoff.HandedStep) -> None:
        """A handed step the engine failed on (a deadlock, a dropped connection) has no transport
        task to be retried from, and its worker is alive, so the dead-worker pass never re-drives
        it: send it through the transport now, as a new attempt that keeps its slot (a result
        already recorded makes this a no-op). If that fails too (the database is down), the
        `REDISPATCH_AFTER_S` check is left to re-drive it."""
        try:
            if self.engine.redispatch_pending(step.run_id, keys=[step.step_key]):
                logger.warning(
                    "run %s: re-dispatched 1 step(s): step %r (attempt %d): worker %s failed to record it",
                    step.run_id,
                    step.step_key,
                    step.attempt,
                    self.worker_id,
                )
        except Exception:
            logger.exception("could not re-send handed step %s through the transport", step)

    def _tidy_connection(self) -> None:
        """`close_old_connections()` at most every `TIDY_EVERY_S` per thread (see there)."""
        now = time.monotonic()
        if getattr(self._tidy, "due", 0.0) <= now:
            close_old_connections()
            self._tidy.due = now + TIDY_EVERY_S

    def _report(self, hook: Any, task: ClaimedTask, *args: Any) -> None:
        try:
            hook(self.worker_id, task, *args)
        except Exception:
            logger.exception("could not report task %s to the %s transport", task, self.source.transport)

    def _beat(self) -> None:
        # The beat's time is read before the list: a task joins `_running` before its attempt's
        # start is stamped, so every attempt started by `seen_at` is listed unless it ended (the
        # poller judges a step dropped only by a beat newer than the attempt's start).
        seen_at = timezone.now()
        with self._running_lock:
            running = list(self._running.values())
        try:
            self.source.renew(self.worker_id, [task for task in running if isinstance(task, ClaimedTask)])
            self.heartbeat.beat(
                running=[step for task in running if (step := self._running_step(task))], seen_at=seen_at
            )
            metric_counts.flush()  # the counts since the last beat: a crash loses at most these
            if self.source.capabilities.spreads_handoffs:
                cutoff = timezone.now() - timedelta(seconds=2 * self.engine.settings.heartbeat_interval_s)
                idle = idle_peer_exists(self.worker_id, self.source.transport, cutoff)
                with self._peer_idle_lock:
                    self._peer_idle = idle
        except transient_errors() as exc:
            close_old_connections()
            self._beat_outage.failed(exc)  # logged once per outage; the next beat retries
        except Exception:
            logger.exception("heartbeat failed")
        else:
            self._beat_outage.recovered()

    def _running_step(self, task: ClaimedTask | inline_handoff.HandedStep) -> str:
        """`run_id/key/attempt` of the step a running task executes, or "" (a turn that runs
        none: a turn's optimistic first step is listed while it runs)."""
        if isinstance(task, inline_handoff.HandedStep) or task.kind == "step":
            return f"{task.run_id}/{task.step_key}/{task.attempt}"
        if step_key := self._optimistic_steps.get(id(task), ""):
            return f"{task.run_id}/{step_key}/1"
        return ""

    def _tick(self) -> None:
        adjustment = self.controller.tick(int(time.time() * 1000), self.heartbeat.sample())
        if adjustment is not None:
            logger.info("concurrency %d -> %d: %s", adjustment.old_limit, adjustment.new_limit, adjustment.reason)
