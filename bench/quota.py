#!/usr/bin/env python
"""Start-quota benchmark: what a quota costs on the start path, and whether racing starters
overshoot the last free slot.

    .venv/bin/python bench/quota.py                 # SQLite then PostgreSQL (~1 min)
    .venv/bin/python bench/quota.py --only sqlite   # one database
    .venv/bin/python bench/quota.py --quick

Each database runs in its own child process (Django sets up once per process): SQLite on a fresh
file var/test-quotabench.sqlite3, PostgreSQL on its own database `durable_flow_quota_bench`
(created and dropped here). The engine gets a transport that queues nothing, so the cost
measured is the start itself: the INSERT, plus with a quota the key's lock and one COUNT(*) over the key's (at most
50) active runs.

- cost: starts per second without a quota and with one (a key that never fills), interleaved in
  rounds in the same process; the ratio is with/without.
- overshoot: `limit - 1` runs of a key already active, then 50 forked processes, each with its own
  connection, start at once (a barrier) on the one free slot. Exact: durable_flow's start
  (lock + count + insert in one transaction). Soft: the reference's gate, COUNT(*) then INSERT
  with no lock. Overshoot = runs started beyond the limit (target 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_DB = "durable_flow_quota_bench"
STARTERS = 50
LIMIT = 10


class NullTransport:
    """Queues nothing: the benchmark measures the start, not the turn."""

    name = "null"

    def bind(self, engine: Any) -> None:
        pass

    def enqueue_turn(self, run_id: str) -> None:
        pass

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        pass

    def enqueue_step_of_queue(self, queue: str, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        pass


def setup_django(database: str) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "settings.test"
    os.environ["DURABLE_FLOW_TEST_ID"] = "quotabench"
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    if database == "postgres":
        os.environ["DATABASE_URL"] = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{PG_DB}"
    else:
        os.environ.pop("DATABASE_URL", None)
        for suffix in ("", "-wal", "-shm"):
            (ROOT / "var" / f"test-quotabench.sqlite3{suffix}").unlink(missing_ok=True)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def build_engine() -> Any:
    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.definitions.registry import workflow
    from durable_flow.engine import Engine, set_engine

    @workflow("bench.quota")
    def bench_quota(ctx: Any, input: Any) -> None:
        return None

    engine = Engine(admission=LocalAdmissionBackend(), transport=NullTransport())  # type: ignore[arg-type]
    set_engine(engine)
    return engine


def measure_cost(engine: Any, seconds: float) -> tuple[float, float]:
    """Mean ms per start without and with a quota, interleaved in rounds so drift hits both."""
    from durable_flow.models import WorkflowRun

    plain: list[float] = []
    quota: list[float] = []
    wide = {"key": "cost", "limit": 10**9}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for sink, kwargs in ((plain, {}), (quota, {"quota": wide})):
            start = time.perf_counter()
            for _ in range(50):
                engine.start("bench.quota", {}, **kwargs)
            sink.append((time.perf_counter() - start) / 50 * 1000)
            # Untimed: finish the batch, so the key holds at most 50 active runs, as a real quota
            # would (the COUNT reads the key's active runs; an ever-growing key measures its size).
            WorkflowRun.objects.filter(concurrency_key="cost").update(status="completed")
    return statistics.mean(plain), statistics.mean(quota)


def soft_start(key: str, run_id: str) -> bool:
    """The reference's soft cap: COUNT(*), then INSERT, as separate statements with no lock."""
    from durable_flow.models import WorkflowRun
    from durable_flow.store.quotas import count_active

    if count_active(key) >= LIMIT:
        return False
    WorkflowRun.objects.create(id=run_id, workflow="bench.quota", input={}, concurrency_key=key)
    return True


def starter(mode: str, key: str, barrier: Any, results: Any) -> None:
    from django.db import connections

    from durable_flow.engine import get_engine
    from durable_flow.exceptions import ConcurrencyLimitError

    connections.close_all()  # never share the parent's connection across fork
    run_id = uuid.uuid4().hex
    try:
        barrier.wait(timeout=60)
        if mode == "exact":
            try:
                get_engine().start("bench.quota", {}, run_id=run_id, quota={"key": key, "limit": LIMIT})
                started = True
            except ConcurrencyLimitError:
                started = False
        else:
            started = soft_start(key, run_id)
        results.put(started)
    finally:
        connections.close_all()


def race(mode: str) -> int:
    """Runs started beyond LIMIT when STARTERS processes hit the last free slot at once."""
    from django.db import connections

    from durable_flow.models import WorkflowRun

    key = f"race:{mode}:{uuid.uuid4().hex[:8]}"
    WorkflowRun.objects.bulk_create(
        WorkflowRun(id=uuid.uuid4().hex, workflow="bench.quota", input={}, concurrency_key=key)
        for _ in range(LIMIT - 1)
    )
    connections.close_all()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(STARTERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=starter, args=(mode, key, barrier, results)) for _ in range(STARTERS)]
    for proc in procs:
        proc.start()
    started = sum(1 for _ in procs if results.get(timeout=120))
    for proc in procs:
        proc.join(30)
    active = WorkflowRun.objects.filter(concurrency_key=key).count()
    assert active == LIMIT - 1 + started, (active, started)
    return max(0, active - LIMIT)


def run_one(database: str, quick: bool) -> dict[str, Any]:
    """Measure on one database; print the lines and return the figures (with the lines, and
    the targets: no overshoot)."""
    setup_django(database)
    engine = build_engine()
    reporting.log(f"[{database}] start cost: {4 if quick else 12} s of interleaved rounds")
    plain_ms, quota_ms = measure_cost(engine, 4 if quick else 12)
    lines = [
        f"[{database}] start cost: {plain_ms:.2f} ms without a quota, {quota_ms:.2f} ms with one "
        f"(ratio {quota_ms / plain_ms:.2f})"
    ]
    print(lines[-1], flush=True)
    rounds = 2 if quick else 4
    figures: dict[str, Any] = {"plain_ms": plain_ms, "quota_ms": quota_ms, "ratio": quota_ms / plain_ms}
    for mode in ("exact", "soft"):
        reporting.log(f"[{database}] {rounds} races of {STARTERS} starters, {mode}")
        overshoots = [race(mode) for _ in range(rounds)]
        figures[f"overshoot_{mode}"] = overshoots
        label = "durable_flow (lock + count + insert)" if mode == "exact" else "soft cap (count, then insert)"
        lines.append(
            f"[{database}] {STARTERS} starters on the last free slot, {label}: overshoot "
            f"max {max(overshoots)}, per round {overshoots}"
        )
        print(lines[-1], flush=True)
    from django.db import connections

    connections.close_all()
    target = reporting.target(f"[{database}] overshoot, durable_flow", max(figures["overshoot_exact"]), "==", 0)
    return {"figures": figures, "lines": lines, "targets": [target]}


def create_pg_database() -> bool:
    import psycopg

    try:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {PG_DB}")
    except psycopg.Error as exc:
        print(f"[postgres] skipped: {exc}")
        return False
    return True


def drop_pg_database() -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")


def bench_main(run_one: Callable[[str, bool], dict[str, Any]], script: str, doc: str | None) -> None:
    """`--only`/`--quick` for a benchmark on this harness: each database in a child process of
    `script` (Django sets up once per process), the PostgreSQL database created and dropped here.
    `run_one` prints its lines and returns {"figures", "lines", "targets"}; the child hands that
    to this process in a file, and this process writes the bench's JSON from every database's."""
    name = Path(script).stem
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["sqlite", "postgres"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", type=Path, metavar="FIGURES", help=argparse.SUPPRESS)
    reporting.add_json_option(parser, name)
    args = parser.parse_args()
    if args.child:
        args.child.write_text(json.dumps(run_one(args.only, args.quick)))
        return
    results: dict[str, Any] = {}
    for database in [args.only] if args.only else ["sqlite", "postgres"]:
        if database == "postgres" and not create_pg_database():
            results[database] = {"figures": "skipped: PostgreSQL unreachable", "lines": [], "targets": []}
            continue
        reporting.log(f"{name} on {database}, in a child process")
        with tempfile.TemporaryDirectory() as scratch:
            handed = Path(scratch) / "figures.json"
            try:
                command = [sys.executable, script, "--child", str(handed), "--only", database]
                subprocess.run(command + (["--quick"] if args.quick else []), check=True, cwd=ROOT)
            finally:
                if database == "postgres":
                    drop_pg_database()
            results[database] = json.loads(handed.read_text())
    reporting.write_json(
        name,
        {database: result["figures"] for database, result in results.items()},
        path=args.json,
        summary=[line for result in results.values() for line in result["lines"]],
        targets=[entry for result in results.values() for entry in result["targets"]],
    )


if __name__ == "__main__":
    bench_main(run_one, __file__, __doc__)
