#!/usr/bin/env python
"""Does throughput hold when the tables carry a long history of finished runs?

    .venv/bin/python bench/history.py             # 100,000 completed runs of history (~3 minutes)
    .venv/bin/python bench/history.py --quick     # 20,000, fewer runs timed

On the embedded default (SQLite file of its own, `db` transport and admission), one
`durable_worker --concurrency 8` runs `--runs` one-step no-op workflows started up front, and
the bench times them between the 10 % and 90 % completion marks (bench/transport.py's
`steady_rate`), first on empty tables: the baseline. Then `--history` completed runs of the same
workflow are bulk-inserted as the engine leaves them (the run, its step's checkpoint and the
attempt row), and the same number of fresh workflows is timed again with a fresh worker.
A hot path that reads by primary key and partial indexes does not see the history
(target: with history / empty >= 0.9, noise allowing; the ratio is printed as it is).

The two databases are kept as files (the empty one, and the one with the history), and
`--rounds` rounds (5) each time both from a copy of their file, alternately (empty, with history,
empty, ...): the ratio is the median of each round's ratio. On a shared host whose speed moves
within minutes, one pair of timings a few minutes apart (the history's insertion between them)
read 0.87 and 1.16 in two runs of the same code.
"""

from __future__ import annotations

import argparse
import shutil
import time
from datetime import datetime, timedelta
from pathlib import Path
from statistics import median

import fleet
import reporting

BATCH = 1000  # a progress line can follow every few batches on a loaded host


def add_history(count: int) -> None:
    """`count` completed one-step runs, each with its completed checkpoint and attempt row."""
    from django.utils import timezone

    now = timezone.now() - timedelta(days=1)
    with reporting.progress("inserting history", total=count, unit="runs") as shown:
        for offset in range(0, count, BATCH):
            insert_batch([f"history-{i:07d}" for i in range(offset, min(count, offset + BATCH))], now)
            shown.advance(min(count, offset + BATCH) - offset)


def insert_batch(ids: list[str], now: datetime) -> None:
    """Completed runs `ids`, their checkpoints and attempts, in one transaction."""
    from django.db import transaction

    from durable_flow.models import AttemptStatus, RunStatus, StepAttempt, StepCheckpoint, StepStatus, WorkflowRun

    with transaction.atomic():
        WorkflowRun.objects.bulk_create(
            WorkflowRun(
                id=run_id,
                workflow=fleet.WORKFLOW,
                status=RunStatus.COMPLETED,
                input={"id": run_id, "seconds": 0},
                output={"id": run_id},
                turns=2,
                finished_at=now,
            )
            for run_id in ids
        )
        checkpoints = StepCheckpoint.objects.bulk_create(
            StepCheckpoint(
                run_id=run_id,
                key="slow",
                sequence=0,
                name="tests.slow",
                status=StepStatus.COMPLETED,
                output={"id": run_id},
                attempt=1,
                dispatched_at=now,
                finished_at=now,
            )
            for run_id in ids
        )
        StepAttempt.objects.bulk_create(
            StepAttempt(
                checkpoint=checkpoint,
                run_id=checkpoint.run_id,
                attempt=1,
                status=AttemptStatus.COMPLETED,
                started_at=now,
                finished_at=now,
            )
            for checkpoint in checkpoints
        )


def timed(prefix: str, runs: int) -> float:
    """Workflows/s of one fresh worker over `runs` fresh workflows."""
    fleet.start_runs(prefix, runs)
    procs = fleet.workers(1, concurrency=8)
    try:
        return fleet.steady_rate(lambda: fleet.completed(prefix), runs, procs, timeout=900)
    finally:
        fleet.stop(procs)


def database_file() -> Path:
    from django.db import connection

    return Path(connection.settings_dict["NAME"])


def keep(copy: Path) -> None:
    """Copy the database, whole (its write-ahead log folded in first), to `copy`."""
    from django.db import connection, connections

    with connection.cursor() as cursor:
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connections.close_all()
    shutil.copyfile(database_file(), copy)


def put_back(copy: Path) -> None:
    """Make the database the file `copy` again (no process may have it open)."""
    from django.db import connections

    connections.close_all()
    database = database_file()
    for suffix in ("-wal", "-shm"):
        database.with_name(database.name + suffix).unlink(missing_ok=True)
    shutil.copyfile(copy, database)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20,000 runs of history, 200 timed")
    parser.add_argument("--history", type=int, default=None, help="completed runs inserted (default 100,000)")
    parser.add_argument("--runs", type=int, default=None, help="workflows timed per phase (default 600)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timings of each database (the median)")
    reporting.add_json_option(parser, "history")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    history = args.history or (20_000 if args.quick else 100_000)
    runs = args.runs or (200 if args.quick else 600)
    empties: list[float] = []
    loadeds: list[float] = []
    with fleet.sqlite_stack("history"):
        empty_copy = database_file().with_suffix(".empty")
        loaded_copy = database_file().with_suffix(".loaded")
        try:
            keep(empty_copy)
            started = time.perf_counter()
            add_history(history)
            insert_s = time.perf_counter() - started
            keep(loaded_copy)
            for round_ in range(args.rounds):
                reporting.log(f"round {round_ + 1} of {args.rounds}: {runs} runs on empty tables, then with history")
                put_back(empty_copy)
                empties.append(timed(f"empty{round_}", runs))
                put_back(loaded_copy)
                loadeds.append(timed(f"loaded{round_}", runs))
        finally:
            empty_copy.unlink(missing_ok=True)
            loaded_copy.unlink(missing_ok=True)
    ratios = [loaded / empty for empty, loaded in zip(empties, loadeds, strict=True)]
    ratio = median(ratios)
    print(f"throughput with a history of completed runs (SQLite, db transport, 1 worker x 8 threads, {runs} runs)")
    pairs = " / ".join(f"{empty:.0f}:{loaded:.0f}" for empty, loaded in zip(empties, loadeds, strict=True))
    verdict = "unchanged" if ratio >= 0.9 else "SLOWER"
    lines = [
        f"empty tables:                      {median(empties):7.1f} wf/s   (median of {args.rounds})",
        f"{history:>7,} completed runs of history: {median(loadeds):7.1f} wf/s   (inserted in {insert_s:.1f} s)",
        f"rounds, empty:with history wf/s {pairs}; ratios {' / '.join(f'{r:.2f}' for r in ratios)}",
        f"ratio with history / empty, median of the rounds: {ratio:.2f} (target >= 0.9: {verdict})",
        f"worst round: {min(ratios):.2f}",
    ]
    print("\n".join(f"  {line}" for line in lines))
    reporting.write_json(
        "history",
        {
            "history_runs": history,
            "timed_runs": runs,
            "insert_s": insert_s,
            "empty_wf_s": empties,
            "loaded_wf_s": loadeds,
            "ratios": ratios,
            "ratio": ratio,
            "worst": min(ratios),
        },
        path=args.json,
        summary=lines,
        targets=[reporting.target("with history / empty, median of the rounds", ratio, ">=", 0.9)],
    )


if __name__ == "__main__":
    main()
