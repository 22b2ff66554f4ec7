#!/usr/bin/env python
"""Debounce and singleton benchmark: what each costs on the start path, and whether racing
starters ever make two runs of one key.

    .venv/bin/python bench/start_control.py                 # SQLite then PostgreSQL (~1 min)
    .venv/bin/python bench/start_control.py --only sqlite   # one database
    .venv/bin/python bench/start_control.py --quick

Same harness as `bench/quota.py` (its database setup and its transport that queues nothing, so
the cost measured is the start itself; do not run both at once, they share its bench database).

- cost: mean ms per start, interleaved in rounds of 50 in the same process, for a plain start and
  for each path of debounce and singleton: a debounce start that creates the key's pending run
  (a new key), one folded into it (the same key: lock + UPDATE instead of INSERT), a singleton
  start on a free key (lock + lookup + INSERT) and one skipped (lock + lookup, nothing written).
  Ratios are against the plain start of the same run.
- race: 50 forked processes, each with its own connection, start one key at once (a barrier);
  runs made for the key (target 1) for debounce and for singleton `skip`.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

from bench.quota import NullTransport, bench_main, setup_django  # noqa: E402

STARTERS = 50
BATCH = 50
PATHS = ("plain", "debounce: new key", "debounce: folded", "singleton: free key", "singleton: skipped")


def build_engine() -> Any:
    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.definitions.registry import workflow
    from durable_flow.engine import Engine, set_engine

    def noop(ctx: Any, input: Any) -> None:
        return None

    workflow("bench.plain")(noop)
    workflow("bench.debounced", debounce={"key": "input.k", "period": timedelta(hours=1)})(noop)
    workflow("bench.singleton", singleton={"key": "input.k", "mode": "skip"})(noop)
    engine = Engine(admission=LocalAdmissionBackend(), transport=NullTransport())  # type: ignore[arg-type]
    set_engine(engine)
    return engine


def measure_cost(engine: Any, seconds: float) -> dict[str, float]:
    """Mean ms per start on each path, interleaved in rounds so drift hits every path alike."""
    from durable_flow.models import WorkflowRun

    samples: dict[str, list[float]] = {path: [] for path in PATHS}
    calls = {
        "plain": lambda: engine.start("bench.plain", {}),
        "debounce: new key": lambda: engine.start("bench.debounced", {"k": uuid.uuid4().hex}),
        "debounce: folded": lambda: engine.start("bench.debounced", {"k": "same"}),
        "singleton: free key": lambda: engine.start("bench.singleton", {"k": uuid.uuid4().hex}),
        "singleton: skipped": lambda: engine.start("bench.singleton", {"k": "same"}),
    }
    calls["debounce: folded"]()  # the pending run every timed fold lands on
    calls["singleton: skipped"]()  # the run in progress every timed skip returns
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for path in PATHS:
            start = time.perf_counter()
            for _ in range(BATCH):
                calls[path]()
            samples[path].append((time.perf_counter() - start) / BATCH * 1000)
        # Untimed: keep the table the size of one round, as a steady workload would.
        WorkflowRun.objects.exclude(start_key="same").delete()
    return {path: statistics.mean(values) for path, values in samples.items()}


def starter(workflow: str, key: str, barrier: Any, results: Any) -> None:
    from django.db import connections

    from durable_flow.engine import get_engine

    connections.close_all()  # never share the parent's connection across fork
    try:
        barrier.wait(timeout=60)
        results.put(get_engine().start(workflow, {"k": key}).pk)
    finally:
        connections.close_all()


def race(workflow: str) -> int:
    """Runs made for one key when STARTERS processes start it at once (target 1)."""
    from django.db import connections

    from durable_flow.models import WorkflowRun

    key = f"race:{uuid.uuid4().hex[:8]}"
    connections.close_all()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(STARTERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=starter, args=(workflow, key, barrier, results)) for _ in range(STARTERS)]
    for proc in procs:
        proc.start()
    returned = {results.get(timeout=120) for _ in procs}
    for proc in procs:
        proc.join(30)
    made = WorkflowRun.objects.filter(workflow=workflow, start_key=key).count()
    assert made == len(returned), (made, returned)
    return made


def run_one(database: str, quick: bool) -> dict[str, Any]:
    """Measure on one database; print the lines and return the figures (bench/quota.py's `bench_main`)."""
    setup_django(database)
    engine = build_engine()
    reporting.log(f"[{database}] start paths: {4 if quick else 12} s of interleaved rounds")
    costs = measure_cost(engine, 4 if quick else 12)
    plain = costs["plain"]
    lines = [
        f"[{database}] {path:<20} {costs[path]:.2f} ms per start (ratio to plain {costs[path] / plain:.2f})"
        for path in PATHS
    ]
    print("\n".join(lines), flush=True)
    rounds = 2 if quick else 4
    made: dict[str, list[int]] = {}
    for workflow in ("bench.debounced", "bench.singleton"):
        reporting.log(f"[{database}] {rounds} races of {STARTERS} starters of one key, {workflow}")
        made[workflow] = [race(workflow) for _ in range(rounds)]
        lines.append(
            f"[{database}] {STARTERS} racing starters of one key, {workflow}: runs made per round {made[workflow]}"
            " (target 1)"
        )
        print(lines[-1], flush=True)
    from django.db import connections

    connections.close_all()
    targets = [
        reporting.target(f"[{database}] {workflow}: most runs made for one key", max(counts), "==", 1)
        for workflow, counts in made.items()
    ]
    figures = {
        "ms_per_start": costs,
        "ratio_to_plain": {path: costs[path] / plain for path in PATHS},
        "runs_made": made,
    }
    return {"figures": figures, "lines": lines, "targets": targets}


if __name__ == "__main__":
    bench_main(run_one, __file__, __doc__)
