"""The host-loss soak: a fleet of simulated hosts loses one whole host (every process at once),
and on `rq` + `redis` admission also the Redis master its admission lives on, while queued work
runs; then everything must settle.

A host is a set of processes started in one process group of its own (`os.killpg` kills them
together, as a lost machine or container would): `WORKERS_PER_HOST` `durable_worker`s named
`<host>-w<n>` and a `durable_poller`. Each process is its own admission instance (the `redis`
backend's instance id, the `db` transport's worker id). The workload: `sc.fleet` runs (two
stamped steps through one queue capped at `CAP`, at most `FLEET_KEY_LIMIT` executing per tenant,
tenant 0 with half the runs), submitted in two waves. Once the fleet is up and a host holds slots,
that host is SIGKILLed whole; once its slots came back, on `rq` + `redis` the master serving the
admission's shard is killed (`tests/support/redis_cluster.py`: its replica is promoted; the RQ
broker stays on the plain Redis); then the second wave is submitted, so admissions run after
the host's loss and the failover.

Checked, once everything settled:
- nothing lost: every run completed with its exact output;
- each step's result recorded once: one completed checkpoint per step, with one completed
  attempt. Execution is at-least-once: a step running on the killed host ran again elsewhere
  (the evidence log shows it); a step ran twice only where a process that held it was killed;
- nothing leaked: the queue holds no slot and no waiter, no step-concurrency key is active or
  waited for, no checkpoint holds a slot;
- no limit breached: from the steps' own start/end stamps, at most `CAP` executing at once and
  at most `FLEET_KEY_LIMIT` per tenant (an execution cut by the kill ends at the kill). Across
  the failover the cap may be exceeded by admissions the new master never received (Redis
  replicates asynchronously; docs/redis-cluster.md, "Failover"): only while steps that were
  executing when the master died still run, and by at most as many as were executing then;
- the dead host's slots came back: on `redis`, every slot its instances owned was reclaimed,
  and only once their heartbeat keys had lapsed (`INSTANCE_TTL_MS`); on `db`, every slot its
  workers' steps held was taken up by a live worker's new attempt once their heartbeats lapsed
  (`HEARTBEAT["TTL_S"]`, the poller's next maintenance pass). The time each took is printed;
  the deadline is generous (a loaded machine is slow, not wrong).

Both stacks run on PostgreSQL only (the soak pass of `make test`). `SOAK_HOSTS_RUNS` sizes the
workload (default 60), `SOAK_SEED` replays the choice of tenants.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.db.models import Count, Q
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from durable_flow import register_queue, start
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine, build_backend, set_engine
from durable_flow.models import AttemptStatus, RunStatus, StepCheckpoint, WorkflowRun
from durable_flow.transports.db.transport import DatabaseTransport
from durable_flow.transports.rq import RQTransport
from tests.conftest import ManagedProcess, wait_for
from tests.reliability.evidence import Kill, max_overlap, open_at, over_limit, read_evidence
from tests.reliability.soak import HEARTBEAT_TTL_S, SEED, STACKS, STALL_S, clear_rq, stuck_report, unique, up
from tests.sc_workflows import FLEET_KEY_LIMIT
from tests.support.redis_cluster import OwnCluster
from tests.support.redis_keys import delete_keys
from tests.workflows import soak_value

pytestmark = [
    pytest.mark.soak,
    pytest.mark.timeout(900),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="soaked on PostgreSQL, the production database"),
]

RUNS = int(os.environ.get("SOAK_HOSTS_RUNS", "60"))
HOSTS = 3
WORKERS_PER_HOST = 2
CONCURRENCY = 2
CAP = 4
TENANTS = 4
#: Long enough that a killed host is caught with steps executing, short enough to keep the
#: default size well within `make test`'s budget.
STEP_MS = 300
#: The `redis` instances' heartbeat TTL in this soak (settings/test.py's, for the workers too).
INSTANCE_TTL_MS = 3000
#: The deadline for the dead host's slots to come back: generous, a verdict on "they came back",
#: not on the machine's speed (the time it took is printed beside its TTL).
COME_BACK_DEADLINE_S = 120.0
WORKFLOW = "sc.fleet"
PREFIX = f"df:test:{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}"


@pytest.fixture(params=["db", "rq"])
def stack(request: pytest.FixtureRequest) -> str:
    if request.param == "rq" and not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("the rq case fails over a Redis Cluster master: needs redis-server and redis-cli")
    return request.param


@pytest.fixture
def cluster(stack: str, request: pytest.FixtureRequest) -> OwnCluster | None:
    """The session's Redis Cluster on `rq` (admission lives there), none on `db`."""
    return request.getfixturevalue("redis_cluster") if stack == "rq" else None


@pytest.fixture
def hosts_engine(transactional_db: None, stack: str, cluster: OwnCluster | None, settings: Any) -> Iterator[Engine]:
    """This process's engine on the stack the hosts run (admission on the cluster for `rq`)."""
    if cluster is not None:
        clear_rq()
        settings.DURABLE_FLOW = {
            **settings.DURABLE_FLOW,
            "ADMISSION": {
                "BACKEND": "redis",
                "URL": cluster.url,
                "CLUSTER": True,
                "INSTANCE_TTL_MS": INSTANCE_TTL_MS,
                "KEY_PREFIX": PREFIX,
            },
        }
        reset_settings()
        engine = Engine(
            admission=build_backend(get_settings().admission),
            transport=RQTransport(queue="durable", concurrency=4),
            settings=get_settings(),
        )
    else:
        engine = Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    yield engine
    if cluster is not None:
        engine.admission.close()
        clear_rq()
        client = RedisCluster.from_url(cluster.url)
        delete_keys(client, f"{{{PREFIX}:*")
        client.close()
    reset_settings()


class Host:
    """A simulated host: its workers and its poller in one process group, killed together."""

    def __init__(self, name: str, spawn: Callable[..., ManagedProcess], env: dict[str, str]) -> None:
        self.name = name
        self.processes: list[ManagedProcess] = []
        for n in range(WORKERS_PER_HOST):
            self._start(spawn, env, "durable_worker", "--concurrency", str(CONCURRENCY), "--name", f"{name}-w{n}")
        self._start(spawn, env, "durable_poller")

    def _start(self, spawn: Callable[..., ManagedProcess], env: dict[str, str], *args: str) -> None:
        # The first process leads the host's group; the others join it.
        group = self.processes[0].proc.pid if self.processes else 0
        self.processes.append(spawn(*args, env=env, process_group=group))

    @property
    def pids(self) -> set[int]:
        return {process.proc.pid for process in self.processes}

    def up(self) -> bool:
        return all(up(process) for process in self.processes)

    def kill(self) -> list[Kill]:
        """SIGKILL every process of the host at once, reap them; the kills, stamped once all are dead."""
        os.killpg(self.processes[0].proc.pid, signal.SIGKILL)
        for process in self.processes:
            process.proc.wait(30)
        at = time.time()
        return [Kill(pid=process.proc.pid, at=at, role=f"host {self.name}") for process in self.processes]

    def dead(self) -> list[ManagedProcess]:
        return [process for process in self.processes if process.proc.poll() is not None]


class Slots:
    """Who holds the queue's slots now, by host: the `redis` backend's slot owners (instance ids,
    mapped to their process by the pid in their heartbeat), or the `db` checkpoints that hold a
    slot (stamped with their worker, `<hostname>:<host>-w<n>`)."""

    def __init__(self, engine: Engine, queue: str, run_ids: list[str], hosts: list[Host]) -> None:
        self.admission = engine.admission
        self.queue = queue
        self.run_ids = run_ids
        self.host_of_pid = {pid: host.name for host in hosts for pid in host.pids}
        self.instance_pids: dict[str, int] = {}

    def holders(self) -> dict[str, str]:
        """Ticket -> the name of the host holding its slot ("?" when it cannot tell)."""
        if isinstance(self.admission, RedisAdmissionBackend):
            return {ticket: self.host_of_pid.get(self._pid(owner), "?") for ticket, owner in self.owners().items()}
        rows = StepCheckpoint.objects.filter(run_id__in=self.run_ids, holds_slot=True).values_list(
            "run_id", "key", "worker"
        )
        return {f"{run}/{key}": worker.rpartition(":")[2].partition("-w")[0] or "?" for run, key, worker in rows}

    def owners(self) -> dict[str, str]:
        """`redis`: ticket -> owning instance id, from the queue's slot hash."""
        slots_key = self._keys()[1]
        return {t.decode(): o.decode() for t, o in self.admission.redis.hgetall(slots_key).items()}

    def heartbeat_alive(self, instance: str) -> bool:
        return bool(self.admission.redis.exists(self._heartbeat_key(instance)))

    def _keys(self) -> list[str]:
        keys = self.admission.queue_keys(self.queue)
        assert keys[1].endswith(":slots"), keys
        return keys

    def _heartbeat_key(self, instance: str) -> str:
        root = self._keys()[-2].rpartition(":inst:")[0]
        return f"{root}:inst:{instance}"

    def _pid(self, instance: str) -> int:
        """The pid an instance beats with, 0 if unknown (remembered: the key lapses once its
        process died)."""
        if instance not in self.instance_pids:
            raw = self.admission.redis.get(self._heartbeat_key(instance))
            # A key a script call created holds the bare instance id until the next beat writes
            # the process's host and pid: unknown until then.
            if raw is None or not raw.startswith(b"{"):
                return 0
            self.instance_pids[instance] = int(json.loads(raw).get("pid", 0))
        return self.instance_pids[instance]


def expected(n: int) -> int:
    return soak_value(soak_value(n, 1), 2)


def settled(run_ids: list[str]) -> bool:
    finished = [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
    return WorkflowRun.objects.filter(pk__in=run_ids, status__in=finished).count() == len(run_ids)


def wait_settled(engine: Engine, run_ids: list[str], queue: str) -> None:
    """Wait for every run to end, failing as stuck when none ended for `STALL_S`."""
    finished = [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
    progress, since = -1, time.monotonic()
    while True:
        count = WorkflowRun.objects.filter(pk__in=run_ids, status__in=finished).count()
        if count == len(run_ids):
            return
        if count > progress:
            progress, since = count, time.monotonic()
        assert time.monotonic() - since < STALL_S, (
            f"no run settled for {STALL_S:.0f}s, {count} of {len(run_ids)} settled (seed {SEED})\n"
            f"{stuck_report(engine, run_ids, (queue,))}"
        )
        time.sleep(0.5)


def test_the_fleet_settles_after_losing_a_host_and_a_redis_master(
    hosts_engine: Engine,
    stack: str,
    cluster: OwnCluster | None,
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
    capsys: Any,
) -> None:
    rng = random.Random(SEED)
    log = tmp_path / "soak.log"
    queue = unique("hosts")
    register_queue(queue, concurrency=CAP, retry_ms=200)
    env = {
        **STACKS[stack],
        "DURABLE_FLOW_SOAK_LOG": str(log),
        "DURABLE_FLOW_MAINTENANCE_S": "1",
        "DURABLE_FLOW_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S),
        "DURABLE_FLOW_LOG": "WARNING",
    }
    if cluster is not None:
        env["DURABLE_FLOW_ADMISSION_CLUSTER_URL"] = cluster.url
    hosts = [Host(f"h{i}", spawn, env) for i in range(HOSTS)]

    inputs: dict[str, int] = {}
    tenants: dict[str, str] = {}

    def submit(numbers: range) -> None:
        for n in numbers:
            tenant = "t0" if rng.random() < 0.5 else f"t{rng.randrange(1, TENANTS)}"
            run_id = start(WORKFLOW, {"n": n, "queue": queue, "tenant": tenant, "ms": STEP_MS}).id
            inputs[run_id], tenants[run_id] = n, tenant

    first_wave = range(RUNS // 2)
    submit(first_wave)
    wait_for(lambda: all(host.up() for host in hosts), timeout=STALL_S, interval=0.2, what="every host to start")
    slots = Slots(hosts_engine, queue, list(inputs), hosts)

    # The host to lose: the first seen holding the slot of a step it is executing (so the slot
    # can come back only once the host is judged dead).
    def holding_host() -> Host | None:
        holders = slots.holders()
        for host in hosts:
            executing = _executing(log, lambda pid, host=host: pid in host.pids)
            if any(holders.get(ticket) == host.name for ticket in executing):
                return host
        return None

    victim = wait_for(holding_host, timeout=STALL_S, interval=0.02, what="a host to hold a slot")
    kills = victim.kill()
    killed_at = kills[0].at
    lost_slots = {ticket for ticket, host in slots.holders().items() if host == victim.name}
    assert lost_slots, "the host held no slot by the time it died: the soak proves little"

    if isinstance(hosts_engine.admission, RedisAdmissionBackend):
        owner_at_kill = {t: o for t, o in slots.owners().items() if t in lost_slots}
        dead_instances = set(owner_at_kill.values())
        # A slot the dead host granted to a step another host runs may be adopted by that host
        # at once; one whose step was executing on the dead host only comes back by reclaim.
        pinned = {t: owner_at_kill[t] for t in _executing(log, lambda pid: pid in victim.pids) if t in owner_at_kill}

        def came_back() -> bool:
            owners = slots.owners()
            return not any(owners.get(ticket) in dead_instances for ticket in lost_slots)

        wait_for(came_back, timeout=COME_BACK_DEADLINE_S, interval=0.05, what="the dead host's slots to come back")
        # Reclaimed only once their owner's heartbeat lapsed (never while it could beat).
        assert pinned, "no step the dead host was executing held a slot: the soak proves little"
        assert not [t for t, owner in pinned.items() if slots.heartbeat_alive(owner)], pinned
        ttl_text = f"INSTANCE_TTL_MS {INSTANCE_TTL_MS}"
    else:

        def came_back() -> bool:
            holders = slots.holders()
            return not any(holders.get(ticket) == victim.name for ticket in lost_slots)

        wait_for(came_back, timeout=COME_BACK_DEADLINE_S, interval=0.1, what="the dead host's slots to come back")
        ttl_text = f"HEARTBEAT TTL_S {HEARTBEAT_TTL_S} + MAINTENANCE_S 1"
    came_back_s = time.time() - killed_at

    failover_at: float | None = None
    unheld_after_failover = 0
    if cluster is not None:
        assert not settled(list(inputs)), "the first wave settled before the failover: it proves little"
        admission = hosts_engine.admission
        assert isinstance(admission, RedisAdmissionBackend)
        master = cluster.master_of_slot(int(admission.redis.keyslot(f"{{{PREFIX}:default}}")))
        failover_at = time.time()
        try:
            new_master = cluster.fail_over(master)
            assert new_master != master
            # Best effort, printed: steps executing now whose slot the new master does not hold.
            held = set(wait_for(lambda: _held(admission, queue), timeout=30, what="the new master to answer"))
            live = _executing(log, lambda pid: pid not in victim.pids)
            unheld_after_failover = len(set(live) - held)
            submit(range(len(first_wave), RUNS))
            wait_settled(hosts_engine, list(inputs), queue)
        finally:
            cluster.restart(master)  # rejoins as a replica: the session's cluster is whole again
    else:
        submit(range(len(first_wave), RUNS))
    run_ids = list(inputs)
    wait_settled(hosts_engine, run_ids, queue)
    settled_s = time.time() - killed_at
    admission = hosts_engine.admission
    wait_for(
        lambda: admission.in_flight(queue) == 0 and admission.waiting(queue) == 0,
        timeout=STALL_S,
        what=f"{queue}'s slots and waiters to drain",
    )

    # -- the verdict --------------------------------------------------------------------------
    runs = {run.id: run for run in WorkflowRun.objects.filter(pk__in=run_ids)}
    lost = [r for r in run_ids if runs[r].status != RunStatus.COMPLETED]
    wrong = [r for r in run_ids if r not in lost and runs[r].output != expected(inputs[r])]
    checkpoints = StepCheckpoint.objects.filter(run_id__in=run_ids).annotate(
        completed_attempts=Count("attempts", filter=Q(attempts__status=AttemptStatus.COMPLETED))
    )
    per_run = Counter(cp.run_id for cp in checkpoints if cp.status == "completed" and cp.completed_attempts == 1)
    recorded_twice_or_not = [r for r in run_ids if per_run[r] != 2]
    leaked_checkpoints = StepCheckpoint.objects.filter(run_id__in=run_ids, holds_slot=True).count()
    busy_keys = [u for u in admission.constraint_usage(f"sc:fn:{WORKFLOW}:", limit=50) or [] if u.active or u.waiting]

    evidence = read_evidence(log, kills)
    unexplained = evidence.unexplained_reexecutions()
    spans = evidence.spans()
    cap_peak = max_overlap(spans)
    over_cap = over_limit(spans, CAP)
    by_tenant = {t: {r for r in run_ids if tenants[r] == t} for t in set(tenants.values())}
    key_spans = {t: evidence.spans(members) for t, members in by_tenant.items()}
    key_peak = max(max_overlap(s) for s in key_spans.values())
    over_key = [breach for s in key_spans.values() for breach in over_limit(s, FLEET_KEY_LIMIT)]
    # The failover's allowance: while steps executing at the master's death still ran, and at
    # most as many as were executing then (admissions the replica never received).
    allowed_until, allowance = 0.0, 0
    if failover_at is not None:
        executing = [(b, e) for b, e in spans if b <= failover_at <= e]
        allowed_until = max((e for _, e in executing), default=failover_at)
        allowance = open_at(spans, failover_at)

    def unexplained_breaches(breaches: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
        return [
            (at, n)
            for at, n in breaches
            if not (failover_at is not None and failover_at <= at <= allowed_until and n <= limit + allowance)
        ]

    survivors = [host for host in hosts if host is not victim]
    logs = "".join(process.output() for host in survivors for process in host.processes)
    # Work that waited for the last safety net (`REDISPATCH_AFTER_S`) rather than being ridden out.
    backstop = logs.count("no worker took it in REDISPATCH_AFTER_S")
    failover = ""
    if failover_at is not None:
        failover = f"failover at +{failover_at - killed_at:.1f}s, {unheld_after_failover} unheld after it; "
    with capsys.disabled():
        print(
            f"\nsoak-hosts[{stack}/{connection.vendor}] seed {SEED}: runs {RUNS}, hosts {HOSTS} x "
            f"{WORKERS_PER_HOST} workers + a poller, lost host {victim.name} ({len(kills)} processes) "
            f"holding {len(lost_slots)} slot(s), back in {came_back_s:.1f}s ({ttl_text}); {failover}"
            f"settled {settled_s:.1f}s after the kill; lost {len(lost)}, "
            f"recorded twice or not {len(recorded_twice_or_not)}, duplicates {len(unexplained)}, "
            f"re-executions {evidence.reexecutions()}, leaked {leaked_checkpoints + len(busy_keys)}, "
            f"cap peak {cap_peak}/{CAP}, key peak {key_peak}/{FLEET_KEY_LIMIT}, "
            f"re-driven by REDISPATCH_AFTER_S {backstop}"
        )

    assert not lost, f"runs not completed (seed {SEED}): " + ", ".join(f"{r} {runs[r].status}" for r in lost[:5])
    assert not wrong, f"runs with a wrong output: {wrong[:10]}"
    assert not recorded_twice_or_not, f"runs whose two results were not each recorded once: {recorded_twice_or_not[:5]}"
    assert not unexplained, f"steps re-run in processes never killed (seed {SEED}): {unexplained[:5]}"
    assert leaked_checkpoints == 0 and not busy_keys, (leaked_checkpoints, busy_keys)
    assert admission.in_flight(queue) == 0 and admission.waiting(queue) == 0
    assert not unexplained_breaches(over_cap, CAP), (over_cap, failover_at, allowed_until, allowance)
    assert not unexplained_breaches(over_key, FLEET_KEY_LIMIT), (over_key, failover_at, allowed_until, allowance)
    assert victim.dead() == victim.processes
    assert not [p for host in survivors for p in host.dead()], "a process of a live host died"
    if failover_at is not None:
        assert "admission" in logs and "service unavailable" in logs, "no process felt the failover: it proves little"


def _held(admission: RedisAdmissionBackend, queue: str) -> list[str] | None:
    try:
        return admission.held_tickets(queue)
    except (RedisError, OSError):  # the election may still be under way: asked again
        return None


EXECUTION = re.compile(r"^(start|end) (\S+) (\d+) (\d+) ")


def _executing(log: Path, where: Callable[[int], bool]) -> list[str]:
    """Tickets (`run/step key`: a stage is its step's key) of the steps executing now in the
    processes `where` accepts, from the evidence log."""
    open_steps: dict[tuple[str, str, int], str] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        found = EXECUTION.match(line)
        if not found:
            continue
        event, run, stage, pid = found.groups()
        if event == "start":
            open_steps[(run, stage, int(pid))] = f"{run}/{stage}"
        else:
            open_steps.pop((run, stage, int(pid)), None)
    return [ticket for (_, _, pid), ticket in open_steps.items() if where(pid)]
