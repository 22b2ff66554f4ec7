#!/usr/bin/env python
"""Does the timer poller's tick cost follow the due runs, not every parked run?

    .venv/bin/python bench/poller.py              # SQLite (a fresh file under var/)
    .venv/bin/python bench/poller.py --postgres   # PostgreSQL (its own database, dropped after)

Design. Every timed tick has the same work to do: wake `--due` runs (100) that are due, on
the `db` transport, so it also writes their turn `Task` rows, as in production. Between
ticks, outside the timing, those runs are parked again (suspended, due a second ago) and
their tasks deleted, so every tick starts from the same state. We take the median of
`--ticks` ticks after a few warm-up ones, first with no other runs in the table, then with
each size of `--parked` (1,000, 10,000 and 100,000; the rows are added to those already
parked) runs parked not due (suspended, or running with a step deadline, due between one and
31 days from now), and print each against the first and their ratio. Parking 100,000 rows takes
tens of seconds on a loaded machine, so the earliest parked row falls due a day out, not minutes
out: none may fall due while the bench runs (a tick that woke one would abort the run). A tick
that scanned the parked runs would grow with them; one that walks the `(status, wake_at)` index
stays flat (target < 1.5). An empty tick (nothing due) is shown too, for the fixed cost of asking,
and the read of the next wake time the poller makes after each tick (`queries.next_wake`: one
index seek a parked status; target < 1.5 too).

PostgreSQL gets an ANALYZE after the bulk insert, standing in for autovacuum; SQLite gets
none (a deployment rarely runs it), so its planner must find the index unaided. SQLite's
write-ahead log is checkpointed after each bulk insert, so the ticks timed after it do not pay
for copying the inserted pages back (the automatic checkpoint of their commits would).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PG_DATABASE = f"durable_flow_bench_poller_{os.getpid()}"  # its own: other sessions may run this bench too


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", action="store_true", help=f"use PostgreSQL ({PG_SERVER}/{PG_DATABASE})")
    parser.add_argument(
        "--parked", default="1000,10000,100000", help="comma-separated counts of not-due runs, each measured"
    )
    parser.add_argument("--due", type=int, default=100, help="due runs each timed tick wakes")
    parser.add_argument("--ticks", type=int, default=60, help="timed ticks per measurement (median reported)")
    reporting.add_json_option(parser, "poller")
    return parser.parse_args()


def pg_admin(sql: str) -> None:
    """Run CREATE/DROP DATABASE on the server's maintenance database (outside a transaction)."""
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def setup_django(postgres: bool) -> None:
    """settings.test on the bench's own database, migrated from scratch."""
    os.environ["DURABLE_FLOW_TEST_ID"] = "bench-poller"
    os.environ["DJANGO_SETTINGS_MODULE"] = "settings.test"
    os.environ["DURABLE_FLOW_TRANSPORT"] = "db"
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    if postgres:
        pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE}")
        pg_admin(f"CREATE DATABASE {PG_DATABASE}")
        os.environ["DATABASE_URL"] = f"{PG_SERVER}/{PG_DATABASE}"
    else:
        os.environ.pop("DATABASE_URL", None)
        from settings.base import VAR_DIR

        for suffix in ("", "-wal", "-shm"):
            Path(f"{VAR_DIR / 'test-bench-poller.sqlite3'}{suffix}").unlink(missing_ok=True)

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def measure(due_ids: list[str], ticks: int, warmup: int = 5) -> tuple[float, float, float]:
    """Median seconds of a tick that wakes exactly `due_ids`, of an empty tick, and of the read
    of the next wake time that follows each tick (`queries.next_wake`)."""
    from django.utils import timezone

    from durable_flow.models import RunStatus, Task, WorkflowRun
    from durable_flow.runtime.poller import TimerPoller
    from durable_flow.store import queries

    poller = TimerPoller(batch_size=500)
    waking: list[float] = []
    for n in range(warmup + ticks):
        WorkflowRun.objects.filter(id__in=due_ids).update(
            status=RunStatus.SUSPENDED, wake_at=timezone.now() - timedelta(seconds=1)
        )
        Task.objects.all().delete()
        started = time.perf_counter()
        woken = poller.tick()
        elapsed = time.perf_counter() - started
        if sorted(woken) != due_ids:
            raise SystemExit(f"tick woke {len(woken)} runs, expected exactly the {len(due_ids)} due ones")
        if n >= warmup:
            waking.append(elapsed)
    empty: list[float] = []
    for n in range(warmup + ticks):
        started = time.perf_counter()
        woken = poller.tick()
        elapsed = time.perf_counter() - started
        if woken:
            raise SystemExit(f"an empty tick woke {len(woken)} runs")
        if n >= warmup:
            empty.append(elapsed)
    planning: list[float] = []
    for n in range(warmup + ticks):
        started = time.perf_counter()
        queries.next_wake(timezone.now())
        if n >= warmup:
            planning.append(time.perf_counter() - started)
    return statistics.median(waking), statistics.median(empty), statistics.median(planning)


def park(first: int, count: int, spread: int) -> None:
    """Runs `first` to `count` - 1 parked not due: suspended (sleeping) or running (step deadline),
    due in 1 to 31 days over `spread` rows (a margin no parking phase or measurement, however slow,
    comes near)."""
    from django.db import connection
    from django.utils import timezone

    from durable_flow.models import RunStatus, WorkflowRun

    now = timezone.now()
    with reporting.progress(f"parking runs {first:,} to {count:,}", total=count - first, unit="runs") as shown:
        for offset in range(first, count, 5000):
            WorkflowRun.objects.bulk_create(
                WorkflowRun(
                    id=f"parked-{i:07d}",
                    workflow="bench.sleeper",
                    input=i,
                    status=RunStatus.RUNNING if i % 10 == 0 else RunStatus.SUSPENDED,
                    wake_at=now + timedelta(days=1) + timedelta(days=30) * (i / spread),
                )
                for i in range(offset, min(count, offset + 5000))
            )
            shown.advance(min(count, offset + 5000) - offset)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("ANALYZE durable_flow_workflowrun")
        else:
            # The bulk insert left its pages in the write-ahead log: copied back now, not by the
            # automatic checkpoint of the first commits timed after it.
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def main() -> None:
    args = parse_args()
    setup_django(args.postgres)
    from django.db import connection, connections

    from durable_flow.models import RunStatus, WorkflowRun

    vendor = connection.vendor
    sizes = sorted(int(size) for size in args.parked.split(","))
    rows: list[tuple[int, float, float, float, float]] = []  # parked, tick, empty tick, next wake, parking s
    try:
        due_ids = sorted(f"due-{i:04d}" for i in range(args.due))
        WorkflowRun.objects.bulk_create(
            [WorkflowRun(id=run_id, workflow="bench.sleeper", status=RunStatus.SUSPENDED) for run_id in due_ids]
        )
        with reporting.progress(f"timing {args.ticks} ticks with none parked"):
            rows.append((0, *measure(due_ids, args.ticks), 0.0))
        parked = 0
        for size in sizes:
            started = time.perf_counter()
            park(parked, size, sizes[-1])
            park_s, parked = time.perf_counter() - started, size
            with reporting.progress(f"timing {args.ticks} ticks with {size:,} parked"):
                rows.append((size, *measure(due_ids, args.ticks), park_s))
    finally:
        connections.close_all()
        if args.postgres:
            pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE}")

    base_wake, base_empty, base_next = rows[0][1], rows[0][2], rows[0][3]
    print(f"poller tick on {vendor}: median of {args.ticks} ticks, each waking {args.due} due runs (batch 500)")
    lines = []
    for size, wake, empty, next_wake, park_s in rows:
        parking = f"; parking took {park_s:.1f} s" if size else ""
        lines.append(
            f"{size:>7,} parked not-due runs: {wake * 1000:8.2f} ms   (empty tick {empty * 1000:.2f} ms, "
            f"next wake read {next_wake * 1000:.2f} ms{parking})" + (f"   x{wake / base_wake:.2f}" if size else "")
        )
    size, wake, empty, next_wake, _ = rows[-1]
    ratio = wake / base_wake
    verdict = "OK" if ratio < 1.5 else "OVER TARGET"
    lines.append(
        f"ratio: {ratio:.2f} at {size:,} parked (target < 1.5: {verdict}); empty-tick ratio {empty / base_empty:.2f}; "
        f"next wake read ratio {next_wake / base_next:.2f}"
    )
    print("\n".join(f"  {line}" for line in lines))
    reporting.write_json(
        "poller",
        {
            "database": vendor,
            "ticks": args.ticks,
            "due": args.due,
            "sizes": [
                {
                    "parked": size,
                    "tick_ms": wake * 1000,
                    "empty_tick_ms": empty * 1000,
                    "next_wake_ms": next_wake * 1000,
                    "parking_s": park_s,
                }
                for size, wake, empty, next_wake, park_s in rows
            ],
            "ratio": ratio,
            "empty_ratio": empty / base_empty,
            "next_wake_ratio": next_wake / base_next,
        },
        path=args.json,
        summary=lines,
        targets=[
            reporting.target(f"tick with {size:,} parked / with none", ratio, "<", 1.5),
            reporting.target(f"next wake read with {size:,} parked / with none", next_wake / base_next, "<", 1.5),
        ],
    )


if __name__ == "__main__":
    main()
