#!/usr/bin/env python
"""Admission benchmark: decisions per second for every backend, Redis latency against the bare
EVALSHA floor, and the lag between a slot freeing and the next waiter's step being dispatched
(the handoff, through the engine on the db backend).

    .venv/bin/python bench/admission.py            # full run (~1 min)
    .venv/bin/python bench/admission.py --quick    # smoke run (~20 s)
    .venv/bin/python bench/admission.py --no-postgres

It sets up Django itself (`settings.test`, DURABLE_FLOW_TEST_ID=bench): the `db` backend runs in
child processes, one on a fresh SQLite file (var/test-bench.sqlite3) and one on its own
PostgreSQL database `durable_flow_bench` (created and dropped here), both migrated first.
Redis keys live under a unique `bench:adm:<hex>` prefix and are deleted at the end.

Scenarios (each runs for a fixed time, so the whole bench stays short):
- uncontended: admit + release pairs on a queue whose cap is never reached;
- cap full:    10,000 waiters, every slot held; a decision for the waiter in the middle;
- handoff:     the same line: a holder releases its slot and the release grants it to the
               rightful next of 10,000 waiters, in the same call.
- per-key:     per-key window and GCRA decisions against a plain window, and the state left
               after 100,000 distinct keys went idle (`bench/admission_keyed.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_DB = "durable_flow_bench"
WAITERS = 10_000


def setup_django(database_url: str | None, test_id: str = "bench") -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "settings.test"
    os.environ["DURABLE_FLOW_TEST_ID"] = test_id
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    if database_url:
        os.environ["DATABASE_URL"] = database_url
    else:
        os.environ.pop("DATABASE_URL", None)
        for suffix in ("", "-wal", "-shm"):
            (ROOT / "var" / f"test-{test_id}.sqlite3{suffix}").unlink(missing_ok=True)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


# -- measurement -------------------------------------------------------------------------------
def timed_loop(seconds: float, body: Callable[[int], None], limit: int = 10**9) -> list[float]:
    """Run `body(i)` until `seconds` pass; return each call's latency (s)."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    i = 0
    while i < limit:
        start = time.perf_counter()
        body(i)
        end = time.perf_counter()
        latencies.append(end - start)
        i += 1
        if end > deadline:
            break
    return latencies


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "per_s": len(ordered) / sum(ordered),
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
        "n": len(ordered),
    }


def measure_backend(
    backend: Any, seconds: float, fill: Callable[[Any, str, int], None] | None = None, waiters: int = WAITERS
) -> dict:
    """Uncontended pairs, then a cap-full decision and release + grant with `waiters` in line."""
    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.config.queues import QueueConfig

    tag = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {}

    queue = f"bench-u-{tag}"
    backend.register(QueueConfig(name=queue, concurrency=10**9))

    def pair(i: int) -> None:
        assert backend.try_admit(AdmissionRequest(queue, f"u{i}/1")).admitted
        backend.release(queue, f"u{i}/1")

    results["uncontended"] = summary(timed_loop(seconds, pair))

    if getattr(backend, "SUPPORTS_CONSTRAINTS", False):
        # The same pair for a step of a run with two step-concurrency constraints (a shared key
        # and a per-account key) plus its queue: all taken, then all released, atomically.
        from durable_flow.admission.base import Constraint

        constraints = (Constraint(f"sc:acct:openai-{tag}", 10**9), Constraint(f"sc:fn:bench:acct-{tag}", 10**9))

        def constrained_pair(i: int) -> None:
            assert backend.try_admit(AdmissionRequest(queue, f"k{i}/1", constraints=constraints)).admitted
            backend.release(queue, f"k{i}/1")

        results["constrained"] = summary(timed_loop(seconds, constrained_pair))

    queue = f"bench-c-{tag}"
    backend.register(QueueConfig(name=queue, concurrency=5))
    for i in range(5):
        assert backend.try_admit(AdmissionRequest(queue, f"h{i}/1")).admitted
    started = time.perf_counter()
    if fill is not None:
        fill(backend, queue, waiters)
    else:
        for i in range(waiters):
            assert not backend.try_admit(AdmissionRequest(queue, f"w{i}/1")).admitted
    results["fill_s"] = time.perf_counter() - started
    middle = AdmissionRequest(queue, f"w{waiters // 2}/1")

    def full(_: int) -> None:
        assert backend.try_admit(middle).reason == "concurrency"

    results["cap_full"] = summary(timed_loop(seconds, full))
    holders = deque(f"h{i}/1" for i in range(5))

    def handoff(_: int) -> None:
        granted = backend.release(queue, holders.popleft()).tickets
        assert len(granted) == 1
        holders.extend(granted)

    results["rank"] = summary(timed_loop(seconds, handoff, limit=waiters // 2))
    return results


# -- db, in a child process per database -------------------------------------------------------
def db_fill(backend: Any, queue: str, count: int) -> None:
    """Bulk-insert the line (10,000 decisions one by one would dominate the bench)."""
    from durable_flow.models import AdmissionWaiter, FlowQueue

    now = int(backend.clock())
    AdmissionWaiter.objects.bulk_create(
        AdmissionWaiter(queue=queue, ticket=f"w{i}/1", fairness_key=f"w{i}", arrival=i, seen_ms=now)
        for i in range(count)
    )
    FlowQueue.objects.filter(name=queue).update(next_arrival=count)


def run_db_child(seconds: float) -> None:
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend

    print(json.dumps(measure_backend(DatabaseAdmissionBackend(), seconds, fill=db_fill)))


def db_in_child(database_url: str | None, seconds: float) -> dict | str:
    args = [sys.executable, __file__, "--child-db", "--seconds", str(seconds)]
    if database_url:
        args += ["--database-url", database_url]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def postgres(action: str) -> str | None:
    """Create (fresh) or drop the bench database; the error when PostgreSQL is unreachable."""
    import psycopg

    try:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
            if action == "create":
                conn.execute(f"CREATE DATABASE {PG_DB}")
    except psycopg.Error as exc:  # report, and carry on with the other backends
        return str(exc).splitlines()[0]
    return None


# -- redis ---------------------------------------------------------------------------------------
def redis_figures(seconds: float) -> dict:
    import redis

    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.admission.redis.backend import RedisAdmissionBackend
    from durable_flow.config.queues import QueueConfig

    prefix = f"bench:adm:{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(REDIS_URL)
    backends: list[RedisAdmissionBackend] = []

    def make() -> RedisAdmissionBackend:
        backend = RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix)
        backends.append(backend)
        return backend

    out: dict[str, Any] = {}
    try:
        backend = make()
        before = client.info("commandstats").get("cmdstat_evalsha", {})
        out["redis"] = measure_backend(backend, seconds)
        after = client.info("commandstats").get("cmdstat_evalsha", {})
        calls = after.get("calls", 0) - before.get("calls", 0)
        out["server_us"] = (after.get("usec", 0) - before.get("usec", 0)) / calls if calls else float("nan")
        # fairness="key": 100 tenants, five of them already served (their waiters are grouped).
        queue = "bench-fair"
        backend.register(QueueConfig(name=queue, concurrency=5, fairness="key"))
        for i in range(5):
            assert backend.try_admit(AdmissionRequest(queue, f"h{i}/1", fairness_key=f"k{i}")).admitted
        for i in range(WAITERS):
            backend.try_admit(AdmissionRequest(queue, f"w{i}/1", fairness_key=f"k{i % 100}"))
        holders = deque(f"h{i}/1" for i in range(5))

        def handoff(_: int) -> None:
            granted = backend.release(queue, holders.popleft()).tickets
            assert len(granted) == 1
            holders.extend(granted)

        out["redis_key_rank"] = summary(timed_loop(seconds, handoff, limit=WAITERS // 2))
        trivial = client.register_script("return 1")
        out["evalsha"] = summary(timed_loop(seconds, lambda _: trivial(keys=[], args=[])))
    finally:
        clean_redis(client, prefix, backends)
    return out


def clean_redis(client: Any, prefix: str, backends: list[Any]) -> None:
    """Stop the backends' heartbeats, delete every key under `prefix`, close the client."""
    for backend in backends:
        backend.close()
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


# -- through the engine (db backend, SQLite) ------------------------------------------------------
def engine_handoff_lag(samples: int) -> dict[str, float]:
    """Slot frees -> the parked run's step is dispatched, through the engine on the `db` backend:
    a holder run's step result lands (releasing the slot, which the backend grants to the waiter
    in the same transaction) and the waiter's step is dispatched from its checkpoint on commit,
    with no turn and no poller involved."""
    from django.db import transaction
    from django.utils import timezone

    from durable_flow import start
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.config.queues import QueueConfig
    from durable_flow.engine import Engine, set_engine
    from durable_flow.models import StepCheckpoint, StepStatus, WorkflowRun
    from durable_flow.transports.base import Transport

    class HeldSteps(Transport):
        """Turns run on commit in this process; step attempts wait until the bench runs them."""

        name = "held"

        def __init__(self) -> None:
            self.steps: list[tuple[str, str, int]] = []
            self.engine: Engine | None = None

        def bind(self, engine: Engine) -> None:
            self.engine = engine

        def enqueue_turn(self, run_id: str) -> None:
            transaction.on_commit(lambda: self.engine.run_turn(run_id))  # type: ignore[union-attr]

        def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
            self.steps.append((run_id, step_key, attempt))

    transport = HeldSteps()
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=transport)  # type: ignore[arg-type]
    set_engine(engine)
    queue = f"bench-engine-{uuid.uuid4().hex[:6]}"
    engine.register_queue(QueueConfig(name=queue, concurrency=1))
    lags: list[float] = []
    turns: list[int] = []
    try:
        for i in range(samples):
            holder = start("tests.queued", {"queue": queue, "value": f"h{i}"})
            waiter = start("tests.queued", {"queue": queue, "value": f"w{i}"})
            assert StepCheckpoint.objects.get(run=waiter).status == StepStatus.WAITING
            step = next(item for item in transport.steps if item[0] == holder.id)
            transport.steps.remove(step)
            freed = timezone.now()
            engine.execute_step(*step, worker_id="bench")
            cp = StepCheckpoint.objects.get(run=waiter)
            assert cp.status == StepStatus.DISPATCHED, "the release did not hand the slot on"
            lags.append((cp.dispatched_at - freed).total_seconds() * 1000)
            step = next(item for item in transport.steps if item[0] == waiter.id)
            transport.steps.remove(step)
            engine.execute_step(*step, worker_id="bench")
            turns.append(WorkflowRun.objects.get(pk=waiter.id).turns)
    finally:
        set_engine(None)
    return {"max_ms": max(lags), "mean_ms": statistics.mean(lags), "n": len(lags), "max_turns": max(turns)}


# -- report ------------------------------------------------------------------------------------
def backend_line(name: str, row: dict | str) -> str:
    """One backend's rates, for the summary of docs/benchmarks.md."""
    if isinstance(row, str):
        return f"{name}: {row}"
    return (
        f"{name}: uncontended {row['uncontended']['per_s']:,.0f}/s, cap full {row['cap_full']['per_s']:,.0f}/s,"
        f" handoff {row['rank']['per_s']:,.0f}/s"
        f" (p50 {row['uncontended']['p50_us']:.0f} / {row['rank']['p50_us']:.0f} µs)"
    )


def fmt_rate(entry: dict | None) -> str:
    return f"{entry['per_s']:>10,.0f}" if entry else f"{'-':>10}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter loops and fewer wake samples")
    parser.add_argument("--seconds", type=float, default=None, help="duration of each timed loop")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--child-db", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--database-url", default=None, help=argparse.SUPPRESS)
    reporting.add_json_option(parser, "admission")
    args = parser.parse_args()
    seconds = args.seconds or (0.4 if args.quick else 1.5)

    if args.child_db:
        setup_django(args.database_url)
        run_db_child(seconds)
        return

    setup_django(None)
    from durable_flow.admission.local import LocalAdmissionBackend

    started = time.perf_counter()
    reporting.log("local")
    rows: dict[str, Any] = {"local": measure_backend(LocalAdmissionBackend(), seconds)}
    reporting.log("db (SQLite), in a child process")
    rows["db (SQLite)"] = db_in_child(None, seconds)
    reporting.log("db (PostgreSQL), in a child process")
    if args.no_postgres:
        rows["db (PostgreSQL)"] = "skipped (--no-postgres)"
    else:
        error = postgres("create")
        if error:
            rows["db (PostgreSQL)"] = f"unavailable: {error}"
        else:
            try:
                url = f"postgres://postgres@127.0.0.1:5432/{PG_DB}"
                rows["db (PostgreSQL)"] = db_in_child(url, seconds)
            finally:
                postgres("drop")
    reporting.log("redis")
    redis_out = redis_figures(seconds)
    reporting.log("handoff through the engine")
    handoff = engine_handoff_lag(10 if args.quick else 40)
    rows["redis"] = redis_out["redis"]

    print(f"\nAdmission decisions per second ({WAITERS:,} waiters in the contended line; {seconds:g} s per loop)\n")
    header = (
        f"{'backend':<18}{'uncontended':>12}{'cap full':>11}{'handoff':>11}   {'p50/p99 µs (uncont. / handoff)':<30}"
    )
    print(header + "\n" + "-" * len(header))
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<18}  {row}")
            continue
        lat = (
            f"{row['uncontended']['p50_us']:.0f}/{row['uncontended']['p99_us']:.0f}"
            f"  /  {row['rank']['p50_us']:.0f}/{row['rank']['p99_us']:.0f}"
        )
        print(
            f"{name:<18}{fmt_rate(row['uncontended']):>12}{fmt_rate(row['cap_full']):>11}"
            f"{fmt_rate(row['rank']):>11}   {lat}"
        )
    key_rank = redis_out["redis_key_rank"]
    print(
        f"{'redis fairness=key':<18}{'':>12}{'':>11}{fmt_rate(key_rank):>11}"
        f"   rank p50/p99 {key_rank['p50_us']:.0f}/{key_rank['p99_us']:.0f}"
    )
    print("\nA step with two step-concurrency constraints plus its queue, against a plain queue step")
    print("(admit+release pairs/s, same run):")
    for name, row in rows.items():
        if isinstance(row, str):
            continue
        if "constrained" in row:
            print(
                f"  {name:<18} two constraints + queue {fmt_rate(row['constrained']):>9}"
                f"   plain queue {fmt_rate(row['uncontended']):>9}"
                f"   p50 {row['constrained']['p50_us']:.0f} vs {row['uncontended']['p50_us']:.0f} µs"
            )
        else:
            print(f"  {name:<18} step concurrency not supported by this backend")
    print("\nuncontended = admit+release pairs/s (two script calls per pair on redis); cap full = decisions/s")
    print("for the middle waiter, blocked by 'concurrency'; handoff = releases/s, each granting the freed slot")
    print("to the rightful next of the waiters in the same call.")

    floor = redis_out["evalsha"]
    r = rows["redis"]
    print("\nRedis against the physical limit (bare EVALSHA 'return 1', same server, same run):")
    print(
        f"  EVALSHA return 1      {floor['per_s']:>10,.0f}/s"
        f"   p50 {floor['p50_us']:.0f} µs   p99 {floor['p99_us']:.0f} µs"
    )
    for label, key in (("cap full decision", "cap_full"), ("release + grant", "rank")):
        e = r[key]
        ratio = e["per_s"] / floor["per_s"]
        print(
            f"  {label:<21} {e['per_s']:>10,.0f}/s   p50 {e['p50_us']:.0f} µs   p99 {e['p99_us']:.0f} µs"
            f"   = {ratio:.0%} of the floor"
        )
    pair = r["uncontended"]
    print(
        f"  admit+release pair    {pair['per_s']:>10,.0f}/s   p50 {pair['p50_us']:.0f} µs   p99 {pair['p99_us']:.0f} µs"
        f"   = {2 * pair['per_s'] / floor['per_s']:.0%} of the floor (2 calls)"
    )

    print(
        f"  server-side script time {redis_out['server_us']:.0f} µs/call (INFO commandstats over the redis loops;"
        " approximate: other clients' EVALSHAs count too)"
    )

    print("\nSlot freed -> next waiter's step dispatched (engine, db backend, SQLite, one process):")
    print(
        f"  handoff                      worst {handoff['max_ms']:>7.1f} ms   mean {handoff['mean_ms']:>7.1f} ms"
        f"   ({handoff['n']} samples; the waiter's run took {handoff['max_turns']} turns at most)"
    )
    print(
        f"\n(fill of {WAITERS:,} waiters: "
        + ", ".join(f"{name} {row['fill_s']:.1f} s" for name, row in rows.items() if isinstance(row, dict))
        + "; db rows are bulk-inserted)"
    )
    from bench.admission_keyed import report as keyed_report  # per-key windows and GCRA rows

    keyed = keyed_report(seconds, 10_000 if args.quick else 100_000)
    print(f"total {time.perf_counter() - started:.0f} s")
    from bench.admission_keyed import summary_lines

    summary = [backend_line(name, row) for name, row in rows.items()]
    summary += [
        f"redis {label}: {r[key]['per_s'] / floor['per_s']:.0%} of the bare EVALSHA floor"
        for label, key in (("cap full decision", "cap_full"), ("release + grant", "rank"))
    ]
    summary.append(f"engine handoff: worst {handoff['max_ms']:.1f} ms, mean {handoff['mean_ms']:.1f} ms")
    summary += summary_lines(keyed)
    reporting.write_json(
        "admission",
        {
            "seconds": seconds,
            "waiters": WAITERS,
            "backends": rows,
            "redis_key_rank": redis_out["redis_key_rank"],
            "redis_evalsha_floor": floor,
            "redis_server_us_per_call": redis_out["server_us"],
            "engine_handoff": handoff,
            "keyed": keyed,
        },
        path=args.json,
        summary=summary,
    )


if __name__ == "__main__":
    main()
