#!/usr/bin/env python
"""The cost of handing a freed shared step-concurrency resource to the rightful next waiter
(least-recently-served account first), against the length of its line, per backend.

    .venv/bin/python bench/resource_fairness.py            # local and redis 100 vs 10,000, db 100 vs 2,000
    .venv/bin/python bench/resource_fairness.py --quick

A shared resource (limit 1) is held; its waiters, ten per account, each need it and their
account's resource (limit 5). Each timed release frees the shared slot and grants it (in the
same call) to the next waiter, which then holds it. Printed: the median release + grant for a
short line and a long one, and their ratio: about 1 when the grant is O(log n) or indexed
(the target), about long/short if it read every waiter. `db` runs on a fresh SQLite file
(`settings.test`, DURABLE_FLOW_TEST_ID=bench-fair); Redis keys live under a unique prefix and
are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

from bench.admission import setup_django  # noqa: E402

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def line_of(backend: Any, waiters: int, tag: str) -> str:
    """Hold the shared resource and park `waiters` calls behind it; returns the holder."""
    from durable_flow.admission.base import AdmissionRequest, Constraint

    shared = Constraint(f"sc:acct:{tag}:openai", 1)
    assert backend.try_admit(AdmissionRequest("", f"{tag}-holder/1", constraints=(shared,))).admitted
    for i in range(waiters):
        account = Constraint(f"sc:fn:{tag}:acct{i // 10}", 5)
        assert not backend.try_admit(AdmissionRequest("", f"{tag}-w{i}/1", constraints=(shared, account))).admitted
    return f"{tag}-holder/1"


def handoffs(backend: Any, holder: str, count: int) -> list[float]:
    """Release the holder `count` times; each release grants the next waiter (timed)."""
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        (holder,) = backend.release("", holder).tickets
        latencies.append(time.perf_counter() - start)
    return latencies


def measure(name: str, make: Any, short: int, long: int, count: int) -> dict[str, Any]:
    """Print and return the median release + grant with a short line and a long one."""
    medians = []
    for waiters in (short, long):
        with reporting.progress(f"{name}: a line of {waiters:,} waiters, {count} handoffs"):
            backend, tag = make(), uuid.uuid4().hex[:8]
            holder = line_of(backend, waiters, tag)
            medians.append(statistics.median(handoffs(backend, holder, count)))
            if hasattr(backend, "close"):
                backend.close()
    print(
        f"{name:6} {short:>6} waiters: {medians[0] * 1e6:8.0f} us   {long:>6} waiters: {medians[1] * 1e6:8.0f} us"
        f"   ratio {medians[1] / medians[0]:5.2f}"
    )
    return {
        "waiters": [short, long],
        "median_us": [medians[0] * 1e6, medians[1] * 1e6],
        "ratio": medians[1] / medians[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter lines and fewer handoffs")
    reporting.add_json_option(parser, "resource_fairness")
    args = parser.parse_args()
    setup_django(None, "bench-fair")
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    scale = 5 if args.quick else 1
    prefix = f"bench:fair:{uuid.uuid4().hex[:8]}"
    rows = {
        "local": measure("local", LocalAdmissionBackend, 100, 10_000 // scale, 90),
        "db": measure("db", DatabaseAdmissionBackend, 100, 2_000 // scale, 90),
    }
    try:
        rows["redis"] = measure(
            "redis", lambda: RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix), 100, 10_000 // scale, 90
        )
    finally:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)

    reporting.write_json(
        "resource_fairness",
        {"backends": rows},
        path=args.json,
        summary=[
            f"{name}: {row['waiters'][1]:,} / {row['waiters'][0]:,} waiters, release + grant ratio {row['ratio']:.2f}"
            f" ({row['median_us'][0]:.0f} vs {row['median_us'][1]:.0f} us)"
            for name, row in rows.items()
        ],
    )


if __name__ == "__main__":
    main()
