#!/usr/bin/env python
"""PostgreSQL `db` admission against a baseline checkout, in alternating rounds: the contended
cap and sliding window, and one queue's throughput with 1, 2 and 4 worker processes.

    git worktree add --detach /tmp/df-base <commit>        # the baseline (link its .venv too)
    .venv/bin/python bench/pg_admission.py --baseline /tmp/df-base            # ~10 minutes
    .venv/bin/python bench/pg_admission.py --baseline /tmp/df-base --only cap --rounds 5
    .venv/bin/python bench/pg_admission.py                                    # this tree alone

Each figure is measured on a fresh PostgreSQL database per timing, with the code of the arm
that runs it (its `bench/contention.py` child, its `durable_worker` processes):

  cap       `bench/contention.py`'s cap (concurrency 2, 50 ms steps, 200 runs over 4 fairness
            keys, 2 workers of 4 threads): steps/s vs the ideal 40/s, the handoff gap, the most
            steps running at once (must be <= 2); and its sliding window (20 per 1,000 ms):
            steady starts/s vs 20/s, the most starts in any trailing 1,000 ms (must be <= 20).
  scaling   `--runs` queued one-step workflows (`tests.queued`, queue concurrency 10, `db`
            transport and admission), P `durable_worker --concurrency 10` processes up before
            the backlog (started in one transaction), timed from the first turn taken to the
            90 % completion mark; P = 1, 2, 4, each round's ratios to its own one-process timing.

The arms alternate within each round (baseline first in even rounds, this tree first in odd
ones): a shared host's speed moves within minutes, so each round compares like with like; the
figures are the medians of the rounds, the worst round beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PROCESS_COUNTS = (1, 2, 4)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of the code to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("cap", "scaling"), help="one figure")
    parser.add_argument("--runs", type=int, default=500, help="workflows per scaling timing")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    parser.add_argument("--scaling-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    reporting.add_json_option(parser, "pg_admission")
    return parser.parse_args()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- cap: bench/contention.py's child, from the arm's tree ------------------------------------
def cap_round(arm: Path, redis_url: str) -> dict[str, Any]:
    import contention

    args = argparse.Namespace(quick=False, redis_url=redis_url)
    res = contention.run_stack(
        "db-postgres", args, script=str(arm / "bench" / "contention.py"), extra=("--scenarios", "cap,sliding")
    )
    if "error" in res:
        raise RuntimeError(f"{arm}: {res['error']}")
    return res


# -- scaling: one timing in a child process on the arm's code ---------------------------------
def scaling_timing(arm: Path, processes: int, runs: int, redis_url: str) -> float:
    database = f"durable_flow_bench_pgadm_{uuid.uuid4().hex[:8]}"
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "settings.test",
        "DJANGO_DEBUG": "0",
        "DURABLE_FLOW_TEST_ID": f"bench-pgadm-{uuid.uuid4().hex[:8]}",
        "DURABLE_FLOW_ADMISSION": "db",
        "DURABLE_FLOW_TRANSPORT": "db",
        "DURABLE_FLOW_LOG": "WARNING",
        "DATABASE_URL": f"{PG_SERVER}/{database}",
        "REDIS_URL": redis_url,
    }
    for variable in ("DURABLE_FLOW_SUBPROCESS", "DURABLE_FLOW_TEST_MARKER"):
        env.pop(variable, None)
    command = [sys.executable, __file__, "--scaling-child", str(arm), "--processes", str(processes)]
    try:
        proc = subprocess.run(
            [*command, "--runs", str(runs)], cwd=arm, env=env, stdout=subprocess.PIPE, text=True, timeout=900
        )
    finally:
        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{arm} scaling child exited {proc.returncode}")
    return float(json.loads(lines[-1])["rate"])


def scaling_child(arm: Path, processes: int, runs: int) -> None:
    from transport import steady_rate, stop, wait_until  # before the arm's path: it puts this tree's first

    sys.path.insert(0, str(arm))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from django.db import transaction

    from durable_flow import register_queue, start
    from durable_flow.models import RunStatus, WorkerHeartbeat, WorkflowRun

    queue = "bench-scaling"
    register_queue(queue, concurrency=10)
    command = [sys.executable, str(arm / "manage.py"), "durable_worker", "--concurrency", "10"]
    procs = [
        subprocess.Popen(command, cwd=arm, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        up = WorkerHeartbeat.objects.filter(stopped_at__isnull=True)
        wait_until(lambda: up.count() >= processes, procs, "workers up")
        with transaction.atomic():
            for i in range(runs):
                start("tests.queued", {"queue": queue, "id": i}, run_id=f"s-{i:06d}")
        ours = WorkflowRun.objects.filter(id__startswith="s-")
        rate = steady_rate(
            lambda: ours.filter(status=RunStatus.COMPLETED).count(),
            runs,
            procs,
            timeout=600,
            begun=ours.filter(turns__gt=0).exists,
        )
    finally:
        stop(procs)
    print(json.dumps({"rate": rate}))


# -- the rounds ----------------------------------------------------------------------------------
def arms(args: argparse.Namespace) -> list[tuple[str, Path]]:
    found = [("this", ROOT)]
    if args.baseline is not None:
        found.insert(0, ("baseline", args.baseline.resolve()))
    return found


def ordered(pairs: list[tuple[str, Path]], round_: int) -> list[tuple[str, Path]]:
    return pairs if round_ % 2 == 0 else pairs[::-1]


def spread(values: list[float], lower_is_better: bool = False) -> str:
    worst = max(values) if lower_is_better else min(values)
    return f"median {median(values):6.2f}  worst {worst:6.2f}  rounds " + " / ".join(f"{v:.2f}" for v in values)


def main() -> None:
    args = parse_args()
    if args.scaling_child is not None:
        scaling_child(args.scaling_child, args.processes, args.runs)
        return
    pairs = arms(args)
    cap: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in pairs}
    scaling: dict[str, dict[int, list[float]]] = {name: {p: [] for p in PROCESS_COUNTS} for name, _ in pairs}
    for round_ in range(args.rounds):
        for name, path in ordered(pairs, round_):
            if args.only in (None, "cap"):
                log(f"round {round_ + 1}: {name} cap + sliding")
                cap[name].append(cap_round(path, args.redis_url))
            if args.only in (None, "scaling"):
                for processes in PROCESS_COUNTS:
                    log(f"round {round_ + 1}: {name} {processes} process(es)")
                    scaling[name][processes].append(scaling_timing(path, processes, args.runs, args.redis_url))
    print(f"\nPostgreSQL db admission, {args.rounds} round(s), {os.cpu_count()} CPUs (a shared host: see the rounds)")
    for name, path in pairs:
        print(f"\n{name}: {path}")
        if cap[name]:
            rows = cap[name]
            print("  cap 2 x 50 ms, steps/s / 40:      " + spread([r["cap"]["steps_s"] / 40 for r in rows]))
            gaps = [r["cap"]["gap_ms"][0] for r in rows]
            print("  cap handoff gap, median ms:        " + spread(gaps, lower_is_better=True))
            print(f"  cap most running at once (<= 2):   {max(r['cap']['overlap'] for r in rows)}")
            print("  sliding 20/1 s, steady / 20:       " + spread([r["sliding"]["steady_s"] / 20 for r in rows]))
            print("  sliding from first start / 20:     " + spread([r["sliding"]["starts_s"] / 20 for r in rows]))
            print(f"  sliding most in 1,000 ms (<= 20):  {max(r['sliding']['most'] for r in rows)}")
        if any(scaling[name][1]):
            ones = scaling[name][1]
            for processes in PROCESS_COUNTS:
                rates = scaling[name][processes]
                ratios = [rate / one for rate, one in zip(rates, ones, strict=True)]
                figures = " / ".join(f"{rate:.0f}" for rate in rates)
                print(f"  {processes} process(es): {median(rates):6.1f} wf/s ({figures}); vs one: {spread(ratios)}")
    if len(pairs) == 2 and cap[pairs[0][0]] and cap[pairs[1][0]]:
        ratios = [
            new["cap"]["steps_s"] / old["cap"]["steps_s"]
            for old, new in zip(cap[pairs[0][0]], cap[pairs[1][0]], strict=True)
        ]
        print(f"\ncap steps/s, this / baseline (same round): {spread(ratios)}")
    this = pairs[-1][0]
    summary, targets = [], []
    if cap[this]:
        cap_ratio = median(r["cap"]["steps_s"] / 40 for r in cap[this])
        most = max(r["cap"]["overlap"] for r in cap[this])
        summary.append(f"{this}: contended cap {cap_ratio:.2f} of ideal, most at once {most}")
        targets.append(reporting.target(f"{this}: contended cap / ideal", cap_ratio, ">=", 0.95))
        targets.append(
            reporting.target(f"{this}: most running at once", max(r["cap"]["overlap"] for r in cap[this]), "<=", 2)
        )
    if any(scaling[this][1]):
        for processes, bound in ((2, 1.3), (4, 1.5)):
            ratio = median(rate / one for rate, one in zip(scaling[this][processes], scaling[this][1], strict=True))
            summary.append(f"{this}: {processes} processes {ratio:.2f}x one")
            targets.append(reporting.target(f"{this}: {processes} processes / one", ratio, ">=", bound))
    reporting.write_json(
        "pg_admission",
        {"rounds": args.rounds, "arms": {name: str(path) for name, path in pairs}, "cap": cap, "scaling": scaling},
        path=args.json,
        summary=summary,
        targets=targets,
    )


if __name__ == "__main__":
    main()
