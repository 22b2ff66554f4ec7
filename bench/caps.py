#!/usr/bin/env python
"""Contended throughput against the cap: does a queue of concurrency N run N times the steps?

    .venv/bin/python bench/caps.py                      # caps 1, 2, 4, 8 on db-sqlite and rq-redis
    .venv/bin/python bench/caps.py --quick              # 60 runs per cap instead of 150
    .venv/bin/python bench/caps.py --stacks rq-redis --caps 1,4

For each cap, `--runs` runs of `tests.queued` (a 50 ms step) go through a fresh FIFO queue of
that concurrency, run by 2 `durable_worker --concurrency 4` processes and a `durable_poller`
(8 worker threads, so a cap of 8 can still be filled). Steps/s is read from the stamps the step
writes when it is called, between the 10 % and 90 % start marks, as in bench/contention.py (whose
stack set-up and `scenario` this reuses: same stacks, same throwaway databases). The baseline is
the cap's ideal, N / 50 ms, and the cap of 1 measured in the same run: a handoff chain that costs
the same per slot scales linearly, so steps/s at cap N over steps/s at cap 1 should be near N
until the threads or the CPU run out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contention
import reporting

STEP_S = 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 runs per cap instead of 150")
    parser.add_argument("--caps", default="1,2,4,8", help="comma-separated queue concurrencies")
    parser.add_argument(
        "--stacks", default=None, help="of db-sqlite, db-postgres, rq-redis (default the first and last)"
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per cap (default 150, --quick 60)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    parser.add_argument("--child", choices=list(contention.STACKS), help=argparse.SUPPRESS)
    reporting.add_json_option(parser, "caps")
    return parser.parse_args()


def child(stack: str, caps: list[int], runs: int) -> None:
    """One stack: a scenario per cap; prints {cap: figures} as the last line."""
    contention.setup_django()
    admission, transport, _ = contention.STACKS[stack]
    prefix = f"df:test:{os.environ['DURABLE_FLOW_TEST_ID']}" if admission == "redis" else ""
    workdir = Path(tempfile.mkdtemp(prefix="bench-caps-"))
    out: dict[str, Any] = {}
    try:
        for cap in caps:
            if transport == "rq":
                contention.clear_rq()
            contention.log(f"cap {cap}")
            out[str(cap)] = contention.scenario(workdir, f"cap{cap}", runs, concurrency=cap, seconds=STEP_S)
    finally:
        if transport == "rq":
            contention.clear_rq()
        if prefix:
            contention.clear_prefix(prefix)
        from django.db import connections

        connections.close_all()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(out))


def report(results: dict[str, dict[str, Any]], caps: list[int], runs: int) -> list[str]:
    """Print the table; return its scaling lines (the summary)."""
    print(
        f"{runs} runs per cap, {STEP_S * 1000:.0f} ms steps, 2 workers x 4 threads + a poller; steps/s from the stamps"
    )
    print(
        f"{'stack':<12}{'cap':>4}{'steps/s':>9}{'ideal':>7}{'of ideal':>9}{'x cap 1':>8}{'gap p50 ms':>11}{'turns':>6}"
    )
    summary = []
    for stack, figures in results.items():
        if "error" in figures:
            print(f"{stack:<12} failed: {figures['error']}")
            summary.append(f"{stack}: failed: {figures['error']}")
            continue
        base = figures[str(caps[0])]["steps_s"] / caps[0]
        for cap in caps:
            row = figures[str(cap)]
            ideal = cap / STEP_S
            print(
                f"{stack:<12}{cap:>4}{row['steps_s']:>9.1f}{ideal:>7.0f}{row['steps_s'] / ideal:>9.2f}"
                f"{row['steps_s'] / base:>8.2f}{row['gap_ms'][0]:>11.0f}{row['turns_max']:>6}"
            )
        top = figures[str(caps[-1])]["steps_s"] / base
        summary.append(
            f"{stack}: scaling ratio cap {caps[-1]} / cap {caps[0]}: {top:.2f} (ideal {caps[-1] / caps[0]:g})"
        )
        print(f"  {summary[-1]}")
    return summary


def main() -> None:
    args = parse_args()
    caps = sorted(int(cap) for cap in args.caps.split(","))
    runs = args.runs or (60 if args.quick else 150)
    if args.child:
        child(args.child, caps, runs)
        return
    stacks = (args.stacks or "db-sqlite,rq-redis").split(",")
    if any(contention.STACKS[name][1] == "rq" for name in stacks if name in contention.STACKS):
        from services import require_own_redis_database

        require_own_redis_database(args.redis_url)  # it clears `rq:*` and its workers pop `durable`
    extra = ("--caps", args.caps, "--runs", str(runs))
    results = {}
    for stack in stacks:
        reporting.log(f"{stack}: caps {args.caps}, {runs} runs each")
        results[stack] = contention.run_stack(stack, args, script=__file__, extra=extra)
    summary = report(results, caps, runs)
    reporting.write_json(
        "caps",
        {"runs": runs, "step_s": STEP_S, "caps": caps, "stacks": results},
        path=args.json,
        summary=summary,
    )


if __name__ == "__main__":
    main()
