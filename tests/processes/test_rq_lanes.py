"""The `rq` transport over two Redis servers: the test's database on the shared Redis (lane
`durable`: turns and every step but flow-control queue "far"'s) and a redis-server this test
starts on a free port (lane `durable-far`, `ROUTES = {"far": "durable-far"}`). Real
`durable_worker` processes, every step an RQ job (`EAGER_STEPS` off), so each step goes through
its lane.
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from redis import Redis
from rq.registry import FinishedJobRegistry
from rq.worker import Worker

from durable_flow import start
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint
from durable_flow.transports.rq import RQTransport
from durable_flow.transports.rq.common import NORMAL
from durable_flow.transports.rq.lanes import Lane
from tests.conftest import wait_for
from tests.support.own_redis import OwnRedis
from tests.support.rq import NO_EAGER_STEPS, live_heartbeat, marks, run_status, worker
from tests.support.workers import RQ_ENV, clear_rq

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]

FAR = "durable-far"


@pytest.fixture
def far_url(own_redis: OwnRedis) -> str:
    return own_redis.url(1)


@pytest.fixture
def lanes_engine(transactional_db: None, redis_conn: Redis, far_url: str, settings: Any) -> Iterator[Engine]:
    """This process on both lanes, as the workers are (settings.test reads DURABLE_FLOW_RQ_FAR_URL
    at import, so the far entry is added here instead)."""
    settings.RQ_QUEUES = {**settings.RQ_QUEUES, FAR: {"URL": far_url}}
    transport = RQTransport(queue="durable", concurrency=4, routes={"far": FAR}, eager_steps=False)
    engine = Engine(admission=LocalAdmissionBackend(), transport=transport, settings=get_settings())
    set_engine(engine)
    yield engine
    clear_rq(transport.lanes[FAR].connection)


def env(far_url: str) -> dict[str, str]:
    return {**NO_EAGER_STEPS, "DURABLE_FLOW_RQ_FAR_URL": far_url}


def lane(engine: Engine, name: str) -> Lane:
    transport = engine.transport
    assert isinstance(transport, RQTransport)
    return transport.lanes[name]


def finished_jobs(lane: Lane) -> list[Any]:
    """The jobs in the finished registries of the lane's tiers."""
    return [
        job
        for queue in lane.tiers.values()
        for job in queue.job_class.fetch_many(FinishedJobRegistry(queue=queue).get_job_ids(), queue.connection)
        if job
    ]


def finished_steps(lane: Lane) -> set[tuple[str, str, int]]:
    """(run id, step key, attempt) of every step job in the lane's finished registry."""
    jobs = finished_jobs(lane)
    return {(job.args[0], job.args[1], int(job.args[2])) for job in jobs if job.func_name.endswith("run_step_job")}


def finished_turn_count(lane: Lane) -> int:
    return sum(job.func_name.endswith("run_turn_job") for job in finished_jobs(lane))


def completed(run_id: str) -> bool:
    return run_status(run_id) == RunStatus.COMPLETED


def test_a_routed_queues_steps_run_on_its_redis_and_one_worker_serves_both(
    lanes_engine: Engine, spawn: Any, marker: Path, far_url: str
) -> None:
    served = worker(spawn, marker, "--concurrency", "4", env=env(far_url))
    far_runs = [start("tests.two_queued", {"queue": "far", "value": i}) for i in range(3)]
    near_runs = [start("tests.queued", {"queue": "near", "value": i}) for i in range(3)]
    for run in far_runs + near_runs:
        wait_for(lambda run=run: completed(run.id), timeout=120, what=f"run {run.id} completed")
    far, near = lane(lanes_engine, FAR), lane(lanes_engine, "durable")
    expected_far = {(run.id, key, 1) for run in far_runs for key in _step_keys(run.id)}
    assert len(expected_far) == 6
    wait_for(lambda: finished_steps(far) >= expected_far, timeout=30, what="RQ to file the far steps as finished")
    assert finished_steps(far) == expected_far, "only queue far's steps went to the far Redis"
    near_steps = wait_for(lambda: len(finished_steps(near)) == 3 and finished_steps(near), timeout=30, what="near")
    assert {run_id for run_id, _, _ in near_steps} == {run.id for run in near_runs}
    assert finished_turn_count(far) == 0 and finished_turn_count(near) >= 6, "turns stay on QUEUE's lane"
    # One process, registered as an RQ worker on both servers, each with that server's queues.
    worker_id = live_heartbeat(served).worker_id
    for each, queues in ((far, ["durable-far:high", "durable-far", "durable-far:low"]), (near, None)):
        (record,) = Worker.all(connection=each.connection)
        assert record.name == worker_id
        if queues:
            assert record.queue_names() == queues


def _step_keys(run_id: str) -> list[str]:
    return list(StepCheckpoint.objects.filter(run_id=run_id, kind="step").values_list("key", flat=True))


def test_an_idle_claim_is_woken_by_a_job_on_either_redis(lanes_engine: Engine, far_url: str) -> None:
    """The worker waits on both servers at once: a listener thread blocks on the far doorbell
    while the claim waits. Were the far bell not heard, the claim would time out (30 s) empty."""
    transport = lanes_engine.transport
    assert isinstance(transport, RQTransport)
    source = transport.source()
    assert source.several
    source.open(type("Runner", (), {"worker_id": "w-both", "heartbeat_ttl_s": 3.0})())  # type: ignore[arg-type]
    far = lane(lanes_engine, FAR)
    try:
        claimed: list[Any] = []
        waiting = threading.Thread(target=lambda: claimed.extend(source.claim("w-both", 4, 30.0)))
        waiting.start()
        wait_for(
            lambda: any(client.get("cmd") == "blpop" for client in far.connection.client_list()),
            timeout=10,
            what="a listener to block on the far doorbell",
        )
        with transaction.atomic():
            transport.enqueue_step_of_queue("far", "run-far", "step-1", 1, 0)
        waiting.join(60)
        assert [(task.kind, task.run_id, task.handle[1].name) for task in claimed] == [("step", "run-far", FAR)]
        assert far.connection.llen(far.claims.doorbell) == 0, "the bell was taken with its job"
        source.done("w-both", claimed[0])
    finally:
        source.close("w-both")


def test_killing_a_worker_re_drives_its_steps_on_both_redis(
    lanes_engine: Engine, spawn: Any, marker: Path, far_url: str, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    victim = worker(spawn, marker, "--concurrency", "4", env=env(far_url))
    runs = {
        where: start("tests.file_gated", {"path": str(gate), "id": where, "queue": where}) for where in ("far", "near")
    }
    wait_for(lambda: len(marks(marker, "file_gate")) == 2, timeout=120, what="both gated steps running")
    assert {pid for _, pid in marks(marker, "file_gate")} == {victim.proc.pid}
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    spawn("durable_poller", env={**RQ_ENV, **env(far_url)})
    survivor = worker(spawn, marker, "--concurrency", "4", env=env(far_url))
    wait_for(lambda: len(marks(marker, "file_gate")) == 4, timeout=180, what="both steps to run again")
    gate.touch()
    for run in runs.values():
        wait_for(lambda run=run: completed(run.id), timeout=60, what=f"run {run.id} completed")
    for where in ("far", "near"):
        assert [pid for value, pid in marks(marker, "file_gate") if value == where] == [
            victim.proc.pid,
            survivor.proc.pid,
        ]
    # The victim finished no job, so the job of the attempt that completed each step (its own job
    # handed back from the dead worker, or a new attempt's) was the survivor's, on its queue's lane.
    for where, lane_name in (("far", FAR), ("near", "durable")):
        cp = StepCheckpoint.objects.get(run=runs[where], kind="step")
        wait_for(
            lambda cp=cp, lane_name=lane_name: (
                (cp.run_id, cp.key, cp.attempt) in finished_steps(lane(lanes_engine, lane_name))
            ),
            timeout=30,
            what=f"attempt {cp.attempt} of the {where} step finished on its lane's Redis",
        )
    assert not any(run_id == runs["near"].id for run_id, _, _ in finished_steps(lane(lanes_engine, FAR)))


def test_with_one_redis_down_the_other_is_served_and_its_work_resumes_when_it_is_back(
    lanes_engine: Engine, spawn: Any, marker: Path, far_url: str, own_redis: OwnRedis
) -> None:
    """Jobs queued on the far Redis (kept in its append-only file) wait out its outage; the near
    lane is served all the while by a worker that started while the far one was down."""
    near_only = worker(spawn, marker, "--concurrency", "2", "--lane", "durable", env=env(far_url))
    far_runs = [start("tests.queued", {"queue": "far", "value": i}) for i in range(3)]
    far_queue = lane(lanes_engine, FAR).tiers[NORMAL]
    wait_for(lambda: far_queue.count == 3, timeout=120, what="the far steps queued, served by no worker")
    assert near_only.terminate() == 0
    own_redis.kill()

    both = worker(spawn, marker, "--concurrency", "2", env=env(far_url))
    near_runs = [start("tests.queued", {"queue": "near", "value": i}) for i in range(3)]
    for run in near_runs:
        wait_for(lambda run=run: completed(run.id), timeout=120, what="the near runs, with the far Redis down")
    assert not any(completed(run.id) for run in far_runs)
    assert both.proc.poll() is None, both.output()

    own_redis.start()
    for run in far_runs:
        wait_for(lambda run=run: completed(run.id), timeout=120, what="the far runs, once their Redis is back")
    assert both.proc.poll() is None, "the same process served both sides of the outage"
    log = both.output()
    where = f"rq on 127.0.0.1:{own_redis.port}/1"
    assert log.count(f"{where}: service unavailable") == 1, log
    assert log.count(f"{where}: service back") == 1, log


def test_the_backlog_counts_the_jobs_on_every_redis(lanes_engine: Engine, own_redis: OwnRedis) -> None:
    """`durable_flow_tasks_unclaimed` reads every lane; with one Redis unreadable it is left out
    of the scrape rather than shown short."""
    from durable_flow.observe.metrics import backlog

    transport = lanes_engine.transport
    with transaction.atomic():
        transport.enqueue_step_of_queue("far", "run-a", "s", 1, 5)  # high tier, far Redis
        transport.enqueue_step_of_queue("far", "run-b", "s", 1, 0)
        transport.enqueue_step_of_queue("near", "run-c", "s", 1, 0)  # QUEUE's lane
    assert lane(lanes_engine, FAR).tiers[NORMAL].count == 1
    assert backlog() == ("rq", 3)
    own_redis.kill()
    assert backlog() == ("rq", None)
    own_redis.start()  # its append-only file kept the jobs
    assert backlog() == ("rq", 3)
