"""The `rq` transport end to end: real Redis, real `durable_worker` processes, no fakes.

Isolation: run with `REDIS_URL=redis://127.0.0.1:6379/14` (and `DURABLE_FLOW_TEST_ID=rq`);
each test starts from an empty RQ keyspace in that Redis database (only `rq:*` keys are
removed, never other databases).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from django.conf import settings
from redis import Redis
from rq import Retry
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.worker import SimpleWorker, Worker

from durable_flow import start
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import (
    MetricCount,
    RunStatus,
    StepCheckpoint,
    StepStatus,
    WorkerHeartbeat,
    WorkflowRun,
    dead_worker_cutoff,
)
from durable_flow.testing.clock import FakeMonotonic
from durable_flow.transports.rq import RQTransport, run_step_job, run_turn_job, tier_for
from durable_flow.transports.rq.common import HIGH, JOB_KINDS, LOW, NORMAL
from durable_flow.transports.rq.source import RQTaskSource
from tests.conftest import wait_for
from tests.support.rq import LOCKED, NO_EAGER_STEPS, OPTIMISTIC, live_heartbeat, marks, run_status, worker
from tests.support.workers import RQ_ENV

pytestmark = pytest.mark.django_db(transaction=True)


def finished_job_kinds(engine: Engine, *, at_least: int) -> list[str]:
    """The kinds of the jobs in RQ's finished registry, once it holds `at_least`: RQ files a job
    as finished after its function returned, so after the run's completion it committed."""
    queue = engine.transport.tiers[NORMAL]

    def kinds() -> list[str]:
        jobs = queue.job_class.fetch_many(FinishedJobRegistry(queue=queue).get_job_ids(), queue.connection)
        return sorted(job.func_name.rsplit(".", 1)[1] for job in jobs if job)

    wait_for(lambda: len(kinds()) >= at_least, timeout=30, what=f"RQ to file {at_least} job(s) as finished")
    return kinds()


def test_unknown_option_or_queue_is_improperly_configured(redis_conn: Redis) -> None:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match=r'\["TRANSPORT"\]: unknown option\(s\) QUEUES'):
        RQTransport.from_options({"QUEUES": "durable"})
    with pytest.raises(ImproperlyConfigured, match=r'\["QUEUE"\]: \'nope\' is not in settings.RQ_QUEUES'):
        RQTransport.from_options({"QUEUE": "nope"})
    with pytest.raises(ImproperlyConfigured, match=r'\["CONCURRENCY"\]'):
        RQTransport.from_options({"CONCURRENCY": 0})
    with pytest.raises(ImproperlyConfigured, match=r'\["EAGER_STEPS"\]: must be True or False'):
        RQTransport.from_options({"EAGER_STEPS": "False"})
    with pytest.raises(ImproperlyConfigured, match=r'\["CONCURRENCY"\]\["max"\]'):
        RQTransport.from_options({"CONCURRENCY": {"mode": "adaptive", "min": 4, "max": 2}})
    with pytest.raises(ImproperlyConfigured, match=r'\["OPTIMISTIC_FIRST_STEP"\]: needs EAGER_STEPS'):
        RQTransport.from_options({"EAGER_STEPS": False, "OPTIMISTIC_FIRST_STEP": True})
    assert not RQTransport.from_options({"EAGER_STEPS": False}).optimistic_first_step  # off with it
    assert not RQTransport.from_options({"OPTIMISTIC_FIRST_STEP": False}).optimistic_first_step
    transport = RQTransport.from_options({"QUEUE": "durable", "CONCURRENCY": "adaptive"})
    assert transport.optimistic_first_step and transport.eager_steps  # the defaults
    assert [transport.tiers[t].name for t in (HIGH, NORMAL, LOW)] == ["durable:high", "durable", "durable:low"]
    assert (tier_for(5), tier_for(0), tier_for(-1)) == (HIGH, NORMAL, LOW)


def test_the_job_kinds_name_the_job_functions_by_the_path_rq_stores() -> None:
    jobs = {"turn": run_turn_job, "step": run_step_job}
    assert JOB_KINDS == {f"{job.__module__}.{job.__qualname__}": kind for kind, job in jobs.items()}


def test_enqueue_waits_for_commit_and_rolls_back_with_the_transaction(rq_engine: Engine, redis_conn: Redis) -> None:
    from django.db import transaction

    queue = rq_engine.transport.tiers[NORMAL]
    with pytest.raises(RuntimeError), transaction.atomic():
        start("tests.three_steps", 1)
        assert queue.count == 0, "enqueued before commit"
        raise RuntimeError("roll back")
    assert queue.count == 0 and WorkflowRun.objects.count() == 0
    run = start("tests.three_steps", 1)
    assert queue.count == 1
    assert queue.jobs[0].func_name == "durable_flow.transports.rq.run_turn_job" and queue.jobs[0].args == (run.id,)


def test_a_plain_rq_worker_writes_its_metric_counts_after_each_job(rq_engine: Engine, redis_conn: Redis) -> None:
    """No heartbeat, a forked process per job: each job writes what it counted, under the RQ
    worker's name (one row per series however many jobs it runs)."""
    runs = [start("tests.three_steps", n) for n in (1, 2)]
    plain = SimpleWorker(list(rq_engine.transport.tiers.values()), connection=redis_conn)
    for _ in range(10):
        plain.work(burst=True)
        if all(run_status(run.id) == RunStatus.COMPLETED for run in runs):
            break
    rows = MetricCount.objects.filter(metric="durable_flow_runs_finished_total")
    assert list(rows.values_list("process", "value")) == [(f"rq:{plain.name}", 2.0)]
    assert set(MetricCount.objects.values_list("process", flat=True)) == {f"rq:{plain.name}"}


def test_a_tasks_first_turn_is_queued_on_its_prioritys_tier(rq_engine: Engine) -> None:
    """Tasks no queue holds back overtake the backlog by priority on `rq` too: a task's first
    turn goes on the tier of its priority (steps already do), workflow turns on the normal one."""
    from tests.task_functions import add

    urgent = add.using(priority=10).enqueue(1, 2)
    plain = add.enqueue(1, 2)
    background = add.using(priority=-10).enqueue(1, 2)
    tiers = rq_engine.transport.tiers
    queued = {tier: [job.args for job in tiers[tier].jobs] for tier in (HIGH, NORMAL, LOW)}
    assert queued == {HIGH: [(urgent.id,)], NORMAL: [(plain.id,)], LOW: [(background.id,)]}


def test_fan_of_40_steps_completes_across_three_workers(rq_engine: Engine, spawn, marker: Path) -> None:
    workers = [worker(spawn, marker, "--concurrency", "4") for _ in range(3)]
    wait_for(lambda: all(live_heartbeat(w) for w in workers), timeout=30, what="three workers up")
    run = start("tests.fan", {"n": 40})
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=40, what="fan completed")
    run.refresh_from_db()
    assert run.output == [2 * i for i in range(40)]
    doubles = marks(marker, "double")
    assert sorted(int(value) for value, _ in doubles) == list(range(40)), "each step ran exactly once"
    assert len({pid for _, pid in doubles}) >= 2, "the steps were spread over several workers"
    assert StepCheckpoint.objects.filter(run=run, status="completed", attempt=1).count() == 40
    # RQ's registries show the jobs the way django-rq users expect.
    queue = rq_engine.transport.tiers[NORMAL]
    finished = FinishedJobRegistry(queue=queue)
    # The first turn, and the 39 steps it did not run itself (EAGER_STEPS: one ran on its
    # thread); later turns ride on step results. (The last is filed after the run completed.)
    assert len(finished_job_kinds(rq_engine, at_least=40)) >= 40
    assert StartedJobRegistry(queue=queue).count == 0 and FailedJobRegistry(queue=queue).count == 0
    some_step = next(
        job for job in queue.job_class.fetch_many(finished.get_job_ids(), queue.connection) if job and job.args[1:]
    )
    assert some_step.return_value() == "completed"
    assert some_step.worker_name in {live_heartbeat(w).worker_id for w in workers}
    assert len(Worker.all(queue=queue)) == 3


def test_sigkill_mid_step_loses_nothing(rq_engine: Engine, spawn, marker: Path) -> None:
    """The locked path: the step was written as running, stamped with its worker. (An optimistic
    first step's kill: `test_over_rq_a_turn_redelivered_after_a_kill_takes_the_locked_path`.)"""
    # Named: a survivor starting past the TTL (a loaded machine) would take a default name back.
    victim = worker(spawn, marker, "--concurrency", "2", "--name", "victim", env=LOCKED)
    run = start("tests.slow_one", {"id": "k", "seconds": 2.0})
    wait_for(lambda: marks(marker, "slow_start"), timeout=30, what="the slow step to start")
    victim_id = live_heartbeat(victim).worker_id
    assert StepCheckpoint.objects.get(run=run).worker == victim_id
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    time.sleep(2.5)  # past the end the step would have had
    assert run_status(run.id) != RunStatus.COMPLETED and not marks(marker, "slow_end")

    survivor = worker(spawn, marker, "--concurrency", "2", env=LOCKED)
    spawn("durable_poller", env=RQ_ENV)
    # The poller re-queues the job once the killed worker's heartbeat is older than the TTL.
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=120, what="run completed after restart")
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.attempt == 2 and cp.status == "completed" and cp.worker == live_heartbeat(survivor).worker_id
    assert [pid for _, pid in marks(marker, "slow_start")] == [victim.proc.pid, survivor.proc.pid]
    assert [pid for _, pid in marks(marker, "slow_end")] == [survivor.proc.pid]
    # The killed worker's heartbeat row shows it dead once the TTL passed (it never said stopped).
    dead = WorkerHeartbeat.objects.get(worker_id=victim_id)
    assert dead.stopped_at is None and dead.last_seen < dead_worker_cutoff(get_settings().heartbeat_ttl_s)


def test_sigterm_lets_the_in_flight_step_finish(rq_engine: Engine, spawn, marker: Path) -> None:
    first = worker(spawn, marker, "--concurrency", "1")
    run = start("tests.slow_one", {"id": "t", "seconds": 1.5})
    wait_for(lambda: marks(marker, "slow_start"), timeout=30, what="the slow step to start")
    first_id = live_heartbeat(first).worker_id
    assert first.terminate(timeout=20) == 0
    assert [pid for _, pid in marks(marker, "slow_end")] == [first.proc.pid], "the step finished before exit"
    assert f"worker {first_id}: received SIGTERM: stopping" in first.output()  # why it stopped, in its log
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.status == "completed" and cp.attempt == 1
    beat = WorkerHeartbeat.objects.get(worker_id=first_id)
    assert beat.stopped_at is not None and beat.in_flight == 0
    assert first_id not in {w.name for w in Worker.all(queue=rq_engine.transport.tiers[NORMAL])}, "RQ: unregistered"
    # The run's next turn waits in Redis for the next worker; the step does not run again.
    worker(spawn, marker, "--concurrency", "1")
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=30, what="run completed")
    assert len(marks(marker, "slow_start")) == 1


@pytest.mark.parametrize("eager", [True, False], ids=["eager-steps", "every-step-a-job"])
def test_a_turns_step_runs_on_its_thread_unless_eager_steps_is_off(
    rq_engine: Engine, spawn, marker: Path, eager: bool
) -> None:
    """EAGER_STEPS (the default): the step a turn dispatches runs next on the turn's thread, so a
    one-step workflow is one RQ job; off, the step is an RQ job of its own."""
    runner = worker(spawn, marker, "--concurrency", "2", env=None if eager else NO_EAGER_STEPS)
    run = start("tests.slow_one", {"id": "e", "seconds": 0})
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=30, what="run completed")
    expected = ["run_turn_job"] if eager else ["run_step_job", "run_turn_job"]
    assert finished_job_kinds(rq_engine, at_least=len(expected)) == expected
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.status == "completed" and cp.attempt == 1 and cp.worker == live_heartbeat(runner).worker_id


def test_sigterm_past_the_grace_period_leaves_an_eager_step_to_the_poller(
    rq_engine: Engine, spawn, marker: Path
) -> None:
    """An eager step has no job to hand back: its checkpoint is stamped with the stopped worker,
    whose heartbeat says it stopped, and the poller re-drives it as a new attempt at once. (The
    locked path: an optimistic first step's turn job is handed back, the next test.)"""
    first = worker(spawn, marker, "--concurrency", "1", "--grace", "0.3", env=LOCKED)
    run = start("tests.slow_one", {"id": "g", "seconds": 8.0})
    wait_for(lambda: marks(marker, "slow_start"), timeout=30, what="the slow step to start")
    assert first.terminate(timeout=20) == 0
    assert not marks(marker, "slow_end"), "the worker waited for the step instead of leaving it"
    queue = rq_engine.transport.tiers[NORMAL]
    assert queue.count == 0 and StartedJobRegistry(queue=queue).count == 0, "no job was handed back"
    spawn("durable_poller", env=RQ_ENV)
    second = worker(spawn, marker, "--concurrency", "1", env=LOCKED)
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=40, what="run completed")
    assert [pid for _, pid in marks(marker, "slow_end")] == [second.proc.pid]
    assert StepCheckpoint.objects.get(run=run).attempt == 2


def test_sigterm_past_the_grace_period_hands_an_optimistic_first_steps_turn_back(
    rq_engine: Engine, spawn, marker: Path
) -> None:
    """Nothing of an optimistic first step is written while it runs: its turn job is what the
    stopping worker hands back, and the next worker, seeing the job was handed out before, takes
    the locked path (the step written as running first)."""
    first = worker(spawn, marker, "--concurrency", "1", "--grace", "0.3", env=OPTIMISTIC)
    run = start("tests.slow_one", {"id": "o", "seconds": 8.0})
    wait_for(lambda: marks(marker, "slow_start"), timeout=30, what="the slow step to start")
    assert not StepCheckpoint.objects.filter(run=run).exists()  # optimistic: nothing written yet
    assert first.terminate(timeout=20) == 0
    assert not marks(marker, "slow_end"), "the worker waited for the step instead of leaving it"
    queue = rq_engine.transport.tiers[NORMAL]
    assert queue.count == 1, "the turn job was not handed back"
    second = worker(spawn, marker, "--concurrency", "1", env=OPTIMISTIC)
    wait_for(lambda: StepCheckpoint.objects.filter(run=run).exists(), timeout=30, what="the step written first")
    assert StepCheckpoint.objects.get(run=run).worker == live_heartbeat(second).worker_id
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=40, what="run completed")
    assert [pid for _, pid in marks(marker, "slow_end")] == [second.proc.pid]
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.attempt == 1 and cp.status == "completed"


def test_sigterm_past_the_grace_period_hands_the_job_back(rq_engine: Engine, spawn, marker: Path) -> None:
    first = worker(spawn, marker, "--concurrency", "1", "--grace", "0.3", env=NO_EAGER_STEPS)
    run = start("tests.slow_one", {"id": "h", "seconds": 8.0})
    wait_for(lambda: marks(marker, "slow_start"), timeout=30, what="the slow step to start")
    assert first.terminate(timeout=20) == 0
    # The step's own end mark is the clock: the worker exited before the step could finish.
    assert not marks(marker, "slow_end"), "the worker waited for the step instead of handing it back"
    queue = rq_engine.transport.tiers[NORMAL]
    assert [job.args[1:] for job in queue.jobs] == [("1", 1)], "the step job is back at the head of its queue"
    assert StartedJobRegistry(queue=queue).count == 0
    second = worker(spawn, marker, "--concurrency", "1", env=NO_EAGER_STEPS)
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=30, what="run completed")
    assert [pid for _, pid in marks(marker, "slow_end")] == [second.proc.pid]


def test_priority_tiers_are_drained_high_to_low(rq_engine: Engine, spawn, marker: Path) -> None:
    transport: RQTransport = rq_engine.transport
    runs = {
        priority: [
            start("tests.queued", {"queue": "prio", "priority": priority, "value": f"p{priority}_{i}"})
            for i in range(3)
        ]
        for priority in (-5, 0, 5)
    }
    transport.tiers[NORMAL].empty()  # drop the first turns: this process dispatches the steps itself
    for i in range(3):  # interleaved, low first, so enqueue order is the opposite of priority order
        for priority in (-5, 0, 5):
            rq_engine.run_turn(runs[priority][i].id)
    assert [transport.tiers[t].count for t in (HIGH, NORMAL, LOW)] == [3, 3, 3]

    worker(spawn, marker, "--concurrency", "1")
    all_ids = [run.id for group in runs.values() for run in group]
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=all_ids, status=RunStatus.COMPLETED).count() == 9,
        timeout=40,
        what="all nine runs completed",
    )
    order = [value for value, _ in marks(marker, "echo")]
    assert order == [f"p{p}_{i}" for p in (5, 0, -5) for i in range(3)]


def test_duplicated_job_records_the_result_once(rq_engine: Engine, spawn, marker: Path) -> None:
    transport: RQTransport = rq_engine.transport
    run = start("tests.slow_one", {"id": "d", "seconds": 1.0})
    transport.tiers[NORMAL].empty()
    rq_engine.run_turn(run.id)
    queue = transport.tiers[NORMAL]
    (original,) = queue.jobs
    for _ in range(2):  # a broker redelivery / a retried job: same run, step and attempt
        queue.enqueue_call(run_step_job, args=original.args, timeout=-1)
    assert queue.count == 3

    worker(spawn, marker, "--concurrency", "2")  # pops two copies at once: they overlap
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=30, what="run completed")
    assert len(marks(marker, "slow_start")) >= 2, "the duplicates really ran concurrently"
    # The losing copy finishes a moment after the winner: its result is kept aside, not applied.
    cp = wait_for(
        lambda: StepCheckpoint.objects.filter(run=run, late_result__isnull=False).first(),
        timeout=10,
        what="the losing copy's result to be recorded as late",
    )
    assert cp.attempt == 1 and cp.status == "completed" and cp.output == {"id": "d", "seconds": 1.0}
    assert cp.late_result["attempt"] == 1
    run.refresh_from_db()
    assert run.output == {"id": "d", "seconds": 1.0}
    # Run once more, after the fact, in this process: skipped, nothing changes.
    assert run_step_job(run.id, "1", 1) == "skipped"
    assert StepCheckpoint.objects.get(run=run).finished_at == cp.finished_at


def test_heartbeats_carry_live_numbers_and_a_killed_worker_shows_dead(rq_engine: Engine, spawn, marker: Path) -> None:
    fixed = worker(spawn, marker, "--concurrency", "3")
    adaptive = worker(spawn, marker, "--concurrency", '{"mode": "adaptive", "min": 1, "max": 8, "tick_ms": 200}')
    wait_for(lambda: live_heartbeat(fixed) and live_heartbeat(adaptive), timeout=30, what="workers up")
    runs = [start("tests.fan", {"n": 30}) for _ in range(4)]
    wait_for(lambda: all(run_status(run.id) == RunStatus.COMPLETED for run in runs), timeout=40, what="fans completed")
    time.sleep(2 * get_settings().heartbeat_interval_s)
    beat = live_heartbeat(fixed)
    assert (beat.transport, beat.mode, beat.live_limit) == ("rq", "fixed", 3)
    assert beat.queues == ["durable:high", "durable", "durable:low"]
    assert beat.tasks_done > 0 and beat.p95_ms is not None and beat.rss_bytes > 10_000_000
    assert beat.in_flight == 0 and beat.throughput >= 0
    flex = live_heartbeat(adaptive)
    assert flex.mode == "adaptive" and 1 <= flex.live_limit <= 8 and flex.tasks_done > 0
    assert beat.tasks_done + flex.tasks_done >= 4 * 31  # 30 steps + the first turn, per run
    if flex.live_limit > 1:  # it moved, so the move is explained
        assert flex.last_adjustment_reason and flex.last_adjustment_at is not None

    fixed_id = beat.worker_id
    fixed.proc.send_signal(signal.SIGKILL)
    fixed.proc.wait(10)
    ttl = get_settings().heartbeat_ttl_s
    wait_for(
        lambda: WorkerHeartbeat.objects.get(worker_id=fixed_id).last_seen < dead_worker_cutoff(ttl),
        timeout=ttl + 60,
        what="the killed worker's heartbeat to lapse",
    )
    assert WorkerHeartbeat.objects.get(worker_id=fixed_id).stopped_at is None
    assert live_heartbeat(adaptive).last_seen >= dead_worker_cutoff(ttl), "the live worker keeps beating"


def test_adaptive_worker_grows_under_load_on_the_db_transport(transactional_db, spawn, marker: Path) -> None:
    """The same control loop drives the `db` transport's worker."""
    from durable_flow.transports.db.transport import DatabaseTransport

    set_engine(Engine(admission=LocalAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings()))
    proc = spawn(
        "durable_worker",
        "--concurrency",
        '{"mode": "adaptive", "min": 1, "max": 6, "tick_ms": 150}',
        env={"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_TEST_MARKER": str(marker), "DURABLE_FLOW_LOG": "INFO"},
    )
    runs = [start("tests.slow_one", {"id": f"a{i}", "seconds": 0.15}) for i in range(30)]
    wait_for(lambda: all(run_status(run.id) == RunStatus.COMPLETED for run in runs), timeout=60, what="runs completed")
    beat = wait_for(lambda: live_heartbeat(proc), timeout=5, what="heartbeat")
    assert beat.transport == "db" and beat.mode == "adaptive"
    # Read from the worker's log of its moves, not from its last heartbeat: on a loaded machine a
    # pool that grew may rightly shrink again before the runs finish (latency inflated by other
    # processes reads as queuing), which made the last-limit check flaky.
    moves = re.findall(r"concurrency (\d+) -> (\d+): (\w+)", proc.log_path.read_text(errors="replace"))
    assert any(int(new) > int(old) and why in ("slow", "grow") for old, new, why in moves), (
        f"a saturated pool with flat latency grows; moves: {moves}"
    )


@pytest.fixture(autouse=True)
def _needs_isolated_redis() -> None:
    """Fail loudly rather than share Redis database 0 with anything."""
    assert not settings.REDIS_URL.rstrip("/").endswith(("6379", "/0")), settings.REDIS_URL
    assert os.environ.get("DURABLE_FLOW_SUBPROCESS") != "1"


def test_jobs_popped_by_a_killed_worker_are_requeued_once_its_heartbeat_lapses(
    rq_engine: Engine, spawn, marker: Path
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from durable_flow.runtime.poller import TimerPoller

    victim = worker(spawn, marker, "--concurrency", "1", env=NO_EAGER_STEPS)  # the step is a job
    run = start("tests.slow_one", {"id": "r", "seconds": 3.0})
    wait_for(lambda: marks(marker, "slow_start"), timeout=30, what="the slow step to start")
    victim_id = live_heartbeat(victim).worker_id
    queue = rq_engine.transport.tiers[NORMAL]
    started = StartedJobRegistry(queue=queue)
    assert started.count == 1
    assert rq_engine.transport.reclaim_from(["some-other-worker"]) == 0 and started.count == 1  # not a live one's

    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    # The poller reads only the heartbeat row: backdating it is the lapse, without waiting for the TTL.
    WorkerHeartbeat.objects.filter(worker_id=victim_id).update(last_seen=timezone.now() - timedelta(hours=1))
    TimerPoller(rq_engine).maintain()
    assert started.count == 0, "the dead worker's job left RQ's started registry at once"
    # Its old attempt is back at the head (it will be skipped as stale), the re-dispatched one behind.
    assert [tuple(job.args[1:]) for job in queue.jobs] == [("1", 1), ("1", 2)]
    assert rq_engine.transport.reclaim_from([victim_id]) == 0  # taken once, never twice

    survivor = worker(spawn, marker, "--concurrency", "1")
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=60, what="run completed")
    assert [pid for _, pid in marks(marker, "slow_start")] == [victim.proc.pid, survivor.proc.pid]


# -- OPTIMISTIC_FIRST_STEP (engine/optimistic.py; engine-level tests: test_optimistic_first_step.py) --


def test_over_rq_the_first_step_runs_with_nothing_written_then_is_recorded_once(
    rq_engine: Engine, spawn, marker: Path, tmp_path: Path
) -> None:
    runner = worker(spawn, marker, "--concurrency", "2", env=OPTIMISTIC)
    gate = tmp_path / "open"
    run = start("tests.file_gated", {"path": str(gate), "id": "o"})
    wait_for(lambda: marks(marker, "file_gate"), timeout=30, what="the gated step to start")
    # The step runs, and the database knows nothing of it yet: no checkpoint, no turn taken;
    # only the worker's heartbeat lists it as running.
    assert not StepCheckpoint.objects.filter(run=run).exists()
    assert WorkflowRun.objects.filter(pk=run.id, status=RunStatus.PENDING, turns=0).exists()
    wait_for(lambda: f"{run.id}/1/1" in live_heartbeat(runner).running, timeout=30, what="the heartbeat's running list")
    assert not StepCheckpoint.objects.filter(run=run).exists()
    gate.touch()
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=30, what="run completed")
    cp = StepCheckpoint.objects.get(run=run)
    assert (cp.status, cp.attempt, cp.worker) == (StepStatus.COMPLETED, 1, live_heartbeat(runner).worker_id)
    assert WorkflowRun.objects.get(pk=run.id).turns == 2
    assert finished_job_kinds(rq_engine, at_least=1) == ["run_turn_job"]


def test_over_rq_a_turn_redelivered_after_a_kill_takes_the_locked_path(
    rq_engine: Engine, spawn, marker: Path, tmp_path: Path
) -> None:
    """A worker killed mid-step leaves no attempt behind, only its turn's job, which the poller
    re-queues once the worker's heartbeat lapses. That second delivery writes the step as
    dispatched before running it, so a step that kills its process is bounded by its retries."""
    gate = tmp_path / "open"
    victim = worker(spawn, marker, "--concurrency", "1", env=OPTIMISTIC)
    run = start("tests.file_gated", {"path": str(gate), "id": "k"})
    wait_for(lambda: marks(marker, "file_gate"), timeout=30, what="the gated step to start")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    assert not StepCheckpoint.objects.filter(run=run).exists()
    survivor = worker(spawn, marker, "--concurrency", "1", env=OPTIMISTIC)
    spawn("durable_poller", env={"DURABLE_FLOW_TRANSPORT": "rq", "DURABLE_FLOW_LOG": "WARNING"})
    wait_for(lambda: len(marks(marker, "file_gate")) == 2, timeout=120, what="the step to run again")
    cp = StepCheckpoint.objects.get(run=run)  # written before the second run of the step
    assert (cp.status, cp.attempt) == (StepStatus.DISPATCHED, 1)
    assert cp.worker == live_heartbeat(survivor).worker_id
    gate.touch()
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=30, what="run completed")
    assert [pid for _, pid in marks(marker, "file_gate")] == [victim.proc.pid, survivor.proc.pid]


def test_a_popped_turn_is_a_first_delivery_only_if_no_worker_started_it(rq_engine: Engine, redis_conn: Redis) -> None:
    transport = rq_engine.transport
    assert isinstance(transport, RQTransport)
    source = RQTaskSource(transport, execution_ttl_s=60)
    runner = type("Runner", (), {"worker_id": "w-first", "heartbeat_ttl_s": 3.0})()
    source.open(runner)  # type: ignore[arg-type]
    transport.tiers[NORMAL].enqueue("durable_flow.transports.rq.run_turn_job", "run-a")
    (first,) = source.claim("w-first", 1, 0)
    assert first.kind == "turn" and first.first_delivery
    source.hand_back("w-first", [first])  # a stopping worker gives it back
    (again,) = source.claim("w-first", 1, 0)
    assert again.run_id == "run-a" and not again.first_delivery
    source.close("w-first")


@pytest.mark.parametrize("extended", [True, False])
def test_after_an_outage_no_expired_execution_is_retried_for_one_execution_ttl(
    rq_engine: Engine, redis_conn: Redis, extended: bool
) -> None:
    """While Redis was away no worker could extend its executions: an expired one may be a live
    worker's whose job still runs, and RQ's cleanup (a worker's `renew`, now and then) would retry
    the job beside the running one. A worker that rode out an outage moves none for one execution
    TTL; by then a live worker has extended its own, and what is still expired was a dead one's."""
    transport = rq_engine.transport
    assert isinstance(transport, RQTransport)
    clock = FakeMonotonic()
    live = RQTaskSource(transport, execution_ttl_s=60)
    other = RQTaskSource(transport, execution_ttl_s=60, monotonic=clock)
    live.open(type("Runner", (), {"worker_id": "w-live", "heartbeat_ttl_s": 3.0})())  # type: ignore[arg-type]
    other.open(type("Runner", (), {"worker_id": "w-other", "heartbeat_ttl_s": 3.0})())  # type: ignore[arg-type]
    queue = transport.tiers[NORMAL]
    queue.enqueue("durable_flow.transports.rq.run_turn_job", "run-a", retry=Retry(max=3))
    (task,) = live.claim("w-live", 1, 0)
    registry = StartedJobRegistry(queue=queue)
    for member in redis_conn.zrange(registry.key, 0, -1):  # Redis was away: the execution expired
        redis_conn.zadd(registry.key, {member: 1})
    clock.now += 60  # the start's own wait is over
    other.outage_seen()  # its claims failed while Redis was away, and succeed again
    other.renew("w-other", [])
    assert registry.get_job_ids(cleanup=False) == [task.handle[0].id]  # not moved
    clock.now += 30
    if extended:
        live.renew("w-live", [task])  # the live worker's heartbeat, once Redis is back
    clock.now += 30  # one execution TTL since the outage
    other.renew("w-other", [])
    job_id = task.handle[0].id
    if extended:
        assert registry.get_job_ids(cleanup=False) == [job_id] and queue.job_ids == []
    else:  # a dead worker's: retried (its job back in the queue), as RQ does
        assert registry.get_job_ids(cleanup=False) == [] and queue.job_ids == [job_id]
    live.close("w-live")
    other.close("w-other")
