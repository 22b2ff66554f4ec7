"""`admission_backend` (loaded by tests/conftest.py): a test run once on each admission backend we
ship (`local`, `db`, `redis`), for the numbers that must come out alike on all three (the
dashboard's queue rows and step-concurrency keys). Not `admission`: that is the backend a worker
process is started on, by name (`tests.support.workers`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from durable_flow.admission.base import AdmissionBackend
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from tests.support.redis_admission import REDIS_URL
from tests.support.redis_keys import delete_keys


@pytest.fixture(params=["local", "db", "redis"])
def admission_backend(request: pytest.FixtureRequest, transactional_db: None) -> Iterator[AdmissionBackend]:
    """Depends on the database so that it is torn down first: the redis backend's freed-slot
    listener must stop before the test database is flushed, or its wake-up races the TRUNCATE."""
    if request.param == "local":
        yield LocalAdmissionBackend()
    elif request.param == "db":
        yield DatabaseAdmissionBackend()
    else:
        from durable_flow.admission.redis.backend import RedisAdmissionBackend

        prefix = f"df:t:{uuid.uuid4().hex[:8]}"
        backend = RedisAdmissionBackend.from_options({"URL": REDIS_URL, "KEY_PREFIX": prefix})
        yield backend
        delete_keys(backend.redis, f"{prefix}:*")
        backend.close()
