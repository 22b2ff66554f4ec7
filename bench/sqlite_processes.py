#!/usr/bin/env python
"""Worker processes on the `db` transport and admission: 1, 2 and 4 processes against one.

    .venv/bin/python bench/sqlite_processes.py             # SQLite, 1,000 workflows a timing, 3 rounds
    .venv/bin/python bench/sqlite_processes.py --quick     # 500, 2 rounds
    .venv/bin/python bench/sqlite_processes.py --postgres  # PostgreSQL, one flow-control queue

SQLite (the embedded default) has one writer at a time: every worker process's write
transactions (a claim, a turn, a result) queue for the database's write lock, so a second
process adds threads waiting for the lock as much as it adds CPU. Target: with 2 and with 4
processes, at least the throughput of one (ratio >= 1.0; noise allowing, the ratio is printed
as it is). `--runs` one-step no-op workflows (`tests.slow_one`, no queue), workers
`durable_worker --concurrency 8`.

PostgreSQL (`--postgres`) takes writers side by side, so more processes on one queue should
run more: `--runs` queued one-step workflows (`tests.queued`) through one queue of concurrency
10, workers `durable_worker --concurrency 10`. Targets (`PG_GOALS`): 2 processes at least 1.3x
one, 4 at least 1.5x. The processes share the machine's cores with PostgreSQL and this script:
the core count is printed beside the curve, with a note when it is below the process count (a
ratio there is bounded by the cores, not by the code alone).

On a throwaway database (`bench/fleet.py`), the workflows are started in one transaction, then
P processes run them, timed from the first turn taken to the 90 % completion mark, the workers up
before the backlog (bench/transport.py's `steady_rate` and `wait_until`); the counts run one
after another in each of `--rounds` rounds (1, 2, 4, 1, 2, 4, ...), each timing on fresh runs,
and each round's ratios are to its own one-process timing (a shared host's speed moves within
minutes); the figures are the medians of the rounds, the worst round beside them.
"""

from __future__ import annotations

import argparse
import os
from statistics import median

import fleet
import reporting
from transport import wait_until

COUNTS = (1, 2, 4)
#: SQLite: more processes not slower than one. PostgreSQL: at least this many times one process.
SQLITE_GOALS = {2: 1.0, 4: 1.0}
PG_GOALS = {2: 1.3, 4: 1.5}
#: PostgreSQL's queue: one flow-control queue every run's step goes through.
PG_QUEUE, PG_QUEUE_CONCURRENCY = "bench-processes", 10


def timed(prefix: str, runs: int, processes: int, concurrency: int, queue: str | None) -> float:
    """Workflows/s of `processes` fresh workers over `runs` fresh workflows. The workers are up
    (their heartbeats written) before the backlog exists, which is started in one transaction,
    and the window opens at the first turn taken: a process importing Django inside it would
    count against more processes (bench/transport.py does the same)."""
    from django.db import transaction

    from durable_flow.models import WorkerHeartbeat, WorkflowRun

    procs = fleet.workers(processes, concurrency=concurrency)
    try:
        # By process id: a worker's name is stable (the lowest free `w<n>` of the host), so these
        # workers take the names the previous timing's workers left.
        up = WorkerHeartbeat.objects.filter(stopped_at__isnull=True, pid__in=[proc.pid for proc in procs])
        wait_until(lambda: up.count() >= processes, procs, "workers up")
        with transaction.atomic():
            fleet.start_runs(prefix, runs, queue=queue)
        turned = WorkflowRun.objects.filter(id__gte=f"{prefix}-", id__lt=f"{prefix}.", turns__gt=0)
        return fleet.steady_rate(lambda: fleet.completed(prefix), runs, procs, timeout=900, begun=turned.exists)
    finally:
        fleet.stop(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL (one queue) instead of SQLite")
    parser.add_argument("--quick", action="store_true", help="500 workflows a timing, 2 rounds")
    parser.add_argument("--runs", type=int, default=None, help="workflows a timing (default 1,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of 1, 2, 4 processes (default 3)")
    reporting.add_json_option(parser, "sqlite_processes")
    args = parser.parse_args()
    runs = args.runs or (500 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 3)
    if rounds < 1 or runs < 10:
        raise SystemExit("--rounds: at least 1; --runs: at least 10")
    name = "sqlite_processes_postgres" if args.postgres else "sqlite_processes"
    goals = PG_GOALS if args.postgres else SQLITE_GOALS
    concurrency = PG_QUEUE_CONCURRENCY if args.postgres else 8
    queue = PG_QUEUE if args.postgres else None
    cores = os.cpu_count() or 1
    rates: dict[int, list[float]] = {count: [] for count in COUNTS}
    with fleet.postgres_stack("processes") if args.postgres else fleet.sqlite_stack("processes"):
        if queue is not None:
            from durable_flow import register_queue

            register_queue(queue, concurrency=PG_QUEUE_CONCURRENCY)
        for round_ in range(rounds):
            for count in COUNTS:
                reporting.log(f"round {round_ + 1} of {rounds}: {count} process(es), {runs} runs")
                rates[count].append(timed(f"r{round_}p{count}", runs, count, concurrency, queue))
    if args.postgres:
        print(
            f"PostgreSQL, db transport and admission: {runs} queued one-step workflows a timing through one queue "
            f"(concurrency {PG_QUEUE_CONCURRENCY}), durable_worker --concurrency {concurrency}; {cores} CPU core(s)"
        )
    else:
        print(f"SQLite, db transport and admission: {runs} one-step workflows a timing, durable_worker --concurrency 8")
    print(f"worker processes vs one, medians of {rounds} rounds (each round's ratios to its own one-process timing)")
    ratios: dict[int, float] = {}
    worst: dict[int, float] = {}
    lines = []
    for count in COUNTS:
        each = [rate / one for rate, one in zip(rates[count], rates[1], strict=True)]
        ratios[count], worst[count] = median(each), min(each)
        figures = " / ".join(f"{rate:.0f}" for rate in rates[count])
        rate = median(rates[count])
        bar = "#" * round(ratios[count] * 20)
        lines.append(
            f"{count} process(es): {rate:7.1f} wf/s (rounds {figures}); ratio to one {ratios[count]:.2f} "
            f"(worst round {worst[count]:.2f}) {bar}"
        )
        print(f"  {lines[-1]}")
    targets = [
        reporting.target(f"{count} processes / one, median of the rounds", ratios[count], ">=", goal)
        for count, goal in goals.items()
    ]
    cells = " / ".join(f"{ratios[count]:.2f} (>= {goal:g})" for count, goal in goals.items())
    met = "met" if all(entry["met"] for entry in targets) else "MISSED"
    lines.append(f"target: {', '.join(str(count) for count in goals)} processes vs one: {cells}: {met}")
    print(lines[-1])
    crowded = [count for count in COUNTS if count > cores]
    if crowded:
        lines.append(
            f"note: {cores} CPU core(s) for {', '.join(map(str, crowded))} worker processes, the database server and "
            "this script: past the cores, processes take turns on them, and the ratio shows the cores' bound as "
            "much as the code's"
        )
        print(lines[-1])
    reporting.write_json(
        name,
        {
            "database": "postgresql" if args.postgres else "sqlite",
            "cpus": cores,
            "runs": runs,
            "rounds": rounds,
            "wf_s": rates,
            "ratios": ratios,
            "worst": worst,
        },
        path=args.json if args.json is not None else reporting.default_path(name),
        summary=lines,
        targets=targets,
    )


if __name__ == "__main__":
    main()
