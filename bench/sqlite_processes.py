#!/usr/bin/env python
"""On the embedded default, are more worker processes slower than one?

    .venv/bin/python bench/sqlite_processes.py            # 1,000 workflows a timing, 3 rounds (~2 minutes)
    .venv/bin/python bench/sqlite_processes.py --quick    # 500, 2 rounds

SQLite has one writer at a time: every worker process's write transactions (a claim, a turn, a
result) queue for the database's write lock, so a second process adds threads waiting for the
lock as much as it adds CPU (issue 15 measured 71 % of a worker thread's time waiting for it,
and a second process made the queued path slower). Target: with 2 and with 4 processes, at
least the throughput of one (ratio >= 1.0; noise allowing, the ratio is printed as it is).

On a throwaway SQLite file (`db` transport and admission, `bench/fleet.py`), `--runs` one-step
no-op workflows are started, then P `durable_worker --concurrency 8` processes run them, timed
from the first turn taken to the 90 % completion mark, the workers up before the backlog
(bench/transport.py's `steady_rate` and `wait_until`); the counts
run one after another in each of `--rounds` rounds (1, 2, 4, 1, 2, 4, ...), each timing on
fresh runs, and each round's ratios are to its own one-process timing (a shared host's speed
moves within minutes); the figures are the medians of the rounds.
"""

from __future__ import annotations

import argparse
from statistics import median

import fleet
import reporting
from transport import wait_until


def timed(prefix: str, runs: int, processes: int) -> float:
    """Workflows/s of `processes` fresh workers over `runs` fresh workflows. The workers are up
    (their heartbeats written) before the backlog exists, which is started in one transaction,
    and the window opens at the first turn taken: a process importing Django inside it would
    count against more processes (bench/transport.py does the same)."""
    from django.db import transaction

    from durable_flow.models import WorkerHeartbeat, WorkflowRun

    procs = fleet.workers(processes, concurrency=8)
    try:
        # By process id: a worker's name is stable (the lowest free `w<n>` of the host), so these
        # workers take the names the previous timing's workers left.
        up = WorkerHeartbeat.objects.filter(stopped_at__isnull=True, pid__in=[proc.pid for proc in procs])
        wait_until(lambda: up.count() >= processes, procs, "workers up")
        with transaction.atomic():
            fleet.start_runs(prefix, runs)
        turned = WorkflowRun.objects.filter(id__gte=f"{prefix}-", id__lt=f"{prefix}.", turns__gt=0)
        return fleet.steady_rate(lambda: fleet.completed(prefix), runs, procs, timeout=900, begun=turned.exists)
    finally:
        fleet.stop(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="500 workflows a timing, 2 rounds")
    parser.add_argument("--runs", type=int, default=None, help="workflows a timing (default 1,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of 1, 2, 4 processes (default 3)")
    reporting.add_json_option(parser, "sqlite_processes")
    args = parser.parse_args()
    runs = args.runs or (500 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 3)
    if rounds < 1 or runs < 10:
        raise SystemExit("--rounds: at least 1; --runs: at least 10")
    counts = (1, 2, 4)
    rates: dict[int, list[float]] = {count: [] for count in counts}
    with fleet.sqlite_stack("processes"):
        for round_ in range(rounds):
            for count in counts:
                reporting.log(f"round {round_ + 1} of {rounds}: {count} process(es), {runs} runs")
                rates[count].append(timed(f"r{round_}p{count}", runs, count))
    print(f"SQLite, db transport and admission: {runs} one-step workflows a timing, durable_worker --concurrency 8")
    print(f"worker processes vs one, medians of {rounds} rounds (each round's ratios to its own one-process timing)")
    ratios: dict[int, float] = {}
    lines = []
    for count in counts:
        each = [rate / one for rate, one in zip(rates[count], rates[1], strict=True)]
        ratios[count] = median(each)
        figures = " / ".join(f"{rate:.0f}" for rate in rates[count])
        rate = median(rates[count])
        lines.append(f"{count} process(es): {rate:7.1f} wf/s (rounds {figures}); ratio to one {ratios[count]:.2f}")
        print(f"  {lines[-1]}")
    verdict = "met" if min(ratios[2], ratios[4]) >= 1.0 else "MISSED"
    lines.append(
        f"target: 2 and 4 processes not slower than one (ratio >= 1.0): {ratios[2]:.2f} / {ratios[4]:.2f}: {verdict}"
    )
    print(lines[-1])
    reporting.write_json(
        "sqlite_processes",
        {"runs": runs, "rounds": rounds, "wf_s": rates, "ratios": ratios},
        path=args.json,
        summary=lines,
        targets=[reporting.target(f"{count} processes / one", ratios[count], ">=", 1.0) for count in (2, 4)],
    )


if __name__ == "__main__":
    main()
