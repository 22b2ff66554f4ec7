#!/usr/bin/env python
"""Does a purge of finished runs slow the workload running beside it?

    .venv/bin/python bench/retention.py                  # 100,000 finished runs to purge
    .venv/bin/python bench/retention.py --history 20000 --runs 300 --rounds 3
    .venv/bin/python bench/retention.py --postgres       # PostgreSQL (its own databases, dropped after)

On the embedded default (SQLite file of its own, `db` transport and admission; or PostgreSQL
with `--postgres`), `--history` completed runs are bulk-inserted as the engine leaves them (the
run, its step's checkpoint and the attempt row, finished a day ago), and the database is kept (a
file; a template database on PostgreSQL). Each round then times, from a fresh copy of it both
times, one `durable_worker --concurrency 8` over `--runs` one-step no-op workflows started up
front (bench/transport.py's `steady_rate`, between the 10 % and 90 % completion marks): once
alone, once with `manage.py durable_purge --older-than 1h` deleting the history beside it, in
batches of `--batch-size` with `--pause-ms` between them (the poller's pace by default:
`PURGE_BATCHES` batches of `PURGE_BATCH_SIZE` per `MAINTENANCE_S` is 1000 runs a second). The
order of the two alternates from round to round. The figure is the workload's rate with the
purge over its rate alone, the median of the rounds (target >= 0.9, a tenth slower at most),
with the worst round and how many runs the purge deleted during each timing (a purge that ran
out of history before the workload ended is flagged: the timing was partly without it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median

import fleet
import history
import reporting


def backdate_history(count: int) -> None:
    """Created a minute before they finished, as the engine leaves them (`bulk_create` stamps
    `created_at` now), in transactions of `history.BATCH` runs."""
    from datetime import timedelta

    from django.db import transaction
    from django.utils import timezone

    from durable_flow.models import WorkflowRun

    created = timezone.now() - timedelta(days=1, minutes=1)
    for offset in range(0, count, history.BATCH):
        ids = [f"history-{i:07d}" for i in range(offset, min(count, offset + history.BATCH))]
        with transaction.atomic():
            WorkflowRun.objects.filter(id__in=ids).update(created_at=created)


PG_SERVER = "postgres://postgres@127.0.0.1:5432"


def pg_admin(*statements: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql)


@contextmanager
def pg_stack() -> Iterator[tuple[Callable[[], None], Callable[[], None]]]:
    """`fleet.sqlite_stack` on PostgreSQL: a database of its own, and (keep, put back) that
    save it as a template database and make it that template's copy again."""
    work, loaded = f"bench_retention_{os.getpid()}", f"bench_retention_{os.getpid()}_loaded"
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": f"bench-retention-{os.getpid()}",
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_ADMISSION": "db",
            "DURABLE_FLOW_LOG": "WARNING",
            "DJANGO_DEBUG": "0",
            "DATABASE_URL": f"{PG_SERVER}/{work}",
        }
    )
    for variable in ("DURABLE_FLOW_SUBPROCESS", "DURABLE_FLOW_TEST_MARKER"):
        os.environ.pop(variable, None)
    pg_admin(f"DROP DATABASE IF EXISTS {work}", f"DROP DATABASE IF EXISTS {loaded}", f"CREATE DATABASE {work}")
    import django
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    call_command("migrate", verbosity=0)

    def copy(source: str, target: str) -> None:
        connections.close_all()
        pg_admin(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname IN ('{source}', '{target}') "
            "AND pid <> pg_backend_pid()",
            f"DROP DATABASE IF EXISTS {target}",
            f"CREATE DATABASE {target} TEMPLATE {source}",
        )

    try:
        yield (lambda: copy(work, loaded)), (lambda: copy(loaded, work))
    finally:
        connections.close_all()
        pg_admin(f"DROP DATABASE IF EXISTS {work} WITH (FORCE)", f"DROP DATABASE IF EXISTS {loaded} WITH (FORCE)")


@contextmanager
def sqlite_stack() -> Iterator[tuple[Callable[[], None], Callable[[], None]]]:
    """`fleet.sqlite_stack`, with (keep, put back) over a copy of its file."""
    with fleet.sqlite_stack("retention"):
        loaded = history.database_file().with_suffix(".loaded")
        try:
            yield (lambda: history.keep(loaded)), (lambda: history.put_back(loaded))
        finally:
            Path(loaded).unlink(missing_ok=True)


def count_history() -> int:
    from durable_flow.models import WorkflowRun

    return WorkflowRun.objects.filter(id__gte="history-", id__lt="history.").count()


BATCH_MS = re.compile(r"^batch: .* \((\d+) ms\)$", re.MULTILINE)


def timed(prefix: str, runs: int, purge: list[str] | None) -> tuple[float, int, bool, list[int]]:
    """Workflows/s of one fresh worker over `runs` fresh workflows, with `purge` (a command
    line) running beside it or not; the history runs deleted meanwhile, and whether the purge
    was still running when the timing ended."""
    fleet.start_runs(prefix, runs)
    before = count_history()
    purging = None
    if purge is not None:
        # Started first, and given until its first batch: a process's start-up is not the purge.
        log = fleet.ROOT / "var" / f"bench-retention-{prefix}.log"
        with open(log, "wb") as out:
            purging = subprocess.Popen(purge, cwd=fleet.ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "batch:" not in log.read_text() and purging.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if "batch:" not in log.read_text():
            raise SystemExit(f"the purge did not start: {log.read_text()[-2000:]}")
    procs = fleet.workers(1, concurrency=8)
    try:
        rate = fleet.steady_rate(lambda: fleet.completed(prefix), runs, procs, timeout=900)
        still = purging is not None and purging.poll() is None
    finally:
        fleet.stop(procs)
        if purging is not None and purging.poll() is None:
            purging.terminate()  # between or inside a batch: either way no orphan row
            purging.wait(60)
    took: list[int] = []
    if purge is not None:
        took = [int(ms) for ms in BATCH_MS.findall(log.read_text())]
        log.unlink()
    return rate, before - count_history(), still, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=100_000, help="finished runs to purge (default 100,000)")
    parser.add_argument("--runs", type=int, default=600, help="workflows timed per phase (default 600)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (the median)")
    parser.add_argument("--batch-size", type=int, default=500, help="runs per purge transaction (500)")
    parser.add_argument("--pause-ms", type=int, default=500, help="pause between purge batches (500)")
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL instead of SQLite")
    reporting.add_json_option(parser, "retention")
    args = parser.parse_args()
    if min(args.rounds, args.runs, args.history) < 1:
        raise SystemExit("--rounds, --runs, --history: at least 1")
    alone: list[float] = []
    beside: list[float] = []
    deleted: list[int] = []
    partial = 0
    batch_ms: list[int] = []
    purge = [
        sys.executable,
        str(fleet.ROOT / "manage.py"),
        "durable_purge",
        "--older-than",
        "1h",
        "--batch-size",
        str(args.batch_size),
        "--pause-ms",
        str(args.pause_ms),
    ]
    with pg_stack() if args.postgres else sqlite_stack() as (keep, put_back):
        started = time.perf_counter()
        history.add_history(args.history)
        backdate_history(args.history)
        insert_s = time.perf_counter() - started
        keep()
        for round_ in range(args.rounds):
            order = ("alone", "beside") if round_ % 2 == 0 else ("beside", "alone")
            reporting.log(f"round {round_ + 1} of {args.rounds}: {args.runs} runs {order[0]}, then {order[1]}")
            for phase in order:
                put_back()
                rate, gone, still, took = timed(f"{phase}{round_}", args.runs, purge if phase == "beside" else None)
                if phase == "alone":
                    alone.append(rate)
                else:
                    beside.append(rate)
                    deleted.append(gone)
                    batch_ms.extend(took)
                    partial += not still
    ratios = [b / a for a, b in zip(alone, beside, strict=True)]
    ratio = median(ratios)
    pairs = " / ".join(f"{a:.0f}:{b:.0f}" for a, b in zip(alone, beside, strict=True))
    verdict = "within" if ratio >= 0.9 else "SLOWER"
    print(
        f"a workload beside a purge of {args.history:,} finished runs "
        f"({'PostgreSQL' if args.postgres else 'SQLite'}, db transport, 1 worker x 8 threads, "
        f"{args.runs} runs; purge batches of {args.batch_size}, {args.pause_ms} ms apart)"
    )
    lines = [
        f"alone:        {median(alone):7.1f} wf/s   (median of {args.rounds})",
        f"beside purge: {median(beside):7.1f} wf/s   (history inserted in {insert_s:.1f} s)",
        f"rounds, alone:beside wf/s {pairs}; ratios {' / '.join(f'{r:.2f}' for r in ratios)}",
        f"runs the purge deleted while timed: {' / '.join(map(str, deleted))}"
        + (f" ({partial} timing(s) outlived the purge)" if partial else ""),
        f"a purge batch's transaction and its read, ms: median {median(batch_ms):.0f}, "
        f"worst {max(batch_ms)} ({len(batch_ms)} batches)",
        f"beside / alone, median of the rounds: {ratio:.2f} (target >= 0.9, a slow-down of at most 10 %: {verdict})",
        f"worst round: {min(ratios):.2f}",
    ]
    print("\n".join(f"  {line}" for line in lines))
    reporting.write_json(
        "retention",
        {
            "database": "postgresql" if args.postgres else "sqlite",
            "history_runs": args.history,
            "timed_runs": args.runs,
            "batch_size": args.batch_size,
            "pause_ms": args.pause_ms,
            "insert_s": insert_s,
            "alone_wf_s": alone,
            "beside_wf_s": beside,
            "deleted_while_timed": deleted,
            "timings_outliving_the_purge": partial,
            "batch_ms": batch_ms,
            "ratios": ratios,
            "ratio": ratio,
            "worst": min(ratios),
        },
        path=args.json,
        summary=lines,
        targets=[reporting.target("beside a purge / alone, median of the rounds", ratio, ">=", 0.9)],
    )


if __name__ == "__main__":
    main()
