"""What the tests on the `rq` transport share (fixtures loaded by tests/conftest.py): this
process's Redis database cleared of `rq:*` (`redis_conn`), an engine on `rq` (`rq_engine`), the
file the workers' steps mark (`marker`), and how to start a `durable_worker` on RQ and read what
it left.

Isolation: run with `REDIS_URL=redis://127.0.0.1:6379/<N>` (and `DURABLE_FLOW_TEST_ID`); each
test starts from an empty RQ keyspace in that Redis database (only `rq:*` keys are removed,
never other databases)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import django_rq
import pytest
from redis import Redis

from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import WorkerHeartbeat, WorkflowRun
from durable_flow.transports.rq import RQTransport
from tests.conftest import ManagedProcess
from tests.support.workers import RQ_ENV, clear_rq

#: A worker with EAGER_STEPS off (settings/test.py): every step an RQ job.
NO_EAGER_STEPS = {"DURABLE_FLOW_EAGER_STEPS": "0"}
#: A worker with OPTIMISTIC_FIRST_STEP on (settings/test.py; the default, named where it matters).
OPTIMISTIC = {"DURABLE_FLOW_OPTIMISTIC_FIRST_STEP": "1"}
#: A worker with OPTIMISTIC_FIRST_STEP off: a first step is written as running before it runs.
LOCKED = {"DURABLE_FLOW_OPTIMISTIC_FIRST_STEP": "0"}


@pytest.fixture
def redis_conn() -> Iterator[Redis]:
    connection = django_rq.get_connection("durable")
    assert connection.connection_pool.connection_kwargs.get("db", 0) != 0, "tests never touch Redis database 0"
    clear_rq(connection)
    yield connection
    clear_rq(connection)


@pytest.fixture
def rq_engine(transactional_db: None, redis_conn: Redis) -> Engine:
    """This process's engine, on the RQ transport like the workers (settings.test reads
    DURABLE_FLOW_TRANSPORT at import, so it is built here instead)."""
    engine = Engine(
        admission=LocalAdmissionBackend(),
        transport=RQTransport(queue="durable", concurrency=4),
        settings=get_settings(),
    )
    set_engine(engine)
    return engine


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "marks.txt"


def marks(marker: Path, name: str) -> list[tuple[str, int]]:
    """(value, pid) of every execution of step mark `name` across processes, in order."""
    if not marker.exists():
        return []
    rows = [line.split() for line in marker.read_text().splitlines() if line.strip()]
    return [(row[1], int(row[2])) for row in rows if row[0] == name]


def worker(
    spawn: Callable[..., ManagedProcess], marker: Path, *args: str, env: dict[str, str] | None = None
) -> ManagedProcess:
    return spawn("durable_worker", *args, env={**RQ_ENV, "DURABLE_FLOW_TEST_MARKER": str(marker), **(env or {})})


def live_heartbeat(process: ManagedProcess) -> WorkerHeartbeat | None:
    return WorkerHeartbeat.objects.filter(pid=process.proc.pid, stopped_at__isnull=True).first()


def run_status(run_id: str) -> str:
    return WorkflowRun.objects.get(pk=run_id).status
