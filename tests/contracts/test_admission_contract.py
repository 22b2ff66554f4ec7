"""The unchanged admission contract kit, run against every backend we ship."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.testing.admission_contract import AdmissionBackendContract
from durable_flow.testing.clock import FakeClock
from durable_flow.testing.constraint_contract import StepConcurrencyContract
from tests.support.redis_cluster import OwnCluster
from tests.support.redis_keys import delete_keys

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


class TestLocalAdmissionBackend(AdmissionBackendContract, StepConcurrencyContract):
    def make_backend(self, clock: FakeClock) -> LocalAdmissionBackend:
        return LocalAdmissionBackend(clock=clock)


@pytest.mark.django_db(transaction=True)
class TestDatabaseAdmissionBackend(AdmissionBackendContract, StepConcurrencyContract):
    def make_backend(self, clock: FakeClock) -> DatabaseAdmissionBackend:
        return DatabaseAdmissionBackend(clock=clock)


class TestRedisAdmissionBackend(AdmissionBackendContract, StepConcurrencyContract):
    @pytest.fixture(autouse=True)
    def _redis_prefix(self) -> Iterator[None]:
        """Each test gets its own key prefix; its keys (and only those) are deleted after."""
        import redis

        self.prefix = f"test:adm:{uuid.uuid4().hex[:12]}"
        self.backends: list = []
        yield
        for backend in self.backends:
            backend.close()
        client = redis.Redis.from_url(REDIS_URL)
        delete_keys(client, f"{self.prefix}:*")
        client.close()

    def make_backend(self, clock: FakeClock):
        from durable_flow.admission.redis.backend import RedisAdmissionBackend

        backend = RedisAdmissionBackend(url=REDIS_URL, clock=clock, key_prefix=self.prefix)
        self.backends.append(backend)
        return backend


class TestRedisClusterAdmissionBackend(AdmissionBackendContract, StepConcurrencyContract):
    """The same kit on a three-master Redis Cluster the session starts (`redis_cluster`). Every
    key lives in one shard (none are declared), whose hash slot follows the test's own key
    prefix: the tests land on all three masters."""

    @pytest.fixture(autouse=True)
    def _cluster_prefix(self, redis_cluster: OwnCluster) -> Iterator[None]:
        from redis.cluster import RedisCluster

        self.cluster = redis_cluster
        self.prefix = f"test:adm:{uuid.uuid4().hex[:12]}"
        self.backends: list = []
        yield
        for backend in self.backends:
            backend.close()
        client = RedisCluster.from_url(redis_cluster.url)
        delete_keys(client, f"{{{self.prefix}:*")
        client.close()

    def make_backend(self, clock: FakeClock):
        from durable_flow.admission.redis.backend import RedisAdmissionBackend

        backend = RedisAdmissionBackend(url=self.cluster.url, cluster=True, clock=clock, key_prefix=self.prefix)
        self.backends.append(backend)
        return backend
