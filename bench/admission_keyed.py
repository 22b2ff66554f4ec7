#!/usr/bin/env python
"""Per-key rate windows and the GCRA throttle against a plain (global) window, per backend, same
run; and what 100,000 distinct fairness keys leave behind once they went idle.

    .venv/bin/python bench/admission_keyed.py            # full run
    .venv/bin/python bench/admission_keyed.py --quick    # 10,000 idle keys, shorter loops

Also printed at the end of `bench/admission.py`. Rows (admit+release pairs/s, every pair a new
ticket, fairness keys cycling over 1,000 tenants, limits never reached so every decision admits):
- plain window:   `rate_limit` sliding, global;
- per-key window: `rate_limit` sliding, `per: "key"` (one window per tenant);
- GCRA per key:   `throttle` per key (one TAT per tenant).
Idle keys: 100,000 tenants each admitted once under a per-key window and a per-key throttle of
200 ms; after the period (and one more decision) what per-key state is left: local dict
entries, db rows, Redis keys (their TTLs expire them on Redis' own clock). On the db backend the
100,000 keys' rows are bulk-inserted (as their decisions would have written them), since 100,000
decisions one by one would dominate the run; local and Redis make every decision.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

from bench.admission import REDIS_URL, clean_redis, setup_django, summary, timed_loop  # noqa: E402

TENANTS = 1_000
BIG = 10**9


def configs(tag: str) -> dict[str, Any]:
    from durable_flow.config.queues import QueueConfig, RateLimit, Throttle

    return {
        "plain window": QueueConfig(name=f"bk-plain-{tag}", rate_limit=RateLimit(BIG, 1000, "sliding")),
        "per-key window": QueueConfig(name=f"bk-key-{tag}", key_rate_limit=RateLimit(BIG, 1000, "sliding")),
        "GCRA per key": QueueConfig(name=f"bk-gcra-{tag}", throttle=Throttle(BIG, 1000, burst=BIG, per="key")),
    }


def decision_rates(backend: Any, seconds: float) -> dict[str, Any]:
    from durable_flow.admission.base import AdmissionRequest

    tag = uuid.uuid4().hex[:8]
    out: dict[str, Any] = {}
    for label, config in configs(tag).items():
        backend.register(config)
        name = config.name

        def pair(i: int, name: str = name) -> None:
            request = AdmissionRequest(name, f"r{i}/1", fairness_key=f"tenant-{i % TENANTS}")
            assert backend.try_admit(request).admitted
            backend.release(name, f"r{i}/1")

        out[label] = summary(timed_loop(seconds, pair))
    return out


IDLE_MS = 200


def idle_config(name: str) -> Any:
    from durable_flow.config.queues import QueueConfig, RateLimit, Throttle

    return QueueConfig(
        name=name,
        key_rate_limit=RateLimit(10, IDLE_MS, "sliding"),
        throttle=Throttle(10, IDLE_MS, burst=10, per="key"),
    )


def admit_distinct(backend: Any, name: str, keys: int) -> None:
    from durable_flow.admission.base import AdmissionRequest

    for i in range(keys):
        assert backend.try_admit(AdmissionRequest(name, f"i{i}/1", fairness_key=f"tenant-{i}")).admitted
        backend.release(name, f"i{i}/1", grant_next=False)


def local_figures(seconds: float, keys: int) -> dict[str, Any]:
    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.admission.local import LocalAdmissionBackend

    backend = LocalAdmissionBackend()
    out = decision_rates(backend, seconds)
    backend.register(idle_config("bk-idle"))
    admit_distinct(backend, "bk-idle", keys)
    peak = backend.keyed_size("bk-idle")
    time.sleep(IDLE_MS * 2 / 1000)
    backend.try_admit(AdmissionRequest("bk-idle", "late/1", fairness_key="late"))
    out["idle"] = {"peak": peak, "left": backend.keyed_size("bk-idle"), "unit": "dict entries"}
    return out


def db_child(seconds: float, keys: int) -> None:
    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.db.keyed import GRANT, rows
    from durable_flow.models import AdmissionKeyMark, AdmissionKeyTat

    backend = DatabaseAdmissionBackend()
    out = decision_rates(backend, seconds)
    name = f"bk-idle-{uuid.uuid4().hex[:6]}"
    backend.register(idle_config(name))
    admit_distinct(backend, name, 100)  # real decisions first: the queue row and its shapes
    now = int(time.time() * 1000)
    marks = (AdmissionKeyMark(queue=name, fairness_key=f"b{i}", kind=GRANT, at_ms=now) for i in range(keys))
    AdmissionKeyMark.objects.bulk_create(marks, batch_size=5000)
    tats = (AdmissionKeyTat(queue=name, bucket=f"b{i}", kind=GRANT, tat=now + 20.0) for i in range(keys))
    AdmissionKeyTat.objects.bulk_create(tats, batch_size=5000)
    peak = rows(name)
    time.sleep(IDLE_MS * 2 / 1000)
    started = time.perf_counter()
    backend.try_admit(AdmissionRequest(name, "late/1", fairness_key="late"))  # prunes on the way
    out["idle"] = {"peak": peak, "left": rows(name), "unit": "rows", "prune_s": time.perf_counter() - started}
    print(json.dumps(out))


def db_figures(seconds: float, keys: int) -> dict[str, Any] | str:
    args = [sys.executable, __file__, "--child-db", "--seconds", str(seconds), "--keys", str(keys)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def redis_figures(seconds: float, keys: int) -> dict[str, Any]:
    import redis

    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    prefix = f"bench:keyed:{uuid.uuid4().hex[:10]}"
    backend = RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        out = decision_rates(backend, seconds)
        backend.register(idle_config("bk-idle"))
        admit_distinct(backend, "bk-idle", keys)
        peak = backend.keyed_keys("bk-idle")
        deadline = time.monotonic() + 30
        while backend.keyed_keys("bk-idle") and time.monotonic() < deadline:
            time.sleep(0.5)
        served = client.hlen(f"{prefix}:q:bk-idle:served")
        out["idle"] = {"peak": peak, "left": backend.keyed_keys("bk-idle"), "unit": "keys", "served": served}
    finally:
        clean_redis(client, prefix, [backend])
    return out


def report(seconds: float, keys: int) -> dict[str, Any]:
    """Print the keyed rows (called by `bench/admission.py` too); return them."""
    rows: dict[str, Any] = {}
    with reporting.progress(
        "per-key limits and idle keys: local, db (SQLite), redis", total=3, unit="backends"
    ) as shown:
        rows["local"] = local_figures(seconds, keys)
        shown.advance()
        rows["db (SQLite)"] = db_figures(seconds, keys)
        shown.advance()
        rows["redis"] = redis_figures(seconds, keys)
        shown.advance()
    print(f"\nPer-key limits against a plain window (admit+release pairs/s, same run; {TENANTS:,} tenants):")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"  {name:<14} {row}")
            continue
        plain = row["plain window"]["per_s"]
        cells = "   ".join(
            f"{label} {row[label]['per_s']:>8,.0f} ({row[label]['per_s'] / plain:.0%})"
            for label in ("plain window", "per-key window", "GCRA per key")
        )
        print(f"  {name:<14} {cells}")
    print(f"\nState left after {keys:,} distinct keys went idle (per-key window + per-key throttle, {IDLE_MS} ms):")
    for name, row in rows.items():
        if isinstance(row, str):
            continue
        idle = row["idle"]
        extra = f"; fairness 'served' hash {idle['served']:,} fields" if "served" in idle else ""
        extra += f"; pruning took {idle['prune_s']:.2f} s" if "prune_s" in idle else ""
        print(f"  {name:<14} peak {idle['peak']:>9,} {idle['unit']:<12} left {idle['left']:>6,}{extra}")

    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--keys", type=int, default=None)
    parser.add_argument("--child-db", action="store_true", help=argparse.SUPPRESS)
    reporting.add_json_option(parser, "admission_keyed")
    args = parser.parse_args()
    seconds = args.seconds or (0.4 if args.quick else 1.5)
    keys = args.keys or (10_000 if args.quick else 100_000)
    setup_django(None)
    if args.child_db:
        db_child(seconds, keys)
        return
    rows = report(seconds, keys)
    reporting.write_json(
        "admission_keyed",
        {"seconds": seconds, "keys": keys, "tenants": TENANTS, "backends": rows},
        path=args.json,
        summary=summary_lines(rows),
    )


def summary_lines(rows: dict[str, Any]) -> list[str]:
    """Per backend: each keyed limit's rate as a share of the plain window's, and the idle keys left."""
    lines = []
    for name, row in rows.items():
        if isinstance(row, str):
            lines.append(f"{name}: {row}")
            continue
        plain = row["plain window"]["per_s"]
        shares = ", ".join(f"{label} {row[label]['per_s'] / plain:.0%}" for label in ("per-key window", "GCRA per key"))
        idle = row["idle"]
        lines.append(f"{name}: {shares} of the plain window; {idle['left']:,} {idle['unit']} left of {idle['peak']:,}")
    return lines


if __name__ == "__main__":
    main()
