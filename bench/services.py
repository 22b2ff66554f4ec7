"""What the benches share besides their reports (`reporting`): statements on the PostgreSQL
server's maintenance database, a fresh SQLite file, and stopping the processes a bench started."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The machine's PostgreSQL server (trust auth), without a database name.
PG_SERVER = "postgres://postgres@127.0.0.1:5432"


def pg_admin(sql: str, server: str = PG_SERVER) -> list[tuple[Any, ...]] | None:
    """Run `sql` on `server`'s maintenance database outside a transaction (CREATE and DROP
    DATABASE need that); return its rows when it has some (a `SHOW`), else None."""
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description is not None else None


def fresh_sqlite(path: Path) -> None:
    """Remove a SQLite database and its write-ahead log, so the next run starts empty."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    """Ask every process to stop (SIGTERM), then kill the ones still running after `timeout_s`."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fresh_database(postgres: bool, pg_name: str, sqlite_path: Path, server: str = PG_SERVER) -> str:
    """A new empty database for a peer's run (DBOS): `pg_name` on `server`, or a SQLite file at
    `sqlite_path`; its SQLAlchemy-style URL."""
    if postgres:
        pg_admin(f"DROP DATABASE IF EXISTS {pg_name} WITH (FORCE)", server)
        pg_admin(f"CREATE DATABASE {pg_name}", server)
        return f"{server.replace('postgres://', 'postgresql://', 1)}/{pg_name}"
    sqlite_path.parent.mkdir(exist_ok=True)
    fresh_sqlite(sqlite_path)
    return f"sqlite:///{sqlite_path}"


def worker_output(name: str) -> Any:
    """Where a process a bench starts writes its output: discarded, or, when `BENCH_WORKER_LOG`
    names a folder, appended to `<folder>/<name>-<bench pid>.log` (a worker's warnings: an outage
    it rode out, a task that failed), so a bench that stalls can be looked into."""
    folder = os.environ.get("BENCH_WORKER_LOG")
    if not folder:
        return subprocess.DEVNULL
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"{name}-{os.getpid()}.log", "ab")  # the child process holds it; ours is closed with us


def start_worker(concurrency: int) -> subprocess.Popen[bytes]:
    """One `durable_worker` process of this project with `concurrency` threads, on this process's
    environment (its database and stack), its output discarded (or kept: `worker_output`)."""
    output = worker_output("durable_worker")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "durable_worker", "--concurrency", str(concurrency)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=output,
        stderr=subprocess.STDOUT,
    )


def require_own_redis_database(redis_url: str) -> None:
    """Exit, saying why, if another client is connected to the Redis database of `redis_url`:
    a bench that runs durable_flow over `rq` needs one nobody else uses while it runs.

    RQ's keys are per Redis database, not per durable_flow database: every bench's workers pop
    the queue `durable` and register as `<host>:w0`, and the benches clear `rq:*` as they start.
    Two benches (or a bench and a test session, a stray worker) on one Redis database take each
    other's jobs, and a worker that pops a turn of a run its own database does not hold finishes
    the job with nothing done: the other side's run stays `pending` for good. Called before the
    bench connects or clears anything, so any client of the database is someone else's: a
    bench's workers, a test's pool or a worker hold theirs while they run."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        database = int(client.connection_pool.connection_kwargs.get("db") or 0)
        mine = client.client_id()
        others = [c for c in client.client_list() if int(c.get("db", -1)) == database and int(c["id"]) != mine]
    finally:
        client.close()
    if others:
        shown = ", ".join(f"{c['addr']} {c.get('name') or '-'} last {c.get('cmd')}" for c in others[:5])
        raise SystemExit(
            f"{redis_url}: {len(others)} other client(s) use this Redis database ({shown}"
            f"{', ...' if len(others) > 5 else ''}); RQ's queues and worker names are per Redis database, so "
            "they would take and clear this bench's jobs. Pass --redis-url with a database nobody uses "
            "(`redis-cli client list` shows each client's db=)."
        )


def percentiles(values_s: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of `values_s` (seconds), in milliseconds, and their count."""
    ordered = sorted(values_s)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000

    return {"p50": at(0.5), "p99": at(0.99), "max": ordered[-1] * 1000, "n": len(ordered)}


def django_on_fresh_database(
    test_id: str, pg_database: str | None, env: dict[str, str], before_setup: Callable[[], None] | None = None
) -> None:
    """Set this process up as a bench's Django on a fresh database: `settings.test` with DEBUG off
    and `env`, on PostgreSQL's `pg_database` (created anew) or, if None, the SQLite file of
    `test_id` (removed first); `before_setup` runs before Django is set up; then migrated."""
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": test_id,
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DJANGO_DEBUG": "0",  # as deployed: DEBUG logs every query's SQL
            "DURABLE_FLOW_LOG": "WARNING",
            **env,
        }
    )
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    if pg_database is None:
        os.environ.pop("DATABASE_URL", None)
        from settings.base import VAR_DIR

        fresh_sqlite(VAR_DIR / f"test-{test_id}.sqlite3")
    else:
        pg_admin(f"DROP DATABASE IF EXISTS {pg_database} WITH (FORCE)")
        pg_admin(f"CREATE DATABASE {pg_database}")
        os.environ["DATABASE_URL"] = f"{PG_SERVER}/{pg_database}"
    if before_setup is not None:
        before_setup()
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
