"""What the tests that start worker processes share: the admission backend and transport stacks
they run on, the environment the workers get, and the evidence they leave (marker intervals)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import django_rq
import pytest
from redis import Redis

from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine, build_backend, set_engine
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.transports.db.transport import DatabaseTransport
from durable_flow.transports.rq import RQTransport
from tests.conftest import ManagedProcess, use_redis_admission
from tests.support.redis_keys import delete_keys

STACKS = {"db": ("db", "db"), "redis+rq": ("redis", "rq")}


@pytest.fixture(params=["db", "redis"])
def admission(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def matching_admission_engine(transactional_db: None, admission: str, settings: Any) -> Engine:
    """The test process's engine on the same admission backend as its worker processes."""
    if admission == "redis":
        backend = use_redis_admission(settings)
    else:
        backend = DatabaseAdmissionBackend()
    engine = Engine(admission=backend, transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    yield engine
    reset_settings()


@pytest.fixture
def process_env(admission: str) -> dict[str, str]:
    return {"DURABLE_FLOW_ADMISSION": admission, "DURABLE_FLOW_TRANSPORT": "db"}


def unique(name: str) -> str:
    """Queue names are fresh per test: Redis state outlives the test database."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def read_intervals(marker: Path, until: float | None = None) -> list[tuple[float, float]]:
    """(start, end) of every `tests.slow` execution; one still open ends at `until`."""
    starts: dict[tuple[str, str], float] = {}
    intervals: list[tuple[float, float]] = []
    for line in marker.read_text().splitlines():
        name, value, pid, at = line.split()
        if name == "slow_start":
            starts[(value, pid)] = float(at)
        elif name == "slow_end":
            intervals.append((starts.pop((value, pid)), float(at)))
    if until is not None:
        intervals.extend((begin, until) for begin in starts.values())
    return intervals


def completed(run_ids: list[str]) -> bool:
    return WorkflowRun.objects.filter(pk__in=run_ids, status=RunStatus.COMPLETED).count() == len(run_ids)


@pytest.fixture(params=list(STACKS))
def stack(request: pytest.FixtureRequest, transactional_db: None, settings: Any) -> Iterator[dict[str, str]]:
    """This process's engine on the same backends as the worker processes; their env."""
    admission, transport = STACKS[request.param]
    if admission == "redis":
        settings.DURABLE_FLOW = {
            **settings.DURABLE_FLOW,
            "ADMISSION": {
                "BACKEND": "redis",
                "CONNECTION": "default",
                "KEY_PREFIX": f"df:test:{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}",
            },
        }
        reset_settings()
        backend = build_backend(get_settings().admission)
        clear_rq(django_rq.get_connection("durable"))
        engine = Engine(admission=backend, transport=RQTransport(queue="durable"), settings=get_settings())
    else:
        engine = Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    yield {"DURABLE_FLOW_ADMISSION": admission, "DURABLE_FLOW_TRANSPORT": transport, "DURABLE_FLOW_LOG": "WARNING"}
    if admission == "redis":
        clear_rq(django_rq.get_connection("durable"))
    reset_settings()


def run_workers(spawn: Callable[..., ManagedProcess], env: dict[str, str], workers: int = 2) -> None:
    for _ in range(workers):
        spawn("durable_worker", "--concurrency", "4", env=env)
    spawn("durable_poller", env=env)


RQ_ENV = {"DURABLE_FLOW_TRANSPORT": "rq", "DURABLE_FLOW_LOG": "WARNING"}


def clear_rq(connection: Redis) -> None:
    """Remove RQ's keys (queues, jobs, registries, workers) from the test Redis database."""
    delete_keys(connection, "rq:*")
