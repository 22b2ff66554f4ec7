#!/usr/bin/env python
"""What do the operator surfaces' indexes cost the writes of the hot path (PostgreSQL)?

    .venv/bin/python bench/index_cost.py              # 5,000 lifecycles a timing, 3 rounds
    .venv/bin/python bench/index_cost.py --lifecycles 20000 --rounds 5

Design. Two databases of their own (dropped after): one migrated to the migration before the
surfaces' indexes (`0020_task_deliveries`), one migrated to the end, with the optional
trigram index of the search inside inputs added (docs: "At production size"). In each, a PL/pgSQL block
writes `--lifecycles` step lifecycles as the engine writes them, row for row: a run inserted
pending (one in ten tagged), its step's checkpoint inserted parked on a queue, dispatched, its
attempt inserted running, the checkpoint and the attempt completed, the run running then
completed; one in ten attempts fails first and is retried.

Two figures. The block's server time (no client round trips), after a warm-up block in each
database, rounds alternating, the median of the rounds: what the indexes cost in time, which
a busy host blurs. And, deterministic, what each index grows by per lifecycle on fresh tables
(its size after one block, less its size before, over the lifecycles): the entries every
write adds, index by index, before and after the migration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import reporting

ROOT = Path(__file__).resolve().parent.parent
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
BEFORE = "0020_task_deliveries"
#: The optional trigram index for the search inside inputs (docs: "At production size"),
#: added to the migrated database so its cost shows beside the others.
INPUT_INDEX = (
    "CREATE INDEX df_run_input_trgm ON durable_flow_workflowrun USING gin ((UPPER((input)::text)) gin_trgm_ops)"
)

LIFECYCLES = """
DO $$
DECLARE
    i integer;
    rid text;
    cid bigint;
    started timestamptz := clock_timestamp();
BEGIN
    FOR i IN 1..%(n)s LOOP
        rid := %(prefix)s || i;
        INSERT INTO durable_flow_workflowrun (id, workflow, version, status, input, output, error, wake_at, tags,
            parent_id, parent_step_key, concurrency_key, concurrency_limit, step_concurrency, turns, created_at,
            updated_at, finished_at, rerun_of, start_key, debounce_until)
        VALUES (rid, 'orders.import', '1', 'pending',
            jsonb_build_object('customer', 'cust-' || (i %% 1000), 'order', i, 'note', 'import the nightly file'),
            NULL, NULL, NULL, CASE WHEN i %% 10 = 0 THEN '["nightly"]'::jsonb ELSE '[]'::jsonb END,
            NULL, '', NULL, NULL, '[]'::jsonb, 0, now(), now(), NULL, '', NULL, NULL);
        UPDATE durable_flow_workflowrun SET status = 'running', turns = 1, updated_at = now() WHERE id = rid;
        INSERT INTO durable_flow_stepcheckpoint (run_id, key, sequence, kind, name, status, input, output, error,
            attempt, max_attempts, queue, holds_slot, priority, fairness_key, "group", wake_at, timeout_s,
            child_run_id, worker, late_result, created_at, dispatched_at, finished_at%(cause_column)s)
        VALUES (rid, '0', 0, 'step', 'orders.fetch', 'waiting', NULL, NULL, NULL, 0, 3, 'imports', false, 0,
            'cust-' || (i %% 1000), '', NULL, NULL, '', '', NULL, now(), NULL, NULL%(cause_parked)s)
        RETURNING id INTO cid;
        UPDATE durable_flow_stepcheckpoint SET status = 'dispatched', attempt = 1, holds_slot = true,
            dispatched_at = now(), worker = 'w:1'%(cause_admitted)s WHERE id = cid;
        INSERT INTO durable_flow_stepattempt (checkpoint_id, run_id, attempt, status, worker, dispatched_at,
            started_at, finished_at, retry_at, error, late, operator_retry_at)
        VALUES (cid, rid, 1, 'running', 'w:1', now(), now(), NULL, NULL, NULL, false, NULL);
        IF i %% 10 = 0 THEN
            UPDATE durable_flow_stepattempt SET status = 'failed', finished_at = now(),
                error = '{"type": "TimeoutError"}'::jsonb WHERE checkpoint_id = cid AND attempt = 1;
            UPDATE durable_flow_stepcheckpoint SET status = 'retrying', holds_slot = false, wake_at = now()
                WHERE id = cid;
            UPDATE durable_flow_stepcheckpoint SET status = 'dispatched', attempt = 2, holds_slot = true,
                dispatched_at = now() WHERE id = cid;
            INSERT INTO durable_flow_stepattempt (checkpoint_id, run_id, attempt, status, worker, dispatched_at,
                started_at, finished_at, retry_at, error, late, operator_retry_at)
            VALUES (cid, rid, 2, 'running', 'w:1', now(), now(), NULL, NULL, NULL, false, NULL);
        END IF;
        UPDATE durable_flow_stepcheckpoint SET status = 'completed', holds_slot = false, finished_at = now(),
            output = '{"rows": 17}'::jsonb WHERE id = cid;
        UPDATE durable_flow_stepattempt SET status = 'completed', finished_at = now()
            WHERE checkpoint_id = cid AND status = 'running';
        UPDATE durable_flow_workflowrun SET status = 'completed', turns = 2, output = '{"rows": 17}'::jsonb,
            finished_at = now(), updated_at = now() WHERE id = rid;
    END LOOP;
    RAISE NOTICE 'elapsed_us %%', extract(epoch FROM clock_timestamp() - started) * 1000000;
END $$;
"""


def pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def lifecycles_sql(conn: Any, n: int, prefix: str) -> str:
    """The block of `n` lifecycles for this database's schema: where checkpoints record why a
    call is parked (`wait_cause`, after the surfaces' migration), the parked checkpoint names its
    cause and its admission clears it, as the engine does."""
    found = conn.execute(
        "SELECT 1 FROM information_schema.columns"
        " WHERE table_name = 'durable_flow_stepcheckpoint' AND column_name = 'wait_cause'"
    ).fetchone()
    cause = (", wait_cause", ", 'cap'", ", wait_cause = ''") if found else ("", "", "")
    keys = ("cause_column", "cause_parked", "cause_admitted")
    return LIFECYCLES % {"n": n, "prefix": f"'{prefix}-'", **dict(zip(keys, cause, strict=True))}


def migrate(database: str, target: str | None) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": f"{PG_SERVER}/{database}",
        "DJANGO_SETTINGS_MODULE": "settings.test",
        "DURABLE_FLOW_TEST_ID": "bench-index-cost",
    }
    args = [sys.executable, "manage.py", "migrate", "--verbosity", "0"]
    if target:
        args += ["durable_flow", target]
    subprocess.run(args, cwd=ROOT, env=env, check=True)


def lifecycles_us(database: str, n: int, prefix: str) -> float:
    """Server microseconds per lifecycle of one block of `n`, then the block's rows deleted."""
    import psycopg

    notices: list[str] = []
    with psycopg.connect(f"{PG_SERVER}/{database}", autocommit=True) as conn:
        conn.add_notice_handler(lambda diagnostic: notices.append(diagnostic.message_primary or ""))
        conn.execute(lifecycles_sql(conn, n, prefix))  # values of this script, not input
        for table in ("stepattempt", "stepcheckpoint", "workflowrun"):
            column = "id" if table == "workflowrun" else "run_id"
            conn.execute(f"DELETE FROM durable_flow_{table} WHERE {column} LIKE %s", (f"{prefix}-%",))
        conn.execute("VACUUM durable_flow_workflowrun, durable_flow_stepcheckpoint, durable_flow_stepattempt")
    elapsed = next(float(text.split()[-1]) for text in notices if text.startswith("elapsed_us"))
    return elapsed / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lifecycles", type=int, default=5000, help="step lifecycles a timing")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (the median is printed)")
    reporting.add_json_option(parser, "index_cost")
    args = parser.parse_args()
    before, after = f"df_bench_idx_before_{os.getpid()}", f"df_bench_idx_after_{os.getpid()}"
    for database in (before, after):
        pg_admin(f"DROP DATABASE IF EXISTS {database}")
        pg_admin(f"CREATE DATABASE {database}")
    try:
        with reporting.progress("migrating both databases"):
            migrate(before, BEFORE)
            migrate(after, None)
        import psycopg

        with psycopg.connect(f"{PG_SERVER}/{after}", autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
            conn.execute(INPUT_INDEX)

        # Each block is one statement: the progress is counted in blocks, its heartbeat in between.
        blocks = 4 + 2 * args.rounds
        with reporting.progress(f"blocks of {args.lifecycles:,} lifecycles", total=blocks, unit="blocks") as shown:
            # On fresh tables first: every entry then takes new space (later blocks reuse freed space).
            growth = {}
            for database in (before, after):
                growth[database] = index_growth(database, args.lifecycles)
                shown.advance()
            timings: dict[str, list[float]] = {"before": [], "after": []}
            for database in (before, after):  # a warm-up block each (catalog caches, the plan of the block)
                lifecycles_us(database, max(100, args.lifecycles // 10), "warm")
                shown.advance()
            for round_ in range(args.rounds):
                timings["before"].append(lifecycles_us(before, args.lifecycles, f"r{round_}"))
                shown.advance()
                timings["after"].append(lifecycles_us(after, args.lifecycles, f"r{round_}"))
                shown.advance()
    finally:
        for database in (before, after):
            pg_admin(f"DROP DATABASE IF EXISTS {database}")
    base = statistics.median(timings["before"])
    full = statistics.median(timings["after"])
    print(f"hot-path writes per step lifecycle (PostgreSQL, server time, median of {args.rounds} rounds)")
    print(f"  before the surfaces' indexes ({BEFORE}): {base:8.1f} us")
    print(f"  with them:                                 {full:8.1f} us   ratio {full / base:.3f}")
    print(f"  index growth per lifecycle, bytes ({args.lifecycles:,} fresh lifecycles, no vacuum):")
    names = sorted(growth[before].keys() | growth[after].keys())
    for name in names:
        was, now = growth[before].get(name), growth[after].get(name)
        shown = lambda value: "-" if value is None else f"{value:7.1f}"  # noqa: E731
        change = (
            "" if name in growth[before] and name in growth[after] else ("  (added)" if was is None else "  (removed)")
        )
        print(f"    {name:<44} before {shown(was)}  after {shown(now)}{change}")
    added = sum(growth[after].values()) - sum(growth[before].values())
    together = (
        f"every index together: {sum(growth[before].values()):.1f} -> {sum(growth[after].values()):.1f} bytes "
        f"per lifecycle ({added:+.1f})"
    )
    print(f"  {together}")
    reporting.write_json(
        "index_cost",
        {
            "lifecycles": args.lifecycles,
            "rounds": {"before_us": timings["before"], "after_us": timings["after"]},
            "before_us": base,
            "after_us": full,
            "ratio": full / base,
            "growth_bytes": {"before": growth[before], "after": growth[after]},
            "growth_added_bytes": added,
        },
        path=args.json,
        summary=[
            f"server time per lifecycle: {base:.1f} us before, {full:.1f} us with them, ratio {full / base:.3f}",
            together,
        ],
    )


def index_growth(database: str, n: int) -> dict[str, float]:
    """Bytes each index of the run, checkpoint and attempt tables grows by per lifecycle, over
    `n` fresh lifecycles (the rows stay: what every write adds)."""
    import psycopg

    query = (
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
        "WHERE indrelid IN ('durable_flow_workflowrun'::regclass, 'durable_flow_stepcheckpoint'::regclass, "
        "'durable_flow_stepattempt'::regclass)"
    )
    with psycopg.connect(f"{PG_SERVER}/{database}", autocommit=True) as conn:
        conn.execute("VACUUM durable_flow_workflowrun, durable_flow_stepcheckpoint, durable_flow_stepattempt")
        before = dict(conn.execute(query).fetchall())
        conn.execute(lifecycles_sql(conn, n, "growth"))
        # A GIN index's pending list goes into the index proper at vacuum: flush it to count it.
        for name in before:
            if (
                conn.execute(
                    "SELECT amname FROM pg_class c JOIN pg_am a ON a.oid = c.relam WHERE c.oid = %s::regclass", (name,)
                ).fetchone()[0]
                == "gin"
            ):
                conn.execute("SELECT gin_clean_pending_list(%s::regclass)", (name,))
        after = dict(conn.execute(query).fetchall())
        for table in ("stepattempt", "stepcheckpoint", "workflowrun"):
            column = "id" if table == "workflowrun" else "run_id"
            conn.execute(f"DELETE FROM durable_flow_{table} WHERE {column} LIKE 'growth-%%'")
        conn.execute("VACUUM durable_flow_workflowrun, durable_flow_stepcheckpoint, durable_flow_stepattempt")
    return {name: (after[name] - before[name]) / n for name in before}


if __name__ == "__main__":
    main()
