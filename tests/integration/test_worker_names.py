"""A worker's stable name (`store.worker_names`, `runtime.heartbeat.claim_worker_id`): taken by
one live process at a time, free again after a graceful stop or a lapsed heartbeat."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from django.utils import timezone

from durable_flow.models import WorkerHeartbeat
from durable_flow.runtime.heartbeat import WorkerNameTaken, claim_worker_id
from durable_flow.store import worker_names

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_free_name_is_taken_once_and_is_free_again_after_a_stop_or_a_lapse() -> None:
    now = timezone.now()
    cutoff = now - timedelta(seconds=10)
    assert worker_names.take("h:a", "h", "db", cutoff, now)
    assert not worker_names.take("h:a", "h", "db", cutoff, now)  # its holder is live
    WorkerHeartbeat.objects.filter(pk="h:a").update(stopped_at=now)  # a graceful stop
    assert worker_names.take("h:a", "h", "db", cutoff, now)
    assert WorkerHeartbeat.objects.get(pk="h:a").stopped_at is None  # the new holder's row
    WorkerHeartbeat.objects.filter(pk="h:a").update(last_seen=now - timedelta(seconds=11))  # a crash
    assert worker_names.take("h:a", "h", "db", cutoff, now)


def test_default_names_are_the_lowest_free_number_on_the_host() -> None:
    now = timezone.now()
    cutoff = now - timedelta(seconds=10)
    assert [worker_names.take_first_free("h", "w", "db", cutoff, now) for _ in range(3)] == ["h:w0", "h:w1", "h:w2"]
    WorkerHeartbeat.objects.filter(pk="h:w1").update(stopped_at=now)
    assert worker_names.take_first_free("h", "w", "db", cutoff, now) == "h:w1"  # a restart keeps its name
    assert worker_names.take_first_free("other", "w", "db", cutoff, now) == "other:w0"  # per host


def test_an_explicit_name_a_live_worker_holds_is_refused_after_waiting_for_a_lapse() -> None:
    host = socket.gethostname()
    future = timezone.now() + timedelta(hours=1)  # a holder that stays live whatever the wait
    WorkerHeartbeat.objects.create(
        worker_id=f"{host}:busy", host=host, pid=1, transport="db", started_at=future, last_seen=future
    )
    waits: list[float] = []
    with pytest.raises(WorkerNameTaken, match="held by a live worker"):
        claim_worker_id("busy", "db", ttl_s=0.05, interval_s=0.01, sleep=waits.append)
    assert waits and set(waits) == {0.01}  # it waited a beat at a time for the holder to lapse
    assert claim_worker_id("idle", "db", ttl_s=10, interval_s=1) == f"{host}:idle"
