#!/usr/bin/env python
"""Redis admission under `fairness="key"`: does one tenant's long line cost every decision?

    .venv/bin/python bench/busy_key.py                 # 5,000 waiters of one tenant, 5 rounds
    .venv/bin/python bench/busy_key.py --quick         # 3 rounds of fewer operations
    .venv/bin/python bench/busy_key.py --waiters 50000

On the Redis admission backend (`--redis-url`, default `$REDIS_URL`; every key under a unique
prefix, deleted after), one queue of concurrency 1 with `fairness="key"` holds `--waiters`
waiters of one busy tenant behind a held slot (the tenant served once already, as in a real
backlog). A second queue, the baseline in the same run, has the same shape with a single waiter.
Two operations are timed on each queue:

  decision   a waiter of the busy tenant asks again and is refused (`concurrency`);
  handoff    the slot's holder releases it and the script grants it to the busy tenant's next
             waiter, re-ranking the tenant (a new waiter then joins, untimed, so the line keeps
             its length).

Each round times `--ops` of each operation on the baseline, then on the busy queue, alternately,
and takes the median latency of each; the ratio busy / baseline is printed per round, with its
median over the rounds and its worst round (1.00 = a decision does not see the line; a script
that scanned or rewrote the tenant's waiters would grow with `--waiters`). The regression test
(tests/processes/test_admission_redis.py::test_a_busy_key_does_not_cost_a_scan_per_decision) counts the
script's commands instead of timing them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from itertools import count
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

TARGET = 1.5


class Line:
    """A queue of concurrency 1 whose slot is held, with `waiters` waiters of the busy tenant."""

    def __init__(self, backend: object, name: str, waiters: int) -> None:
        from durable_flow.config.queues import QueueConfig

        self.backend, self.name, self.tickets = backend, name, count()
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))  # type: ignore[attr-defined]
        self.holder = self._ask(self._ticket())  # the tenant's first serve happens here
        assert self.backend.in_flight(name) == 1  # type: ignore[attr-defined]
        self.asker = ""  # the newest waiter asks again in `decision`
        for _ in range(waiters):
            self.asker = self._ask(self._ticket())

    def _ticket(self) -> str:
        return f"{self.name}-{next(self.tickets)}/1"

    def _ask(self, ticket: str) -> str:
        from durable_flow.admission.base import AdmissionRequest

        self.backend.try_admit(AdmissionRequest(queue=self.name, ticket=ticket, fairness_key="busy"))  # type: ignore[attr-defined]
        return ticket

    def decision(self) -> float:
        from durable_flow.admission.base import AdmissionRequest

        request = AdmissionRequest(queue=self.name, ticket=self.asker, fairness_key="busy")
        started = time.perf_counter()
        decided = self.backend.try_admit(request)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - started
        assert decided.reason == "concurrency", decided
        return elapsed

    def handoff(self) -> float:
        started = time.perf_counter()
        grant = self.backend.release(self.name, self.holder)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - started
        (self.holder,) = grant.tickets
        joined = self._ask(self._ticket())  # the line keeps its length
        if self.holder == self.asker:  # the asker was served: the newcomer asks from now on
            self.asker = joined
        return elapsed


def block(operation: Callable[[], float], ops: int) -> float:
    """The median latency (s) of `ops` calls of `operation`."""
    return median(operation() for _ in range(ops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 operations")
    parser.add_argument("--waiters", type=int, default=5_000, help="the busy tenant's waiters (default 5,000)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; 3 with --quick)")
    parser.add_argument("--ops", type=int, default=None, help="operations per timed block (default 1,000)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15"))
    reporting.add_json_option(parser, "busy_key")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    ops = args.ops or (200 if args.quick else 1_000)
    if rounds < 1 or ops < 1 or args.waiters < 1:
        raise SystemExit("--rounds, --ops and --waiters: at least 1")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings.test")
    import django

    django.setup()
    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    prefix = f"bench:busy:{uuid.uuid4().hex[:12]}"
    backend = RedisAdmissionBackend(url=args.redis_url, key_prefix=prefix)
    try:
        started = time.perf_counter()
        with reporting.progress(f"filling the busy tenant's line with {args.waiters:,} waiters"):
            baseline, busy = Line(backend, "one", 1), Line(backend, "busy", args.waiters)
        fill_s = time.perf_counter() - started
        ratios: dict[str, list[float]] = {"decision": [], "handoff": []}
        medians: dict[str, list[tuple[float, float]]] = {"decision": [], "handoff": []}
        for round_ in range(rounds):
            reporting.log(f"round {round_ + 1} of {rounds}")
            for kind in ratios:
                base_s = block(getattr(baseline, kind), ops)
                busy_s = block(getattr(busy, kind), ops)
                medians[kind].append((base_s, busy_s))
                ratios[kind].append(busy_s / base_s)
    finally:
        backend.close()
        keys = list(backend.redis.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            backend.redis.delete(*keys)
    print(f"redis fairness='key': {args.waiters:,} waiters of one tenant vs 1 (filled in {fill_s:.1f} s)")
    print(f"  {rounds} alternating rounds of {ops} operations each; median latency per block, µs")
    summary = []
    for kind, pairs in medians.items():
        rounds_text = " / ".join(f"{base * 1e6:.0f}:{loaded * 1e6:.0f}" for base, loaded in pairs)
        mid, worst = median(ratios[kind]), max(ratios[kind])
        verdict = "met" if mid <= TARGET else "MISSED"
        print(f"  {kind:<9} rounds 1 waiter:{args.waiters:,} waiters {rounds_text}")
        summary.append(f"{kind} ratio busy / baseline, median {mid:.2f}, worst round {worst:.2f}")
        print(f"  {kind:<9} ratio busy / baseline, median {mid:.2f}, worst round {worst:.2f}", end="")
        print(f" (target <= {TARGET}: {verdict})")
    reporting.write_json(
        "busy_key",
        {
            "waiters": args.waiters,
            "rounds": rounds,
            "ops": ops,
            "fill_s": fill_s,
            "median_us": {kind: [[base * 1e6, busy * 1e6] for base, busy in pairs] for kind, pairs in medians.items()},
            "ratios": ratios,
            "ratio": {kind: median(values) for kind, values in ratios.items()},
            "worst": {kind: max(values) for kind, values in ratios.items()},
        },
        path=args.json,
        summary=summary,
        targets=[
            reporting.target(f"{kind}: busy / baseline, median", median(ratios[kind]), "<=", TARGET) for kind in ratios
        ],
    )


if __name__ == "__main__":
    main()
