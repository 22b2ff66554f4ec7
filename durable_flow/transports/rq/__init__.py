"""The `rq` transport: turns and step attempts as RQ jobs on Redis, through django-rq.

Configuration::

    RQ_QUEUES = {"durable": {"URL": "redis://127.0.0.1:6379/0"}}
    DURABLE_FLOW = {"TRANSPORT": {"BACKEND": "rq", "QUEUE": "durable", "CONCURRENCY": 8}}

The options are declared (and explained) in `RQTransport.OPTIONS`.

Producing. The engine calls `enqueue_*` inside the transaction that records a dispatch, so a
job is enqueued on `transaction.on_commit`: it never names a checkpoint that was rolled back.
A job carries ids only (`run_id`, `step_key`, `attempt`); the database stays the single
source of truth. The job functions `run_turn_job`/`run_step_job` are module-level, so a
plain `manage.py rqworker` can run them too; `durable_worker` is the intended consumer.

Priority mapping. RQ queues are FIFO lists with no per-job priority, so `priority` selects
one of three tiered queues next to the configured one::

    priority > 0  ->  "<QUEUE>:high"
    priority == 0 ->  "<QUEUE>"          (workflow turns go here; a task's first turn goes on
                                          the tier of the task's priority)
    priority < 0  ->  "<QUEUE>:low"

A worker pops from the first non-empty list of `[high, normal, low]` in one atomic script
(`claims`): strict priority between tiers, FIFO within a tier.
Three tiers keep the set of queue names fixed (operators can list them in `RQ_QUEUES` for the
django-rq dashboard) and cover "urgent", "normal", "background". Ordering *within* a tier by
the exact value is admission's job; the broker only needs to let urgent work overtake the backlog.

Lanes (`ROUTES`, `lanes`). `ROUTES = {"openai": "durable-llm"}` sends the steps of flow-control
queue `openai` to the `RQ_QUEUES` entry `durable-llm`, with its own three tiers, claim book and
doorbell on the Redis that entry names; turns and every other step stay on `QUEUE`. A worker
serves every lane (`source`), and recovery (`reclaim_from`) runs lane by lane on each one's Redis.

Consuming. `RQTransport.source()` is an `RQTaskSource` (`source`) for the shared
worker runtime: jobs run on threads under the live concurrency limit, with RQ's bookkeeping kept
the way a `SimpleWorker` keeps it.

Eager steps (`EAGER_STEPS`, on by default). The first step a turn dispatches runs next on the
worker thread that ran the turn, with no RQ job, as Temporal's eager activity execution hands a
workflow task's activity straight back to its worker: a one-step workflow is one job, not two,
and a step starts without a second trip through Redis. The step is durable all the same: its
dispatch and its `running` attempt are written in the turn's transaction, stamped with this
worker, so a worker that dies or stops mid-step leaves it to the poller, which re-drives it as a
new attempt once the worker's heartbeat says so (`engine/inline_handoff.py`). What it costs: the
step is in none of RQ's registries, a stopping worker cannot hand it back as a job, and it runs
in the process that ran its turn. The other steps of a fan-out go out as jobs. Off, every step is
an RQ job. (A step granted a freed slot runs on the releasing thread either way.)
With `OPTIMISTIC_FIRST_STEP` (on by default with `EAGER_STEPS`) a run's first plain step, on its
turn job's first delivery, runs before anything is written and is recorded with its result in one
transaction (`engine/optimistic.py`); a re-delivered turn job (its `started_at` already set)
takes the locked path.

Durability. Exactly-once results do not depend on RQ: `Engine.record_result` is keyed by
run/step/attempt and ignores a duplicate or stale attempt, and `execute_step` skips an attempt
that is no longer the dispatched one, so a retried or duplicated job records nothing twice.
A worker killed with SIGKILL loses nothing: `execute_step` stamps the checkpoint with this
worker's id, the worker's heartbeat lapses, and the poller re-dispatches its steps as a new
attempt. A job popped but not yet started when the worker died is re-queued by the poller as
soon as that worker's heartbeat lapses (`reclaim_from`: the dead worker's entries leave RQ's
`StartedJobRegistry`, and its booked but unregistered pops leave the claim book, for the head
of their queue); RQ's own started-registry cleanup and the `REDISPATCH_AFTER_S` re-dispatch
remain as backstops. There is no RQ job timeout: a thread
cannot be killed safely mid-transaction, and step timeouts are the engine's (the attempt is re-dispatched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from rq.executions import Execution, ExecutionRegistry
from rq.job import JobStatus, Retry, get_current_job
from rq.queue import Queue
from rq.registry import StartedJobRegistry

from durable_flow.config.options import Option, Validator, boolean, non_empty_str, number, optional
from durable_flow.config.settings import RoutesMisconfigured
from durable_flow.config.validation import MAX_DURATION_MS
from durable_flow.engine import get_engine
from durable_flow.store import metric_counts
from durable_flow.store.outage import transient_errors
from durable_flow.transports.base import CONCURRENCY_OPTION, Transport
from durable_flow.transports.rq.claims import ClaimBook
from durable_flow.transports.rq.common import HIGH, LOW, NORMAL, current_runner
from durable_flow.transports.rq.lanes import Lane, build_lane, configured_server
from durable_flow.transports.rq.source import RQTaskSource
from durable_flow.transports.runner import EngineRunner, TaskRunner

if TYPE_CHECKING:
    from redis import Redis

logger = logging.getLogger("durable_flow.transports.rq")

SETTING = 'DURABLE_FLOW["TRANSPORT"]'
#: RESULT_TTL / FAILURE_TTL: whole seconds up to ten years, -1 (forever) or None (RQ's).
_ttl: Validator = optional(number(-1, MAX_DURATION_MS // 1000, integer=True, unit="seconds, -1: forever"))


def _routes(value: Any) -> str | None:
    """ROUTES: a dict of flow-control queue names to RQ_QUEUES entry names, both non-empty strings."""
    if not isinstance(value, Mapping):
        return f"must be a dict of queue names to RQ_QUEUES entries, got {type(value).__name__}"
    for queue, entry in value.items():
        if problem := non_empty_str(queue):
            return f"a queue name {problem}"
        if problem := non_empty_str(entry):
            return f"[{queue!r}]: {problem}"
    return None


def lane_problem(queue: str, routes: Mapping[str, str], rq_queues: Mapping[str, Any]) -> RoutesMisconfigured | None:
    """What makes the lanes unusable, found from the settings alone: a route to an entry that is
    not in `RQ_QUEUES` (E040), or a lane whose name is another lane's tier (E042: both would
    use one Redis list)."""
    for flow_queue, entry in routes.items():
        if entry not in rq_queues:
            known = ", ".join(sorted(rq_queues)) or "none"
            return RoutesMisconfigured(
                f'{SETTING}["ROUTES"][{flow_queue!r}]: {entry!r} is not in settings.RQ_QUEUES (configured: {known})',
                "E040",
            )
    lanes = [queue, *routes.values()]
    for lane in lanes:
        for tier in (HIGH, LOW):
            if f"{lane}:{tier}" in lanes:
                return RoutesMisconfigured(
                    f"{SETTING}: {lane + ':' + tier!r} is a lane and also the {tier} tier of lane {lane!r}",
                    "E042",
                )
    return None


def lane_warnings(options: Mapping[str, Any], declared_queues: list[str]) -> list[tuple[str, str]]:
    """`manage.py check`'s findings on lanes that build but look wrong, as (check id, message):
    a route for a flow-control queue `DURABLE_FLOW["QUEUES"]` does not declare (W041: a
    misspelt name sends its steps to `QUEUE`'s Redis), a tier listed in `RQ_QUEUES` on another
    Redis than its lane (E043: one script pops all three tiers, on the lane's connection)."""
    from django_rq.settings import QUEUES

    found: list[tuple[str, str]] = []
    routes: Mapping[str, str] = options.get("ROUTES") or {}
    for flow_queue in routes:
        if flow_queue not in declared_queues:
            found.append(
                ("W041", f'{SETTING}["ROUTES"]: {flow_queue!r} is not a queue DURABLE_FLOW["QUEUES"] declares')
            )
    for lane in dict.fromkeys([options.get("QUEUE", "durable"), *routes.values()]):
        for tier in (HIGH, LOW):
            name = f"{lane}:{tier}"
            if name in QUEUES and configured_server(name) != configured_server(lane):
                found.append(
                    ("E043", f"settings.RQ_QUEUES[{name!r}] is on another Redis than {lane!r}, whose {tier} tier it is")
                )
    return found


def tier_for(priority: int) -> str:
    """The tier a step of this priority is queued on."""
    if priority > 0:
        return HIGH
    if priority < 0:
        return LOW
    return NORMAL


def _run(job: Callable[[TaskRunner], str]) -> str:
    """Run `job` on the worker running it: `durable_worker`'s runtime, else (a plain `rqworker`)
    this process's engine with no worker id. A plain `rqworker` has no heartbeat to write its
    metric counts on, and runs each job in a forked process that exits after it: the job writes
    them itself, under the RQ worker's name (stable across its jobs, so one row per series)."""
    runner = current_runner()
    if runner is not None:
        return job(runner)
    current = get_current_job()
    if current is not None and current.worker_name:
        metric_counts.set_process(f"rq:{current.worker_name}")
    try:
        return job(EngineRunner(get_engine()))
    finally:
        metric_counts.flush_quietly()


def run_turn_job(run_id: str) -> str:
    """RQ job: replay the run's next turn. Returns the run's status afterwards."""
    return _run(lambda runner: runner.run_turn(run_id))


def run_step_job(run_id: str, step_key: str, attempt: int) -> str:
    """RQ job: run one attempt of a step and record its result (exactly once per attempt).

    The worker id is set by `durable_worker`, whose heartbeat lets the poller re-drive the
    step if the worker dies. Under a foreign RQ worker it is empty, so a lost step is
    re-driven after `REDISPATCH_AFTER_S` instead.
    """
    return _run(lambda runner: runner.run_step(run_id, step_key, attempt))


class RQTransport(Transport):
    """Producer side: an RQ job per workflow turn and per step attempt sent out (not a step run
    eagerly on its turn's thread), enqueued on commit."""

    name = "rq"
    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "QUEUE": Option("The RQ_QUEUES entry whose connection, serializer and job class are used.", non_empty_str),
        "ROUTES": Option(
            "Flow-control queues whose steps go on another RQ_QUEUES entry (maybe on another Redis) than QUEUE: "
            "{queue name: RQ_QUEUES entry}. Turns and the steps of other queues stay on QUEUE.",
            _routes,
        ),
        "CONCURRENCY": CONCURRENCY_OPTION,
        "RESULT_TTL": Option("Seconds RQ keeps a finished job in its registry (-1: forever).", _ttl),
        "FAILURE_TTL": Option("Seconds RQ keeps a failed job in its registry (-1: forever).", _ttl),
        "EAGER_STEPS": Option(
            "Whether a step a turn dispatches runs next on the worker thread that ran the turn, with no "
            "RQ job (True, the default), or goes out as an RQ job like every other step (False).",
            boolean,
        ),
        "OPTIMISTIC_FIRST_STEP": Option(
            "Whether a run's first step, when it is a plain one (no queue, step concurrency, timeout or "
            "fan-out), runs before anything is written and is recorded with its result: one transaction "
            "a run fewer, the running step shown from its worker's heartbeat meanwhile, not from the run's "
            "rows (engine/optimistic.py). Needs EAGER_STEPS. Default: on with EAGER_STEPS.",
            boolean,
        ),
    }

    def __init__(
        self,
        queue: str = "durable",
        concurrency: object = 8,
        result_ttl: int | None = None,
        failure_ttl: int | None = None,
        eager_steps: bool = True,
        optimistic_first_step: bool | None = None,
        routes: Mapping[str, str] | None = None,
    ) -> None:
        from django_rq.settings import QUEUES

        if queue not in QUEUES:
            known = ", ".join(sorted(QUEUES)) or "none"
            raise ImproperlyConfigured(
                f'{SETTING}["QUEUE"]: {queue!r} is not in settings.RQ_QUEUES (configured: {known})'
            )
        for key, ttl in (("RESULT_TTL", result_ttl), ("FAILURE_TTL", failure_ttl)):
            if problem := _ttl(ttl):
                raise ImproperlyConfigured(f'{SETTING}["{key}"]: {problem}')
        if optimistic_first_step and not eager_steps:
            raise ImproperlyConfigured(
                f'{SETTING}["OPTIMISTIC_FIRST_STEP"]: needs EAGER_STEPS (the first step runs on its turn\'s thread)'
            )
        if optimistic_first_step is None:
            optimistic_first_step = eager_steps  # on by default, wherever it can be
        self.check_concurrency(concurrency)  # validate now, not at worker start
        self.routes = dict(routes or {})
        if problem := lane_problem(queue, self.routes, QUEUES):
            raise problem
        self.queue_name = queue
        self.concurrency = concurrency
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.eager_steps = eager_steps
        self.optimistic_first_step = optimistic_first_step

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """The declared checks, plus what the constructor checks (QUEUE names an RQ_QUEUES
        entry, the TTLs); building opens no connection."""
        super().check_options(options)
        cls(**{key.lower(): value for key, value in options.items()})

    @classmethod
    def deployment_problems(cls, options: Mapping[str, Any], declared_queues: list[str]) -> list[tuple[str, str]]:
        """Routes to undeclared queues (W041), tiers on another Redis than their lane (E043)."""
        return lane_warnings(options, declared_queues)

    # -- lanes -------------------------------------------------------------------------------
    @cached_property
    def lanes(self) -> dict[str, Lane]:
        """Every `RQ_QUEUES` entry this transport sends to, `QUEUE`'s first, built lazily (no
        Redis connection at import or engine build): its tiers, claim book and connection."""
        names = dict.fromkeys([self.queue_name, *self.routes.values()])
        return {name: build_lane(name) for name in names}

    def lane_for(self, queue: str) -> Lane:
        """The lane a step of flow-control queue `queue` goes on ("" or unrouted: `QUEUE`'s)."""
        return self.lanes[self.routes.get(queue, self.queue_name)]

    @property
    def tiers(self) -> Mapping[str, Queue]:
        """`QUEUE`'s three RQ queues (turns, and steps of unrouted queues)."""
        return self.lanes[self.queue_name].tiers

    @property
    def connection(self) -> Redis:
        return self.lanes[self.queue_name].connection

    @property
    def claims(self) -> ClaimBook:
        """`QUEUE`'s popped-but-unregistered jobs, and its doorbell (`claims`)."""
        return self.lanes[self.queue_name].claims

    def _result_ttl(self, lane: str) -> int | None:
        """RESULT_TTL, else the lane's DEFAULT_RESULT_TTL / RQ's (None: RQ's default)."""
        if self.result_ttl is not None:
            return self.result_ttl
        from django_rq.queues import get_result_ttl

        return get_result_ttl(lane)

    # -- producing ---------------------------------------------------------------------------
    def enqueue_turn(self, run_id: str) -> None:
        lane = self.lanes[self.queue_name]
        transaction.on_commit(partial(self._push, lane, NORMAL, run_turn_job, (run_id,), f"turn {run_id}"))

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        """A task's first turn goes on its priority's tier, as its step will: tasks that no queue
        holds back overtake the backlog by priority (tiers are coarse; admission orders within)."""
        lane = self.lanes[self.queue_name]
        description = f"turn {run_id} (priority {priority})"
        transaction.on_commit(partial(self._push, lane, tier_for(priority), run_turn_job, (run_id,), description))

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        self.enqueue_step_of_queue("", run_id, step_key, attempt, priority)

    def enqueue_step_of_queue(self, queue: str, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        """On the lane `ROUTES` gives `queue` (`QUEUE`'s if none), on its priority's tier."""
        lane = self.lane_for(queue)
        transaction.on_commit(
            partial(
                self._push,
                lane,
                tier_for(priority),
                run_step_job,
                (run_id, step_key, attempt),
                f"step {run_id}/{step_key} attempt {attempt} (priority {priority})",
            )
        )

    def _push(self, lane: Lane, tier: str, func: Any, args: tuple[Any, ...], description: str) -> None:
        queue = lane.tiers[tier]
        options: dict[str, Any] = {}
        if (result_ttl := self._result_ttl(lane.name)) is not None:
            options["result_ttl"] = result_ttl
        if self.failure_ttl is not None:
            options["failure_ttl"] = self.failure_ttl
        # No job timeout (timeout=-1): step timeouts are the engine's, and a worker thread
        # cannot be killed safely in the middle of a database transaction.
        # One MULTI: the job, then its bell (a worker woken by the bell finds the job).
        with lane.connection.pipeline() as pipeline:
            queue.enqueue_call(
                func, args=args, timeout=-1, retry=Retry(max=3), description=description, pipeline=pipeline, **options
            )
            lane.claims.ring(pipeline)
            pipeline.execute()

    def backlog(self) -> int:
        """Jobs waiting on every lane's tiers (not popped by a worker yet), over every Redis the
        lanes are on; raises if one cannot be read (a sum without it would look like fewer jobs)."""
        return sum(queue.count for lane in self.lanes.values() for queue in lane.tiers.values())

    # -- recovery ----------------------------------------------------------------------------
    def reclaim_from(self, dead_workers: list[str]) -> int:
        """Put the jobs that dead workers had popped back at the head of their queues now.

        The poller calls this once a worker's heartbeat lapsed. Without it a popped job sits in
        RQ's `StartedJobRegistry` until its execution expires and (for a step not yet stamped
        with a worker) until `REDISPATCH_AFTER_S`, holding its queue slot all that time; a job
        it popped but had not registered yet is in the claim book (`claims`). Each
        registry entry is taken with its own `ZREM`, each booked one by a script that checks its
        owner, so of several pollers exactly one re-queues it. A re-run is harmless: a turn
        replays, and a stale step attempt is skipped by the engine.

        Each lane is reclaimed on its own Redis. One that is down is skipped (logged) and the
        others are reclaimed; the poller asks again at its next maintenance while the worker is
        still listed dead, and RQ's own started-registry cleanup is the backstop. Raised only if
        every lane failed. Returns how many jobs were re-queued.
        """
        dead = set(dead_workers)
        if not dead:
            return 0
        reclaimed = booked = 0
        failed: list[BaseException] = []
        for lane in self.lanes.values():
            try:
                lane_booked, lane_registered = self._reclaim_lane(lane, dead)
            except transient_errors() as exc:
                if len(self.lanes) == 1:
                    raise
                logger.warning("could not reclaim dead workers' jobs on lane %r: %s", lane.name, exc)
                failed.append(exc)
                continue
            booked += lane_booked
            reclaimed += lane_booked + lane_registered
        if reclaimed:
            logger.warning("re-queued %d job(s) popped by dead worker(s), %d of them unregistered", reclaimed, booked)
        if failed and len(failed) == len(self.lanes):
            raise failed[0]
        return reclaimed

    @staticmethod
    def _reclaim_lane(lane: Lane, dead: set[str]) -> tuple[int, int]:
        """(booked, registered) jobs of `dead` workers re-queued on one lane."""
        booked = lane.claims.release_dead(dead)  # popped, killed before registering them
        registered = 0
        connection = lane.connection
        for queue in lane.tiers.values():
            registry = StartedJobRegistry(queue.name, connection=connection, job_class=queue.job_class)
            entries = registry.get_job_and_execution_ids()
            if not entries:
                continue
            executions = [Execution(id=exec_id, job_id=job_id, connection=connection) for job_id, exec_id in entries]
            with connection.pipeline(transaction=False) as pipeline:
                for execution in executions:
                    pipeline.hget(execution.key, "worker_name")
                owners = pipeline.execute()
            for execution, owner in zip(executions, owners, strict=True):
                if owner is None or owner.decode() not in dead:
                    continue  # a live worker's, or expired: RQ's own cleanup takes the latter
                if not connection.zrem(registry.key, execution.composite_key):
                    continue  # another poller took it first
                with connection.pipeline() as pipeline:
                    pipeline.delete(execution.key)
                    ExecutionRegistry(job_id=execution.job_id, connection=connection).remove(execution, pipeline)
                    pipeline.hset(queue.job_class.key_for(execution.job_id), "status", JobStatus.QUEUED.value)
                    queue.push_job_id(execution.job_id, pipeline=pipeline, at_front=True)
                    lane.claims.ring(pipeline)
                    pipeline.execute()
                registered += 1
        return booked, registered

    # -- consuming ---------------------------------------------------------------------------
    def source(self, lanes: Sequence[str] | None = None) -> RQTaskSource:
        """The consuming side, for `durable_worker`: every lane (on every Redis they are on), or
        only `lanes` (`durable_worker --lane`). An unknown lane name is `ImproperlyConfigured`."""
        if lanes is not None and (unknown := [name for name in lanes if name not in self.lanes]):
            raise ImproperlyConfigured(
                f"no lane {', '.join(map(repr, unknown))}: this transport's lanes are {', '.join(self.lanes)}"
            )
        return RQTaskSource(self, lanes=lanes)
