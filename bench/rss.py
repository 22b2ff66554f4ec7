#!/usr/bin/env python
"""Does a worker's memory stay flat over thousands of workflows (no leak per task)?

    .venv/bin/python bench/rss.py              # 5,000 one-step workflows (~3 minutes)
    .venv/bin/python bench/rss.py --quick      # 1,000

On the embedded default (SQLite file of its own, `db` transport and admission), `--runs`
one-step no-op workflows are started, then one `durable_worker --concurrency 8` runs them all.
The bench reads the worker's resident set from /proc (psutil) every 0.2 s along with how many
runs have completed. The baseline is the worker itself early in the same run: the median RSS
while the first quarter of the runs completes (from the first completion on: before it the
worker is still starting), against the median while the last quarter does
(target: last / first <= 1.10; a leak of even 1 KiB per workflow would show as ~5 MiB over 5,000).
The RSS at each tenth of the runs is printed too (bench/run_all.py plots it), and the growth
per workflow over the second half. DEBUG is off, as deployed (bench/fleet.py says why).
"""

from __future__ import annotations

import argparse
import statistics
import time

import fleet
import psutil
import reporting

PREFIX = "rss"


def sample(worker: psutil.Process, total: int, timeout: float) -> list[tuple[int, int]]:
    """(completed runs, worker RSS bytes) every 0.2 s until every run completed."""
    samples: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    shown = reporting.Progress("worker running the workflows", total=total, unit="completed")
    while time.monotonic() < deadline:
        done = fleet.completed(PREFIX)
        samples.append((done, worker.memory_info().rss))
        shown.update(done)
        if done >= total:
            return samples
        time.sleep(0.2)
    raise RuntimeError(f"timed out: {fleet.completed(PREFIX)} of {total} runs completed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000 workflows")
    parser.add_argument("--runs", type=int, default=None, help="workflows (default 5,000)")
    reporting.add_json_option(parser, "rss")
    args = parser.parse_args()
    runs = args.runs or (1000 if args.quick else 5000)
    with fleet.sqlite_stack("rss"):
        started = time.perf_counter()
        fleet.start_runs(PREFIX, runs)
        start_s = time.perf_counter() - started
        procs = fleet.workers(1, concurrency=8)
        try:
            samples = sample(psutil.Process(procs[0].pid), runs, timeout=1800)
        finally:
            fleet.stop(procs)
    mib = 1024 * 1024
    # From the first completed run on: before it the worker is still importing Django.
    first = statistics.median(rss for done, rss in samples if 0 < done < runs / 4) / mib
    last = statistics.median(rss for done, rss in samples if done >= runs * 3 / 4) / mib
    tenths = [next(rss for done, rss in samples if done >= runs * k / 10) / mib for k in range(1, 11)]
    ratio = last / first
    slope = (tenths[-1] - tenths[4]) * 1024 / (runs / 2)
    verdict = "flat" if ratio <= 1.10 else "GROWING"
    print(f"worker RSS over {runs:,} one-step workflows (SQLite, db transport, 1 worker x 8 threads)")
    print(f"  started in {start_s:.1f} s; {len(samples)} samples of /proc, every 0.2 s")
    print(f"  rss MiB at each tenth of the runs: {' '.join(f'{value:.1f}' for value in tenths)}")
    lines = [
        f"median RSS: first quarter {first:.1f} MiB, last quarter {last:.1f} MiB",
        f"growth over the second half of the runs: {slope:.2f} KiB per workflow",
        f"ratio last / first quarter: {ratio:.3f} (target <= 1.10: {verdict})",
    ]
    print("\n".join(f"  {line}" for line in lines))
    reporting.write_json(
        "rss",
        {
            "runs": runs,
            "start_s": start_s,
            "samples": len(samples),
            "tenths_mib": tenths,
            "first_quarter_mib": first,
            "last_quarter_mib": last,
            "growth_kib_per_workflow": slope,
            "ratio": ratio,
        },
        path=args.json,
        summary=lines,
        targets=[reporting.target("RSS last / first quarter", ratio, "<=", 1.10)],
    )


if __name__ == "__main__":
    main()
