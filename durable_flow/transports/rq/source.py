"""The consuming side of the `rq` transport: what `durable_worker` serves when
`DURABLE_FLOW["TRANSPORT"]["BACKEND"]` is `rq` (the producing side is the package's `__init__`).

The worker runs jobs on threads under the live concurrency limit, never forks (a fork costs
more than a typical step), and keeps RQ's bookkeeping the way a `SimpleWorker` would: the
worker is registered (and heartbeats) in RQ's worker registry, a claimed job gets an
`Execution` in the queue's `StartedJobRegistry`, and ends in the `FinishedJobRegistry` (with its
outcome as the job result) or the `FailedJobRegistry`. Claiming pops at most as many jobs as
there are free slots, so nothing waits in a local buffer.

A pop is booked for this worker in the same atomic script, and struck from the book in the MULTI
that registers the jobs in the started registry, so a worker killed in between loses nothing
(`claims`); an idle worker blocks on the doorbell, not on the tier lists.

Several Redis servers (`lanes`: `ROUTES` sends some flow-control queues' steps to `RQ_QUEUES`
entries on other servers). The worker serves every lane: it is registered as an RQ worker on
each server (with that server's queues), pops the lanes in turn, starting from a different one
at each claim so no lane starves another, and settles each job on the server it came from. An
idle worker waits on all of them at once: on one server with one `BLPOP` over every lane's
doorbell, across servers through a listener thread per server (`bells`). A server that fails
is skipped for a backoff (logged once when it goes, once when it is back) while the others are
served; with one server, its failure is the runtime's outage, as it always was.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.utils import now as rq_now
from rq.worker import SimpleWorker

from durable_flow.store.outage import Outage, transient_errors
from durable_flow.transports.rq.bells import Doorbells
from durable_flow.transports.rq.claims import Popped
from durable_flow.transports.rq.common import JOB_KINDS, running_as
from durable_flow.transports.rq.lanes import Lane, Server, describe
from durable_flow.transports.runner import ClaimedTask, SourceCapabilities, TaskRunner, TaskSource

if TYPE_CHECKING:
    from redis import Redis

logger = logging.getLogger("durable_flow.transports.rq")

#: How often a worker moves abandoned jobs out of RQ's started registries.
REGISTRY_CLEANUP_EVERY_S = 30.0


class RQProducer(Protocol):
    """What a source reads of its producer (`rq.RQTransport`): its lanes, and the options that
    decide where a turn's steps run."""

    @property
    def lanes(self) -> dict[str, Lane]: ...

    eager_steps: bool
    optimistic_first_step: bool


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(eq=False)
class ServedServer:
    """One Redis server this worker serves: its lanes, its RQ worker record, and its health."""

    key: Server
    lanes: list[Lane]
    outage: Outage
    worker: SimpleWorker | None = None
    next_cleanup: float = 0.0
    #: Claims skip this server until then (monotonic): it failed, and is given a backoff.
    down_until: float = 0.0
    #: Pops whose registration failed (Redis cut off in between): (lane, tier key, ids), given
    #: back before the next pop on this server. Only the worker loop claims, so no lock.
    unregistered: list[tuple[Lane, str, list[str]]] = field(default_factory=list)

    @property
    def connection(self) -> Redis:
        return self.lanes[0].connection

    @property
    def queues(self) -> list[Queue]:
        return [queue for lane in self.lanes for queue in lane.ordered]


class RQTaskSource(TaskSource):
    """Consumer side: pop jobs high → normal → low on each lane, keep RQ's registries and worker
    record on each lane's Redis."""

    transport = "rq"

    def __init__(
        self,
        transport: RQProducer,
        execution_ttl_s: int | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        lanes: Sequence[str] | None = None,
    ) -> None:
        self.rq = transport
        self._monotonic = monotonic
        self.capabilities = SourceCapabilities(
            turn_steps_inline=transport.eager_steps,
            optimistic_first_step=transport.optimistic_first_step,
            spreads_handoffs=True,
        )
        served = [transport.lanes[name] for name in lanes] if lanes is not None else list(transport.lanes.values())
        self.lanes = served
        self.ordered = [queue for lane in served for queue in lane.ordered]
        self.queues = [queue.name for queue in self.ordered]
        self._by_key = {queue.key: queue for queue in self.ordered}
        servers: dict[Server, ServedServer] = {}
        for lane in served:
            key = lane.server
            if key not in servers:
                servers[key] = ServedServer(key, [], Outage(f"rq on {describe(key)}", logger))
            servers[key].lanes.append(lane)
        self.servers = list(servers.values())
        self._server_of_lane = {lane.name: server for server in self.servers for lane in server.lanes}
        self.execution_ttl_s = execution_ttl_s
        #: The runner's id once `open` ran (a source used without it keeps no worker record).
        self._worker_id: str | None = None
        #: Where the next claim starts, so each lane is first in turn.
        self._turn = 0
        #: Lanes whose bell this thread took itself (one server: its own `BLPOP`).
        self._own_bells: set[str] = set()
        self._doorbells = Doorbells({s.key: s.lanes for s in self.servers}) if len(self.servers) > 1 else None
        self._transient = transient_errors()

    @property
    def several(self) -> bool:
        """Whether this worker serves more than one Redis server."""
        return len(self.servers) > 1

    # -- lifecycle (optional hooks of the runtime) ---------------------------------------------
    def open(self, runner: TaskRunner) -> None:
        """Register this process as an RQ worker on each server, so `rqinfo` and django-rq list
        it. A server that is down now is registered on when it is back (several servers)."""
        if self.execution_ttl_s is None:
            # Like RQ's job_monitoring_interval + 60: an abandoned execution expires this
            # long after its worker's last heartbeat.
            self.execution_ttl_s = math.ceil(runner.heartbeat_ttl_s) + 60
        self._worker_id = runner.worker_id
        self._each_server(self._register_worker, self.servers)
        self.outage_seen()  # this process cannot know how long Redis was away before it started
        if self._doorbells is not None:
            self._doorbells.start()

    def _register_worker(self, server: ServedServer) -> None:
        assert self._worker_id is not None, "open() first"
        queues = server.queues
        worker = SimpleWorker(
            queues,
            name=self._worker_id,
            connection=server.connection,
            job_class=queues[1].job_class,
            serializer=queues[1].serializer,
        )
        connection = server.connection
        if connection.exists(worker.key) and not connection.hexists(worker.key, "death"):
            # A crashed process of this name (a worker's name outlives its processes, and this
            # one took it only once that process's heartbeat lapsed): its record is stale.
            worker.register_death()
        worker.register_birth()
        worker.set_state("idle")
        server.worker = worker

    def outage_seen(self) -> None:
        """The worker starts, or its claims fail or succeed again (an outage it rides out): move
        no expired execution out of RQ's started registries for one execution TTL. While Redis
        was away no worker could extend its executions, so an expired one may be a live worker's
        whose job still runs, and RQ's cleanup would retry the job (a second run beside the
        first); a live worker extends its executions within a heartbeat of Redis's return."""
        for server in self.servers:
            self._server_outage_seen(server)

    def _server_outage_seen(self, server: ServedServer) -> None:
        ttl = self.execution_ttl_s if self.execution_ttl_s is not None else REGISTRY_CLEANUP_EVERY_S
        server.next_cleanup = self._monotonic() + ttl

    def close(self, worker_id: str) -> None:
        if self._doorbells is not None:
            self._doorbells.stop()

        def unregister(server: ServedServer) -> None:
            self._give_back(server, worker_id)  # else the poller gives them back once this worker is dead
            if server.worker is not None:
                server.worker.register_death()

        self._each_server(unregister, self.servers)

    def _each_server(self, action: Callable[[ServedServer], object], servers: list[ServedServer]) -> None:
        """Run `action` on each of `servers`. On one server its error is raised, as before there
        were several; on several, a server that fails is given a backoff and the others carry on,
        and the error is raised only if every server tried failed."""
        failed: list[BaseException] = []
        for server in servers:
            try:
                action(server)
            except self._transient as exc:
                if not self.several:
                    raise
                self._server_failed(server, exc)
                failed.append(exc)
            else:
                self._server_ok(server)
        if failed and len(failed) == len(servers):
            raise failed[0]

    def _server_failed(self, server: ServedServer, exc: BaseException) -> None:
        server.down_until = self._monotonic() + server.outage.failed(exc)
        self._server_outage_seen(server)

    def _server_ok(self, server: ServedServer) -> None:
        if server.outage.ongoing:
            self._server_outage_seen(server)  # the wait counts from the server's return
        server.outage.recovered()
        server.down_until = 0.0

    # -- claiming ------------------------------------------------------------------------------
    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        tasks = self._claim_once(worker_id, limit)
        if tasks or wait_s <= 0 or not self._wait(wait_s):
            return tasks
        return self._claim_once(worker_id, limit)

    def _wait(self, wait_s: float) -> bool:
        """Block until a bell rings on any lane (True) or `wait_s` passes (False)."""
        if self._doorbells is not None:
            return self._doorbells.wait(wait_s)
        (server,) = self.servers
        by_key = {lane.claims.doorbell: lane.name for lane in server.lanes}
        rung = server.connection.blpop(list(by_key), timeout=wait_s)
        if rung is None:
            return False
        self._own_bells.add(by_key[_text(rung[0])])
        return True

    def _bells_taken(self, lane: Lane) -> int:
        """The bell already taken for `lane` (by this thread or a listener), passed on to its pop."""
        if lane.name in self._own_bells:
            self._own_bells.discard(lane.name)
            return 1
        return self._doorbells.take(lane.name) if self._doorbells is not None else 0

    def _claim_once(self, worker_id: str, limit: int) -> list[ClaimedTask]:
        """Pop up to `limit` jobs over the lanes, starting at the next lane in turn."""
        tasks: list[ClaimedTask] = []
        now = self._monotonic()
        count = len(self.lanes)
        start, self._turn = self._turn, (self._turn + 1) % count
        order = [self.lanes[(start + offset) % count] for offset in range(count)]
        failed: set[int] = set()
        for lane in order:
            if len(tasks) >= limit:
                break
            server = self._server_of_lane[lane.name]
            if id(server) in failed or server.down_until > now:
                continue
            try:
                if server.worker is None and self._worker_id is not None:
                    self._register_worker(server)  # down when the worker started
                self._give_back(server, worker_id)
                tasks.extend(self._pop(worker_id, server, lane, limit - len(tasks)))
            except self._transient as exc:
                if not self.several:
                    raise
                failed.add(id(server))
                self._server_failed(server, exc)
            else:
                self._server_ok(server)
        return tasks

    def _give_back(self, server: ServedServer, worker_id: str) -> None:
        while server.unregistered:
            lane, tier_key, ids = server.unregistered[0]
            lane.claims.release_own(worker_id, tier_key, ids)  # raises while Redis is still away
            server.unregistered.pop(0)

    def _pop(self, worker_id: str, server: ServedServer, lane: Lane, limit: int) -> list[ClaimedTask]:
        popped = lane.claims.pop(worker_id, limit, bells_taken=self._bells_taken(lane))
        if popped is None:
            return []
        try:
            return self._register(worker_id, server, popped)
        except BaseException:
            server.unregistered.append((lane, popped.tier_key, popped.ids))
            raise

    def _register(self, worker_id: str, server: ServedServer, popped: Popped) -> list[ClaimedTask]:
        """Give popped jobs their `Execution`s in the started registry, and strike them from
        the claim book in the same MULTI."""
        queue = self._by_key[popped.tier_key]
        connection = queue.connection
        jobs = []
        for job_id, data in zip(popped.ids, popped.jobs, strict=True):
            if not data:
                continue  # deleted or expired while queued: RQ skips these too
            job = queue.job_class(job_id, connection=connection, serializer=queue.serializer)
            job.restore(data)
            jobs.append(job)
        tasks: list[ClaimedTask] = []
        assert self.execution_ttl_s is not None, "open() first"
        lane = next(lane for lane in server.lanes if popped.tier_key in lane.claims.tier_keys)
        with connection.pipeline() as pipeline:
            for job in jobs:
                # `started_at` is written by `prepare_for_execution`: already set on a job
                # re-queued from a dead or stopping worker, or retried after a failure.
                first_delivery = job.started_at is None
                execution = Execution.create(job, self.execution_ttl_s, pipeline=pipeline, worker_name=worker_id)
                job.prepare_for_execution(worker_id, pipeline=pipeline)
                tasks.append(self._task(job, queue, execution, server, first_delivery))
            lane.claims.strike(popped.ids, pipeline)
            pipeline.execute()
        return tasks

    @staticmethod
    def _task(
        job: Job, queue: Queue, execution: Execution, server: ServedServer, first_delivery: bool = False
    ) -> ClaimedTask:
        kind = JOB_KINDS.get(job.func_name, "rq")
        handle = (job, queue, execution, server)
        if kind == "turn":
            return ClaimedTask(kind="turn", run_id=str(job.args[0]), handle=handle, first_delivery=first_delivery)
        if kind == "step":
            run_id, step_key, attempt = job.args
            return ClaimedTask(kind="step", run_id=run_id, step_key=step_key, attempt=int(attempt), handle=handle)
        return ClaimedTask(kind="rq", run_id="", handle=handle)

    # -- running -------------------------------------------------------------------------------
    def execute(self, runner: TaskRunner, task: ClaimedTask) -> bool:
        """Run the job through RQ's `Job.perform` (so `rq.get_current_job()` works in a step),
        with this worker as the runner in scope for the job function."""
        job: Job = task.handle[0]
        with running_as(runner):
            outcome = job.perform()
        task.outcome = str(outcome) if task.kind != "rq" else "completed"
        return task.outcome not in ("failed",)

    def done(self, worker_id: str, task: ClaimedTask) -> None:
        """Finished: the job lands in the FinishedJobRegistry with its outcome as result."""
        job, queue, execution, server = task.handle
        job.ended_at = rq_now()
        result_ttl = job.get_result_ttl(server.worker.default_result_ttl if server.worker else 500)
        with queue.connection.pipeline() as pipeline:
            if result_ttl != 0:
                job._handle_success(
                    result_ttl,
                    pipeline=pipeline,
                    worker_name=worker_id,
                    execution_id=execution.id,
                    execution_started_at=execution.created_at,
                    execution_ended_at=job.ended_at,
                )
            job.cleanup(result_ttl, pipeline=pipeline, remove_from_queue=False)
            execution.delete(job=job, pipeline=pipeline)
            if server.worker is not None:
                server.worker.increment_successful_job_count(pipeline=pipeline)
            pipeline.execute()

    def failed(self, worker_id: str, task: ClaimedTask, exc: BaseException) -> None:
        """The engine could not record the outcome (database down?): retry the job while it has
        retries left, else park it in the FailedJobRegistry where django-rq can requeue it."""
        job, queue, execution, server = task.handle
        job.ended_at = rq_now()
        exc_string = "".join(traceback.format_exception(exc))
        with queue.connection.pipeline() as pipeline:
            execution.delete(job=job, pipeline=pipeline)
            if job.should_retry:
                job.retry(queue, pipeline)
            else:
                job.set_status(JobStatus.FAILED, pipeline=pipeline)
                job._handle_failure(
                    exc_string,
                    pipeline=pipeline,
                    worker_name=worker_id,
                    execution_id=execution.id,
                    execution_started_at=execution.created_at,
                    execution_ended_at=job.ended_at,
                )
            if server.worker is not None:
                server.worker.increment_failed_job_count(pipeline=pipeline)
            pipeline.execute()

    def hand_back(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        """Shutting down with work unfinished: put the jobs back at the front of their queues."""
        by_server = self._by_server(tasks)

        def push_back(server: ServedServer) -> None:
            with server.connection.pipeline() as pipeline:
                for task in by_server[id(server)]:
                    job, queue, execution, _server = task.handle
                    execution.delete(job=job, pipeline=pipeline)
                    job.set_status(JobStatus.QUEUED, pipeline=pipeline)
                    queue.push_job_id(job.id, pipeline=pipeline, at_front=True)
                    self._lane_of(queue).claims.ring(pipeline)
                pipeline.execute()

        self._each_server(push_back, [s for s in self.servers if id(s) in by_server])

    def renew(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        """Every heartbeat: keep this worker and its executions alive in RQ on each server, and
        now and then move executions abandoned by dead workers out of the started registries.
        Several servers: one that is down is skipped (its executions lapse if it stays away
        longer than their TTL, and its jobs are then retried like a dead worker's)."""
        assert self.execution_ttl_s is not None
        by_server = self._by_server(tasks)
        ttl = self.execution_ttl_s

        def beat(server: ServedServer) -> None:
            mine = by_server.get(id(server), [])
            with server.connection.pipeline() as pipeline:
                if server.worker is not None:
                    server.worker.heartbeat(ttl, pipeline=pipeline)
                    server.worker.set_state("busy" if mine else "idle", pipeline=pipeline)
                for task in mine:
                    _job, queue, execution, _server = task.handle
                    execution.heartbeat(queue.started_job_registry, ttl, pipeline=pipeline)
                pipeline.execute()
            now = self._monotonic()
            if now >= server.next_cleanup:
                server.next_cleanup = now + REGISTRY_CLEANUP_EVERY_S
                for queue in server.queues:
                    StartedJobRegistry(queue.name, connection=queue.connection, job_class=queue.job_class).cleanup()

        now = self._monotonic()
        live = [server for server in self.servers if server.down_until <= now or id(server) in by_server]
        self._each_server(beat, live)

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _by_server(tasks: list[ClaimedTask]) -> dict[int, list[ClaimedTask]]:
        grouped: dict[int, list[ClaimedTask]] = {}
        for task in tasks:
            grouped.setdefault(id(task.handle[3]), []).append(task)
        return grouped

    def _lane_of(self, queue: Queue) -> Lane:
        return next(lane for lane in self.lanes if queue.key in lane.claims.tier_keys)
