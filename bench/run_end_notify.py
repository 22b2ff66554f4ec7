#!/usr/bin/env python
"""The run-end notification's cost on PostgreSQL: every finishing transaction notifying, against
notifying only while a wait holds the run's lock (`store/run_bells.py`).

    .venv/bin/python bench/run_end_notify.py                  # 8 threads, 4 rounds of 2 x 5 s
    .venv/bin/python bench/run_end_notify.py --threads 16 --seconds 10

On a fresh database, `--threads` threads (each on its own connection) commit, as fast as they
can for `--seconds`, what a run's end commits besides its other writes: an UPDATE of a run's row
and the run-end announcement in the same transaction, in one of two arms:

* `always`: `SELECT pg_notify(channel, run_id)` (every run's end, as before the gate);
* `gated`: `run_bells.finished(run_id)`, the same statement with the advisory-lock check: no
  notification, as nobody waits for these runs.

Both arms send the same statements; a process listening on the runs' channel (one caller that
once waited) stays connected throughout, as in a deployment. The arms alternate for `--rounds`
rounds (the host's speed moves within minutes); printed: transactions per second and each
transaction's p50/p99 latency, the median over the rounds, and the gated/always ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
from services import PG_SERVER, percentiles, pg_admin  # noqa: E402 - bench/ is on the path of a script run from it

DATABASE = f"durable_flow_bench_run_end_{os.getpid()}"
ARMS = ("always", "gated")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8, help="committing threads (connections)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per arm and round")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    parser.add_argument("--runs", type=int, default=1000, help="runs whose rows the transactions update")
    reporting.add_json_option(parser, "run_end_notify")
    return parser.parse_args()


def setup(args: argparse.Namespace) -> list[str]:
    pg_admin(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    pg_admin(f"CREATE DATABASE {DATABASE}")
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DJANGO_DEBUG": "0",
            "DURABLE_FLOW_TEST_ID": "bench-run-end",
            "DATABASE_URL": f"{PG_SERVER}/{DATABASE}",
        }
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from durable_flow.models import RunStatus, WorkflowRun

    runs = [WorkflowRun(workflow="bench.run_end", status=RunStatus.RUNNING) for _ in range(args.runs)]
    return [run.pk for run in WorkflowRun.objects.bulk_create(runs)]


def arm_round(arm: str, run_ids: list[str], args: argparse.Namespace) -> dict[str, float]:
    """`--threads` threads committing run ends for `--seconds`: transactions/s and latencies."""
    from django.db import connections, transaction
    from django.utils import timezone

    from durable_flow.models import WorkflowRun
    from durable_flow.store import run_bells
    from durable_flow.store.statements import notify

    stop = threading.Event()
    start = threading.Barrier(args.threads + 1)
    latencies: list[list[float]] = [[] for _ in range(args.threads)]

    def commit_ends(index: int) -> None:
        try:
            mine = run_ids[index :: args.threads]
            start.wait()
            n = 0
            while not stop.is_set():
                run_id = mine[n % len(mine)]
                n += 1
                began = time.perf_counter()
                with transaction.atomic():
                    WorkflowRun.objects.filter(pk=run_id).update(updated_at=timezone.now())
                    if arm == "always":
                        notify(run_bells.CHANNEL, run_id)
                    else:
                        run_bells.finished(run_id)
                latencies[index].append(time.perf_counter() - began)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=commit_ends, args=(i,), daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    elapsed = time.perf_counter() - began
    every = [value for per_thread in latencies for value in per_thread]
    spread = percentiles(every)
    return {"tx_per_s": len(every) / elapsed, "p50_ms": spread["p50"], "p99_ms": spread["p99"]}


def main() -> None:
    args = parse_args()
    run_ids = setup(args)
    import psycopg
    from django.db import connection

    from durable_flow.store import run_bells

    listener = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    listener.execute(f"LISTEN {run_bells.CHANNEL}")
    drained = threading.Event()

    def drain() -> None:  # a listening process consumes what it is sent
        while not drained.is_set():
            for _ in listener.notifies(timeout=0.5):
                pass

    draining = threading.Thread(target=drain, daemon=True)
    draining.start()
    print(
        f"Run-end announcements on PostgreSQL: {args.threads} threads, {args.seconds:.0f} s an arm, "
        f"{args.rounds} alternating rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rounds: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    try:
        for round_no in range(1, args.rounds + 1):
            for arm in ARMS if round_no % 2 else reversed(ARMS):
                figures = arm_round(arm, run_ids, args)
                rounds[arm].append(figures)
                print(
                    f"  round {round_no} {arm:<7} {figures['tx_per_s']:8.0f} tx/s  "
                    f"p50 {figures['p50_ms']:.2f} ms  p99 {figures['p99_ms']:.2f} ms",
                    flush=True,
                )
    finally:
        drained.set()
        draining.join(5)
        listener.close()
        connection.close()
        pg_admin(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    folded = {arm: {key: median(r[key] for r in rounds[arm]) for key in rounds[arm][0]} for arm in ARMS}
    ratios: dict[str, float] = {
        key: median(g[key] / a[key] for g, a in zip(rounds["gated"], rounds["always"], strict=True))
        for key in folded["gated"]
    }
    print()
    for arm in ARMS:
        f = folded[arm]
        print(f"  {arm:<7} {f['tx_per_s']:8.0f} tx/s  p50 {f['p50_ms']:.2f} ms  p99 {f['p99_ms']:.2f} ms (medians)")
    print(
        f"  gated / always, median of the rounds' ratios: tx/s {ratios['tx_per_s']:.2f}, "
        f"p50 {ratios['p50_ms']:.2f}, p99 {ratios['p99_ms']:.2f}"
    )
    reporting.write_json(
        "run_end_notify",
        {"threads": args.threads, "seconds": args.seconds, "rounds": rounds, "medians": folded, "ratios": ratios},
        path=args.json,
        summary=[f"gated / always: {ratios['tx_per_s']:.2f}x the transactions/s, p99 {ratios['p99_ms']:.2f}x"],
        targets=[reporting.target("gated / always, transactions/s", ratios["tx_per_s"], ">=", 0.95)],
    )


if __name__ == "__main__":
    main()
