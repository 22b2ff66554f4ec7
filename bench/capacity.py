#!/usr/bin/env python
"""A capacity model from one run: what one queued workflow costs Redis, PostgreSQL and a worker,
and how many workflows a second one Redis shard, one PostgreSQL primary and one worker core carry.

    .venv/bin/python bench/capacity.py                  # a few minutes
    .venv/bin/python bench/capacity.py --quick          # seconds (the smoke test's size)
    .venv/bin/python bench/capacity.py --pg-cores 8     # the PostgreSQL primary the model sizes

Two parts, measured side by side in one process, on a Redis server of its own (started here on
a free port, removed after: its `INFO commandstats` and its CPU time are this bench's alone) and a
PostgreSQL database of its own (created and dropped here):

* Redis per decision. The `redis` admission backend's script calls for a step, `--decisions`
  times each, one op after the other: `admit`, `adopt` (the executing process takes the slot),
  `start` (the rate window's count) and `release`, for a plain queue and for a queue plus a
  step-concurrency resource (per account, a `fn`-scope constraint). Server time is
  `INFO commandstats`' `cmdstat_evalsha` (calls and microseconds: what the scripts spent
  executing, no network) and the redis-server process's CPU time (/proc's schedstat, in
  nanoseconds: execution plus reading, parsing and answering the calls, which is what fills its
  one core), each divided by the calls made. Redis 7 counts the commands a script runs in
  `commandstats` too: the "all commands" figures include the scripts' own calls.
* Per workflow, for each shape: `--runs` queued one-step workflows started, then run by a real
  `WorkerRuntime` in this process (`--concurrency` threads) until none is left:
  `db` (db transport, db admission), `rq + redis` (rq transport, redis admission, on the private
  Redis) and `rq + redis, step concurrency` (the same with a per-account resource). Counted per
  workflow: SQL statements and round trips (bench/hotpath.py's query hook, every thread's
  connection), PostgreSQL server time, Redis script calls and server time, and worker CPU.

PostgreSQL server time is measured twice, without pg_stat_statements (it may not be installed):
the CPU time (/proc's schedstat) of this database's backends, read from the server's
process table (`pg_stat_activity`: the backends of a shape's database, summed before and after;
the server's shared processes, WAL writer and checkpointer, are not counted), and
`pg_stat_database.active_time` (the time its backends spent executing statements, waits for locks
and the disk included), read after every backend of the database ended (a backend flushes its
statistics as it exits). Worker CPU is this process's CPU time (`time.process_time`) while the
worker runs, the query hook's own cost included; the starts' CPU (the web process's, in a
deployment) is given apart.

The model divides a second by each cost: one Redis shard is one single-threaded redis-server, so
1 s / Redis CPU per workflow; one PostgreSQL primary is `--pg-cores` times 1 s / backend CPU per
workflow (linear in cores: an upper bound, locks and the WAL's flush are shared); one worker
core is 1 s / worker CPU per workflow. For each shape the part with the lowest ceiling
saturates first; the workers scale by adding hosts, so the model gives the worker cores that
ceiling needs. docs/capacity.md holds a run's figures and what to add when a part saturates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
from services import PG_SERVER, pg_admin  # noqa: E402 - bench/ is on the path of a script run from it

#: Apart per DURABLE_FLOW_TEST_ID, so sessions sharing the machine do not drop each other's.
BENCH_ID = f"bench-capacity-{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}"
PG_DATABASE = BENCH_ID.replace("-", "_").replace(".", "_")
QUEUE = "bench-capacity"
#: The redis backend's script calls for one step through a queue, in their order.
OPS = ("admit", "adopt", "start", "release")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 decisions and 20 workflows per shape")
    parser.add_argument("--decisions", type=int, default=None, help="calls of each op, per kind (5000)")
    parser.add_argument("--runs", type=int, default=None, help="queued one-step workflows per shape (1000)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker threads")
    parser.add_argument(
        "--pg-cores", type=int, default=os.cpu_count() or 1, help="cores of the PostgreSQL primary the model sizes"
    )
    reporting.add_json_option(parser, "capacity")
    return parser.parse_args()


# -- the private Redis ----------------------------------------------------------------------------
class PrivateRedis:
    """A redis-server of this bench's own (no persistence), so its statistics are this bench's."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [*argv, "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)

    def sample(self) -> dict[str, float]:
        """evalsha calls and µs, every command's µs (commandstats), the server's CPU seconds."""

        stats = self.client.info("commandstats")
        evalsha = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
        return {
            "evalsha_calls": float(evalsha["calls"]),
            "evalsha_us": float(evalsha["usec"]),
            "all_us": float(sum(entry["usec"] for entry in stats.values())),
            "all_calls": float(sum(entry["calls"] for entry in stats.values())),
            "cpu_s": cpu_s(self.proc.pid),
            **{f"calls:{name.removeprefix('cmdstat_')}": float(entry["calls"]) for name, entry in stats.items()},
        }

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cpu_s(pid: int) -> float:
    """CPU seconds a process has run so far: the sum of its threads' /proc/<pid>/task/*/schedstat
    (nanoseconds on a CPU) where Linux has it, else user + system time (10 ms ticks)."""
    import psutil

    try:
        threads = [int(path.read_text().split()[0]) for path in Path(f"/proc/{pid}/task").glob("*/schedstat")]
    except (OSError, ValueError, IndexError):  # a thread ended meanwhile, or no schedstat
        threads = []
    if threads:
        return sum(threads) / 1e9
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


# -- Redis per decision ---------------------------------------------------------------------------
def redis_decisions(redis_server: PrivateRedis, decisions: int) -> dict[str, dict[str, float]]:
    """Server time per admit and per release, for a plain queue and a queue + step concurrency."""
    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.admission.redis.backend import RedisAdmissionBackend
    from durable_flow.config.queues import QueueConfig
    from durable_flow.definitions.step_concurrency import Constraint

    prefix = f"bench:cap:{uuid.uuid4().hex[:8]}"
    backend = RedisAdmissionBackend(url=redis_server.url, key_prefix=prefix)
    results: dict[str, dict[str, float]] = {}
    try:
        for kind, constrained in (("plain queue", False), ("queue + step concurrency", True)):
            queue = f"{QUEUE}-{'sc' if constrained else 'plain'}"
            backend.register(QueueConfig(name=queue, concurrency=10**9))

            def request(i: int, queue: str = queue, constrained: bool = constrained) -> AdmissionRequest:
                extra = (Constraint(f"sc:fn:bench.capacity:acct-{i}", 1),) if constrained else ()
                return AdmissionRequest(queue, f"t{i}/1", constraints=extra)

            for i in range(min(200, decisions)):  # warm: the script loaded, the keys created
                backend.try_admit(request(-1 - i))
                backend.release(queue, f"t{-1 - i}/1")
            admitted: list[str] = []
            for op in OPS:  # a step's calls in their order: admitted, adopted, started, released
                before, started = redis_server.sample(), time.perf_counter()
                for i in range(decisions):
                    if op == "admit":
                        decision = backend.try_admit(request(i))
                        if decision.admitted:
                            admitted.append(f"t{i}/1")
                    elif op == "adopt":
                        backend.adopt(queue, f"t{i}/1")
                    elif op == "start":
                        backend.try_start(queue, f"t{i}/1")
                    else:
                        backend.release(queue, f"t{i}/1")
                wall = time.perf_counter() - started
                spent = delta(redis_server.sample(), before)
                calls = max(1.0, spent["evalsha_calls"])
                results[f"{kind}: {op}"] = {
                    "decisions": decisions,
                    "evalsha_calls": spent["evalsha_calls"],
                    "evalsha_us_per_call": spent["evalsha_us"] / calls,
                    "all_commands_us_per_decision": spent["all_us"] / decisions,
                    "server_cpu_us_per_decision": 1e6 * spent["cpu_s"] / decisions,
                    "client_round_trip_us": 1e6 * wall / decisions,
                }
            if len(admitted) != decisions:
                raise RuntimeError(f"{kind}: {len(admitted)} of {decisions} admitted")
    finally:
        backend.close()
        keys = list(redis_server.client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            redis_server.client.delete(*keys)
    return results


# -- PostgreSQL ----------------------------------------------------------------------------------
def pg_rows(sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of `sql` on the server's maintenance database (never the bench's own)."""
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def backend_cpu_s() -> float:
    """CPU seconds so far of the bench database's backends (those alive now)."""
    import psutil

    total = 0.0
    for (pid,) in pg_rows("SELECT pid FROM pg_stat_activity WHERE datname = %s", PG_DATABASE):
        try:
            total += cpu_s(pid)
        except psutil.Error:  # ended meanwhile
            continue
    return total


def end_backends() -> dict[str, float]:
    """End every backend of the bench's database (each flushes its statistics as it exits), then
    read the database's cumulative statistics: active_time (ms) and committed transactions."""
    from django.db import connections

    connections.close_all()
    pg_rows("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", PG_DATABASE)
    deadline = time.monotonic() + 30
    while pg_rows("SELECT 1 FROM pg_stat_activity WHERE datname = %s", PG_DATABASE):
        if time.monotonic() > deadline:
            raise RuntimeError(f"backends of {PG_DATABASE} still alive after 30 s")
        time.sleep(0.05)
    time.sleep(0.2)  # the statistics of a backend that just exited
    row = pg_rows("SELECT active_time, xact_commit FROM pg_stat_database WHERE datname = %s", PG_DATABASE)[0]
    return {"active_ms": float(row[0] or 0.0), "commits": float(row[1] or 0)}


def pg_settings() -> dict[str, str]:
    names = ("fsync", "synchronous_commit", "shared_buffers", "max_connections")
    rows = pg_rows("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", list(names))
    return {str(name): str(value) for name, value in rows}


# -- per workflow, per shape ----------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A deployment's stack, and the workflow it runs: one step through a queue."""

    name: str
    transport: str  # db | rq
    admission: str  # db | redis
    workflow: str
    payload: Callable[[int], dict[str, Any]]


SHAPES = (
    Shape("db", "db", "db", "tests.queued", lambda i: {"queue": QUEUE, "value": i}),
    Shape("rq + redis", "rq", "redis", "tests.queued", lambda i: {"queue": QUEUE, "value": i}),
    Shape(
        "rq + redis, step concurrency",
        "rq",
        "redis",
        "sc.queued",  # one step through the queue, at most one at a time per account
        lambda i: {"queue": QUEUE, "account": f"acct-{i}", "seconds": 0, "id": i},
    ),
)


def build_engine(shape: Shape, redis_url: str) -> Any:
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.redis.backend import RedisAdmissionBackend
    from durable_flow.config.queues import QueueConfig
    from durable_flow.config.settings import get_settings
    from durable_flow.engine import Engine, set_engine
    from durable_flow.transports.db.transport import DatabaseTransport
    from durable_flow.transports.rq import RQTransport

    admission: Any
    if shape.admission == "redis":
        admission = RedisAdmissionBackend(url=redis_url, key_prefix=f"bench:cap:{uuid.uuid4().hex[:8]}")
    else:
        admission = DatabaseAdmissionBackend()
    transport = RQTransport(queue="durable") if shape.transport == "rq" else DatabaseTransport()
    engine = Engine(admission=admission, transport=transport, settings=get_settings())
    set_engine(engine)
    engine.register_queue(QueueConfig(name=QUEUE, concurrency=10**6))
    return engine


@contextmanager
def measured(redis_server: PrivateRedis) -> Iterator[dict[str, float]]:
    """CPU of this process, of the bench database's backends and of the private Redis, and its
    commandstats, over the block: filled in on exit."""
    out: dict[str, float] = {}
    cpu, pg, rs = time.process_time(), backend_cpu_s(), redis_server.sample()
    yield out
    out["process_cpu_s"] = time.process_time() - cpu
    out["pg_cpu_s"] = backend_cpu_s() - pg
    out.update({f"redis_{key}": value for key, value in delta(redis_server.sample(), rs).items()})


def run_shape(shape: Shape, runs: int, concurrency: int, redis_server: PrivateRedis) -> dict[str, Any]:
    """Start `runs` workflows, work them off with a real worker runtime; the costs per workflow."""
    import hotpath
    from django.db import connection

    from durable_flow.models import AdmissionSlot, AdmissionWaiter, RunStatus, Task, WorkflowRun
    from durable_flow.runtime.concurrency import FixedConcurrency
    from durable_flow.runtime.worker import WorkerRuntime

    for model in (Task, AdmissionSlot, AdmissionWaiter, WorkflowRun):  # the last shape's, not counted
        model.objects.all().delete()
    before = end_backends()
    engine = build_engine(shape, redis_server.url)
    ops = count_script_ops(engine.admission) if shape.admission == "redis" else Counter()
    connection.ensure_connection()
    counter = hotpath.COUNTER
    counter.reset()
    counter.enabled = True
    try:
        with measured(redis_server) as start_cost, counter.tagged("start"):
            for i in range(runs):
                engine.start(shape.workflow, shape.payload(i))
        runtime = WorkerRuntime(engine, engine.transport.source(), FixedConcurrency(concurrency), grace_s=5)
        started = time.perf_counter()
        with measured(redis_server) as run_cost:
            runtime.run(burst=True)
        elapsed = time.perf_counter() - started
    finally:
        counter.enabled = False
        engine.grant_timer.stop()
    statements, trips = counter.statements, counter.round_trips
    if shape.admission == "redis":
        engine.admission.close()
    after = end_backends()
    completed = WorkflowRun.objects.filter(status=RunStatus.COMPLETED).count()
    if completed != runs:
        raise RuntimeError(f"{shape.name}: {completed} of {runs} runs completed")
    per = 1.0 / runs
    return {
        "runs": runs,
        "uses_redis": "redis" in (shape.transport, shape.admission) or shape.transport == "rq",
        "worker_wf_s": runs / elapsed,
        "statements": sum(n for phase, n in statements.items() if phase != "start") * per,
        "round_trips": sum(n for phase, n in trips.items() if phase != "start") * per,
        "start_statements": statements["start"] * per,
        "start_round_trips": trips["start"] * per,
        "worker_cpu_us": 1e6 * run_cost["process_cpu_s"] * per,
        "start_cpu_us": 1e6 * start_cost["process_cpu_s"] * per,
        "pg_cpu_us": 1e6 * (start_cost["pg_cpu_s"] + run_cost["pg_cpu_s"]) * per,
        "pg_active_us": 1000 * (after["active_ms"] - before["active_ms"]) * per,
        "pg_commits": (after["commits"] - before["commits"]) * per,
        "redis_evalsha_calls": (start_cost["redis_evalsha_calls"] + run_cost["redis_evalsha_calls"]) * per,
        "redis_evalsha_us": (start_cost["redis_evalsha_us"] + run_cost["redis_evalsha_us"]) * per,
        "redis_commands": (start_cost["redis_all_calls"] + run_cost["redis_all_calls"]) * per,
        "redis_commands_us": (start_cost["redis_all_us"] + run_cost["redis_all_us"]) * per,
        "redis_cpu_us": 1e6 * (start_cost["redis_cpu_s"] + run_cost["redis_cpu_s"]) * per,
        "admission_script_calls": {op: n * per for op, n in sorted(ops.items())},
        "redis_calls_by_command": {
            key.removeprefix("redis_calls:"): round((start_cost.get(key, 0.0) + run_cost.get(key, 0.0)) * per, 2)
            for key in sorted({*start_cost, *run_cost}, key=lambda k: -(start_cost.get(k, 0) + run_cost.get(k, 0)))
            if key.startswith("redis_calls:") and start_cost.get(key, 0.0) + run_cost.get(key, 0.0) >= 0.05 * runs
        },
    }


def count_script_ops(backend: Any) -> Counter[str]:
    """Count the redis backend's script calls by op (admit, adopt, release, ...); the heartbeat's
    script is apart (its calls show in `redis_evalsha_calls` only)."""
    ops: Counter[str] = Counter()
    lock = threading.Lock()
    run = backend._run

    def counted(op: str, *args: Any, **kwargs: Any) -> Any:
        with lock:
            ops[op] += 1
        return run(op, *args, **kwargs)

    backend._run = counted
    return ops


# -- the model ------------------------------------------------------------------------------------
def ceilings(row: dict[str, Any], pg_cores: int, admission_cpu_us: float | None) -> dict[str, Any]:
    """Workflows/s each part carries at one core's (one shard's, one primary's) full use, and the
    part that saturates first (the lowest of Redis and PostgreSQL: workers scale by hosts)."""
    per_core = {
        "worker_core": 1e6 / row["worker_cpu_us"],
        "pg_core": 1e6 / row["pg_cpu_us"],
    }
    limits = {"postgresql_primary": per_core["pg_core"] * pg_cores}
    if row["uses_redis"]:
        limits["redis_shard"] = 1e6 / row["redis_cpu_us"]
    if admission_cpu_us:
        per_core["redis_shard_admission_only"] = 1e6 / admission_cpu_us
    first = min(limits, key=lambda part: limits[part])
    crossover = {}
    if "redis_shard" in limits:  # past this many PostgreSQL cores, one Redis shard saturates first
        crossover["pg_cores_to_match_redis_shard"] = limits["redis_shard"] / per_core["pg_core"]
    return {
        **per_core,
        **limits,
        **crossover,
        "saturates_first": first,
        "ceiling_wf_s": limits[first],
        "worker_cores_at_ceiling": limits[first] * row["worker_cpu_us"] / 1e6,
    }


def main() -> None:
    args = parse_args()
    decisions = args.decisions or (200 if args.quick else 5000)
    runs = args.runs or (20 if args.quick else 1000)
    if shutil.which("redis-server") is None:
        sys.exit("bench/capacity.py needs redis-server on PATH")
    directory = Path(tempfile.mkdtemp(prefix="df-bench-capacity-"))
    redis_server = PrivateRedis(directory)
    try:
        from services import django_on_fresh_database

        env = {"REDIS_URL": redis_server.url, "DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_ADMISSION": "db"}
        django_on_fresh_database(BENCH_ID, PG_DATABASE, env)
        import hotpath

        hotpath.hook_connections()
        reporting.log(f"Redis: {decisions} calls of {', '.join(OPS)}, for each kind")
        decided = redis_decisions(redis_server, decisions)
        shapes: dict[str, dict[str, Any]] = {}
        for shape in SHAPES:
            with reporting.progress(f"{shape.name}: {runs} workflows, {args.concurrency} worker threads"):
                shapes[shape.name] = run_shape(shape, runs, args.concurrency, redis_server)
        figures = derive(decided, shapes, args, decisions, runs)
    finally:
        from django.db import connections

        connections.close_all()
        redis_server.stop()
        shutil.rmtree(directory, ignore_errors=True)
        pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")
    summary = show(figures, args.pg_cores)
    reporting.write_json(
        "capacity",
        figures,
        path=args.json,
        summary=summary,
        targets=[
            reporting.target(f"{name}: runs completed", row["runs"], "==", runs)
            for name, row in figures["shapes"].items()
        ],
    )


def derive(
    decided: dict[str, dict[str, float]],
    shapes: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    decisions: int,
    runs: int,
) -> dict[str, Any]:
    """The figures: per decision, per workflow, and each shape's ceilings."""
    for name, row in shapes.items():
        admission_cpu = None
        if "redis" in name:
            kind = "queue + step concurrency" if "step concurrency" in name else "plain queue"
            calls = row["admission_script_calls"]  # per workflow, by op: each priced as measured alone
            admission_cpu = sum(decided[f"{kind}: {op}"]["server_cpu_us_per_decision"] * calls.get(op, 0) for op in OPS)
        row["model"] = ceilings(row, args.pg_cores, admission_cpu)
    return {
        "decisions": decisions,
        "runs": runs,
        "concurrency": args.concurrency,
        "pg_cores": args.pg_cores,
        "pg_settings": pg_settings(),
        "redis_per_decision": decided,
        "shapes": shapes,
    }


def show(figures: dict[str, Any], pg_cores: int) -> list[str]:
    """Print the figures and the derivation; return the summary lines."""
    print(f"Redis server time per admission decision ({figures['decisions']} of each, a private redis-server)")
    print(f"  {'decision':<36} {'evalsha µs/call':>16} {'all cmds µs':>12} {'server CPU µs':>14} {'round trip µs':>14}")
    for name, row in figures["redis_per_decision"].items():
        print(
            f"  {name:<36} {row['evalsha_us_per_call']:>16.1f} {row['all_commands_us_per_decision']:>12.1f}"
            f" {row['server_cpu_us_per_decision']:>14.1f} {row['client_round_trip_us']:>14.1f}"
        )
    print(
        f"\nPer queued one-step workflow ({figures['runs']} a shape, start included unless said;"
        f" worker: {figures['concurrency']} threads in this process)"
    )
    header = ["SQL stmts", "round trips", "commits", "PG CPU µs", "PG active µs", "worker CPU µs", "start CPU µs"]
    print(f"  {'shape':<30} " + " ".join(f"{h:>13}" for h in header))
    for name, row in figures["shapes"].items():
        cells = [row["statements"] + row["start_statements"], row["round_trips"] + row["start_round_trips"]]
        cells += [row["pg_commits"], row["pg_cpu_us"], row["pg_active_us"], row["worker_cpu_us"], row["start_cpu_us"]]
        print(f"  {name:<30} " + " ".join(f"{value:>13.1f}" for value in cells))
    header = ["evalsha calls", "evalsha µs", "Redis cmds", "all cmds µs", "Redis CPU µs"]
    print(f"  {'shape (Redis)':<30} " + " ".join(f"{h:>13}" for h in header))
    for name, row in figures["shapes"].items():
        if row["uses_redis"]:
            cells = [row["redis_evalsha_calls"], row["redis_evalsha_us"], row["redis_commands"]]
            cells += [row["redis_commands_us"], row["redis_cpu_us"]]
            print(f"  {name:<30} " + " ".join(f"{value:>13.1f}" for value in cells))
    for name, row in figures["shapes"].items():
        if row["admission_script_calls"]:
            calls = ", ".join(f"{op} {n:.2f}" for op, n in row["admission_script_calls"].items())
            print(f"  {name}: admission script calls per workflow: {calls} (and the heartbeat's)")
            commands = ", ".join(f"{command} {n:.1f}" for command, n in list(row["redis_calls_by_command"].items())[:8])
            print(f"  {name}: Redis commands per workflow, the most called: {commands}")
    print(
        f"\nThe model: workflows/s = 1 s / cost per workflow; a Redis shard is one core; the PostgreSQL"
        f" primary {pg_cores} core(s) (--pg-cores), linear in cores (an upper bound); workers scale by hosts"
    )
    summary = []
    for name, row in figures["shapes"].items():
        model = row["model"]
        redis = f"one Redis shard {model['redis_shard']:,.0f} wf/s" if "redis_shard" in model else "no Redis"
        line = (
            f"{name}: one worker core {model['worker_core']:,.0f} wf/s; one PostgreSQL core"
            f" {model['pg_core']:,.0f} wf/s ({pg_cores} cores: {model['postgresql_primary']:,.0f}); {redis};"
            f" saturates first: {model['saturates_first'].replace('_', ' ')} at {model['ceiling_wf_s']:,.0f} wf/s,"
            f" with {model['worker_cores_at_ceiling']:.1f} worker cores busy"
        )
        if "redis_shard_admission_only" in model:
            line += (
                f"; a Redis shard with admission alone (RQ on other servers):"
                f" {model['redis_shard_admission_only']:,.0f} wf/s; one Redis shard saturates before PostgreSQL"
                f" past {model['pg_cores_to_match_redis_shard']:.1f} PostgreSQL cores"
            )
        print(f"  {line}")
        summary.append(line)
    return summary


if __name__ == "__main__":
    main()
