#!/usr/bin/env python
"""SQL statements, round trips and transactions per one-step workflow, counted with a query hook.

    .venv/bin/python bench/hotpath.py                # SQLite (a fresh file under var/)
    .venv/bin/python bench/hotpath.py --postgres     # PostgreSQL (its own database, dropped after)
    .venv/bin/python bench/hotpath.py --show-sql     # and every statement template, per phase
    .venv/bin/python bench/hotpath.py --postgres --admission redis   # `redis` admission (REDIS_URL)

Design. The embedded default (`db` transport, `db` admission) runs `--runs` one-step no-op
workflows (`tests.queued`, whose step echoes its input) three times: with no queue, through a
queue of concurrency 10, and through a queue of concurrency 1 with fairness by key whose runs all
park first ("handoff": every step after the first starts from a handoff, a result's release
granting the slot and the step dispatched inline to the same thread; its `step` row is the cost
of one handoff). The runs are started first (counted apart: `start`), then a
real `WorkerRuntime` (the `durable_worker` loop: claim, thread pool, heartbeat, grant timer)
runs in this process with `--concurrency` threads until no task is left. Every statement
any thread sends goes through `connection.execute_wrapper` hooks installed on each thread's
connection, and is attributed to a phase: `claim` (taking tasks), `turn`/`step` (running
them through the engine; a turn recorded inline with a step's result counts under `step`, and
so does a step the turn handed to its own thread, which is never claimed),
`done` (deleting the task), `setup` (what the worker does around a task: the connection's
health check), `heartbeat` (lease renewal and the heartbeat row) and `grant` (the grant timer).

A transaction is an outermost `atomic()` block that sent at least one statement, or one
statement sent in autocommit mode. `BEGIN` and savepoints are counted apart from the data
statements (`SELECT/INSERT/UPDATE/DELETE`): SQLite sends its `BEGIN IMMEDIATE` through the
cursor, PostgreSQL's driver does not, so only the data statements compare across databases.
With one worker thread each claim takes one task, the worst case for the claim's share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

from bench.admission import clean_redis  # noqa: E402 - after sys.path

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
#: Apart per DURABLE_FLOW_TEST_ID, so sessions sharing the machine do not drop each other's.
BENCH_ID = f"bench-hotpath-{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}"
PG_DATABASE = BENCH_ID.replace("-", "_")
QUEUE = "bench-hot"
HANDOFF_QUEUE = "bench-handoff"
PHASES = ("start", "claim", "setup", "turn", "step", "done", "heartbeat", "grant")
PER_WORKFLOW = ("claim", "setup", "turn", "step", "done")
CONTROL = ("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "COMMIT")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", action="store_true", help=f"use PostgreSQL ({PG_SERVER}/{PG_DATABASE})")
    parser.add_argument("--runs", type=int, default=200, help="workflows per path")
    parser.add_argument("--concurrency", type=int, default=1, help="worker threads")
    parser.add_argument("--show-sql", action="store_true", help="print each statement template per phase")
    parser.add_argument(
        "--admission", choices=("db", "redis"), default="db", help="the admission backend (redis: on --redis-url)"
    )
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    reporting.add_json_option(parser, "hotpath")
    return parser.parse_args()


def pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def setup_django(postgres: bool, admission: str, redis_url: str) -> None:
    """settings.test on the bench's own database, migrated from scratch, db transport + the
    given admission backend (`redis`: keys under settings.test's prefix for this bench's id)."""
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": BENCH_ID,
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DJANGO_DEBUG": "0",  # as deployed: DEBUG logs every query's SQL (bench/fleet.py)
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_ADMISSION": admission,
            "DURABLE_FLOW_LOG": "WARNING",
            "REDIS_URL": redis_url,
        }
    )
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    if postgres:
        pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")
        pg_admin(f"CREATE DATABASE {PG_DATABASE}")
        os.environ["DATABASE_URL"] = f"{PG_SERVER}/{PG_DATABASE}"
    else:
        os.environ.pop("DATABASE_URL", None)
        from settings.base import VAR_DIR

        for suffix in ("", "-wal", "-shm"):
            Path(f"{VAR_DIR / f'test-{BENCH_ID}.sqlite3'}{suffix}").unlink(missing_ok=True)

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


class _InnermostLast(list):  # type: ignore[type-arg]
    """A connection's `execute_wrappers` that keeps its last wrapper (the counter) last:
    `connection.execute_wrapper()` appends a wrapper and pops the last one on exit."""

    def append(self, item: Any) -> None:
        self.insert(len(self) - 1, item)

    def pop(self, index: Any = -1) -> Any:
        return super().pop(-2 if index == -1 else index)


class QueryCounter:
    """Counts statements and transactions per phase, from every thread's connection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.statements: Counter[str] = Counter()
        self.round_trips: Counter[str] = Counter()
        self.control: Counter[str] = Counter()
        self.transactions: Counter[str] = Counter()
        self.templates: dict[str, Counter[str]] = defaultdict(Counter)
        self.enabled = False

    @property
    def phase(self) -> str:
        return getattr(self.local, "phase", "") or {"df-grant-timer": "grant"}.get(threading.current_thread().name, "")

    @contextmanager
    def tagged(self, phase: str) -> Iterator[None]:
        outer = getattr(self.local, "phase", "")
        self.local.phase = phase
        try:
            yield
        finally:
            self.local.phase = outer

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def tagged_call(*args: Any, **kwargs: Any) -> Any:
            with self.tagged(phase):
                return fn(*args, **kwargs)

        return tagged_call

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.enabled:
            conn = context["connection"]
            phase = self.phase or "setup"
            # One round trip may carry several statements (`statements.writes_together` sends
            # held-back writes with the next statement): each is counted as a statement.
            parts = sql.split("; ")
            words = [part.lstrip().split(None, 1)[0].upper() for part in parts]
            with self.lock:
                self.round_trips[phase] += 1
                for part, word in zip(parts, words, strict=True):
                    if word in CONTROL:
                        self.control[f"{phase}:{word}"] += 1
                    else:
                        self.statements[phase] += 1
                        self.templates[phase][" ".join(part.split())[:160]] += 1
                word = words[-1]
                if not conn.in_atomic_block:
                    if word not in CONTROL:
                        self.transactions[phase] += 1
                elif not getattr(conn, "_bench_in_transaction", False):
                    conn._bench_in_transaction = True
                    self.transactions[phase] += 1
        return execute(sql, params, many, context)

    def install(self, conn: Any) -> None:
        """Hook one thread's connection (idempotent): the wrapper, and the end of transactions."""
        if self in conn.execute_wrappers:
            return
        # Innermost, so it sees each round trip as sent (a `writes_together` block's wrapper,
        # added later, joins held-back writes to the next statement before this one sees it).
        conn.execute_wrappers = _InnermostLast([*conn.execute_wrappers, self])
        for name in ("commit", "rollback"):
            original = getattr(conn, name)

            def ended(original: Callable[[], None] = original) -> None:
                conn._bench_in_transaction = False
                original()

            setattr(conn, name, ended)
        is_usable = conn.is_usable

        def health_check() -> bool:
            # PostgreSQL's check is a `SELECT 1` sent on the driver's connection, past the hook.
            if self.enabled and conn.vendor == "postgresql":
                with self.lock:
                    phase = self.phase or "setup"
                    self.statements[phase] += 1
                    self.transactions[phase] += 1
                    self.templates[phase]["SELECT 1 (connection health check)"] += 1
            return is_usable()

        conn.is_usable = health_check

    def reset(self) -> None:
        with self.lock:
            self.statements.clear()
            self.round_trips.clear()
            self.control.clear()
            self.transactions.clear()
            self.templates.clear()


COUNTER = QueryCounter()


def hook_connections() -> None:
    """Install the counter on every connection this process opens, in any thread."""
    from django.db import connection
    from django.db.backends.signals import connection_created

    connection_created.connect(lambda sender, connection, **kw: COUNTER.install(connection), weak=False)
    connection.ensure_connection()
    COUNTER.install(connection)


def run_path(queue: str | None, runs: int, concurrency: int, *, park_first: bool = False) -> float:
    """Start `runs` workflows and work them off with a real worker runtime; seconds it took.

    With `park_first`, every run's first turn is run before the worker starts (claimed and
    executed one by one as the worker would, counted under `turn`): all but the queue's cap
    park, so each later step starts from a handoff (a result's release grants the slot to the
    next waiter, whose step is dispatched inline to the same thread)."""
    from django.db import connection

    from durable_flow.engine import get_engine
    from durable_flow.models import AdmissionSlot, AdmissionWaiter, RunStatus, Task, WorkflowRun
    from durable_flow.runtime.concurrency import FixedConcurrency
    from durable_flow.runtime.worker import WorkerRuntime

    for model in (Task, AdmissionSlot, AdmissionWaiter, WorkflowRun):
        model.objects.all().delete()
    engine = get_engine()
    source = engine.transport.source()
    for name, phase in (("claim", "claim"), ("done", "done"), ("renew", "heartbeat")):
        setattr(source, name, COUNTER.wrap(phase, getattr(source, name)))
    execute = source.execute

    def execute_tagged(runner: Any, task: Any) -> bool:
        with COUNTER.tagged(task.kind):
            return execute(runner, task)

    source.execute = execute_tagged  # type: ignore[method-assign]
    runtime = WorkerRuntime(engine, source, FixedConcurrency(concurrency), grace_s=5)
    runtime.heartbeat.beat = COUNTER.wrap("heartbeat", runtime.heartbeat.beat)  # type: ignore[method-assign]
    # A step handed to the thread that dispatched it (`engine/inline_handoff.py`) runs past the source.
    runtime._run_inline = COUNTER.wrap("step", runtime._run_inline)  # type: ignore[method-assign]
    COUNTER.reset()
    COUNTER.enabled = True
    with COUNTER.tagged("start"):
        for i in range(runs):
            payload: dict[str, Any] = {"queue": queue, "value": i}
            if park_first:
                payload["key"] = f"tenant-{i % 4}"
            engine.start("tests.queued", payload)
    started = time.perf_counter()
    if park_first:
        tasks = source.claim(runtime.worker_id, runs, 0)
        assert all(task.kind == "turn" for task in tasks) and len(tasks) == runs, tasks
        # These turns run outside the worker loop, which is what runs a step a turn hands to its
        # own thread (`SourceCapabilities.turn_steps_inline`): the admitted run's step would be
        # stamped with this worker and never run. Sent through the transport instead, the worker claims it.
        capabilities = source.capabilities
        source.capabilities = dataclasses.replace(capabilities, turn_steps_inline=False)
        try:
            for task in tasks:
                with COUNTER.tagged("turn"):
                    source.execute(runtime, task)
                source.done(runtime.worker_id, task)
        finally:
            source.capabilities = capabilities
    try:
        runtime.run(burst=True)
    finally:
        engine.grant_timer.stop()
        COUNTER.enabled = False
    elapsed = time.perf_counter() - started
    connection.ensure_connection()
    completed = WorkflowRun.objects.filter(status=RunStatus.COMPLETED).count()
    if completed != runs:
        raise SystemExit(f"{completed} of {runs} runs completed")
    return elapsed


def report(label: str, runs: int, elapsed: float, show_sql: bool) -> dict[str, Any]:
    """Print one path's per-workflow figures; return them (statements, round trips and
    transactions per workflow, in all and per phase). A round trip is one `execute`: it may
    carry several statements."""
    stmts, trips, txns = COUNTER.statements, COUNTER.round_trips, COUNTER.transactions
    print(f"\n{label}: {runs} workflows, worker {runs / elapsed:.0f} wf/s (one thread, in-process)")
    header = f"  {'phase':<10} {'statements/wf':>14} {'round trips/wf':>15} {'transactions/wf':>16}"
    print(f"{header} {'BEGIN+savepoints/wf':>20}")
    for phase in PHASES:
        control = sum(n for key, n in COUNTER.control.items() if key.startswith(f"{phase}:"))
        if stmts[phase] or txns[phase] or control:
            row = f"  {phase:<10} {stmts[phase] / runs:>14.2f} {trips[phase] / runs:>15.2f} {txns[phase] / runs:>16.2f}"
            print(f"{row} {control / runs:>20.2f}")
    per_stmt = sum(stmts[p] for p in PER_WORKFLOW) / runs
    per_trip = sum(trips[p] for p in PER_WORKFLOW) / runs
    per_txn = sum(txns[p] for p in PER_WORKFLOW) / runs
    print(
        f"  worker total (claim..done): {per_stmt:.2f} statements in {per_trip:.2f} round trips"
        f" and {per_txn:.2f} transactions per workflow"
    )
    print(
        f"  with the start: {per_stmt + stmts['start'] / runs:.2f} statements in "
        f"{per_txn + txns['start'] / runs:.2f} transactions"
    )
    if show_sql:
        for phase in PHASES:
            for sql, n in COUNTER.templates[phase].most_common():
                print(f"    {phase:<9} {n / runs:6.2f}  {sql}")
    phases = {
        phase: {
            "statements": stmts[phase] / runs,
            "round_trips": trips[phase] / runs,
            "transactions": txns[phase] / runs,
            "control": sum(n for key, n in COUNTER.control.items() if key.startswith(f"{phase}:")) / runs,
        }
        for phase in PHASES
    }
    return {
        "runs": runs,
        "wf_s": runs / elapsed,
        "statements": per_stmt,
        "round_trips": per_trip,
        "transactions": per_txn,
        "with_start": {"statements": per_stmt + stmts["start"] / runs, "transactions": per_txn + txns["start"] / runs},
        "phases": phases,
    }


def main() -> None:
    args = parse_args()
    setup_django(args.postgres, args.admission, args.redis_url)
    from django.db import connection, connections

    from durable_flow.engine import get_engine

    vendor = connection.vendor
    hook_connections()
    get_engine().register_queue(_queue_config())
    get_engine().register_queue(_handoff_queue_config())
    try:
        results = {}
        paths = (
            ("no queue", None, False),
            (f"queue (concurrency 10, {QUEUE})", QUEUE, False),
            (f"handoff (concurrency 1, {HANDOFF_QUEUE}, parked)", HANDOFF_QUEUE, True),
        )
        for label, queue, park_first in paths:
            with reporting.progress(f"{label}: {args.runs} workflows"):
                elapsed = run_path(queue, args.runs, args.concurrency, park_first=park_first)
            results[label] = report(f"{vendor}, {label}", args.runs, elapsed, args.show_sql)
    finally:
        connections.close_all()
        if args.postgres:
            pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")
        if args.admission == "redis":  # its lines and slots outlive the run; its heartbeat stops
            backend = get_engine().admission
            clean_redis(backend.redis, backend.prefix, [backend])
    heading = (
        f"summary on {vendor}, {args.admission} admission"
        " (worker side, per one-step workflow; target ~10 statements in 4 transactions):"
    )
    lines = [
        f"{label:<36} {row['statements']:6.2f} statements  {row['round_trips']:6.2f} round trips"
        f"  {row['transactions']:5.2f} transactions"
        for label, row in results.items()
    ]
    print(f"\n{heading}\n" + "\n".join(f"  {line}" for line in lines))
    reporting.write_json(
        "hotpath",
        {"database": vendor, "admission": args.admission, "concurrency": args.concurrency, "paths": results},
        path=args.json,
        summary=[heading, *lines],
    )


def _queue_config() -> Any:
    from durable_flow.config.queues import QueueConfig

    return QueueConfig.from_mapping({"name": QUEUE, "concurrency": 10})


def _handoff_queue_config() -> Any:
    """bench/contention.py's cap scenario in miniature: a cap, fairness by key."""
    from durable_flow.config.queues import QueueConfig

    return QueueConfig.from_mapping({"name": HANDOFF_QUEUE, "concurrency": 1, "fairness": "key"})


if __name__ == "__main__":
    main()
