"""Pause, resume and resize queues live: the Python API, the JSON API, the admin, and real workers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

from durable_flow.config.queues import RateLimit, Throttle
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidQueueConfig, QueueNotFound
from durable_flow.models import FlowQueue, RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from tests.conftest import ManagedProcess, wait_for
from tests.support.workers import completed, unique


def waiting(queue: str) -> int:
    return StepCheckpoint.objects.filter(queue=queue, status=StepStatus.WAITING).count()


def test_a_paused_queue_admits_nothing_and_resume_drains_it(engine: Engine, clock: Any) -> None:
    api.register_queue("gate", concurrency=5)
    api.pause_queue("gate")
    runs = [api.start("tests.queued", {"queue": "gate", "value": i}).id for i in range(3)]
    assert waiting("gate") == 3
    assert engine.admission.in_flight("gate") == 0
    assert not WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).exists()
    api.resume_queue("gate")
    clock.advance(seconds=1)
    TimerPoller(engine).drain()
    assert WorkflowRun.objects.filter(pk__in=runs, status=RunStatus.COMPLETED).count() == 3


def test_update_queue_resizes_live_and_validates(engine: Engine) -> None:
    api.register_queue("resize", concurrency=1)
    config = api.update_queue("resize", concurrency=4)
    assert config.concurrency == 4
    assert FlowQueue.objects.get(pk="resize").config["concurrency"] == 4
    config = api.update_queue("resize", rate_limit={"limit": 10, "period_ms": 1000})
    assert (config.concurrency, config.rate_limit.limit) == (4, 10)  # the other option is kept
    assert api.update_queue("resize", rate_limit=None).rate_limit is None
    with pytest.raises(InvalidQueueConfig):
        api.update_queue("resize", concurrency=10**30)
    with pytest.raises(QueueNotFound):
        api.pause_queue("no-such-queue")
    assert FlowQueue.objects.get(pk="resize").config["concurrency"] == 4


def test_queue_operations_over_http_need_change_flowqueue_and_are_audited(engine: Engine) -> None:
    api.register_queue("steered", concurrency=2)
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.post("/api/queues/steered/pause/").status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="change_flowqueue"))
    assert client.post("/api/queues/steered/pause/").json()["paused"] is True
    resized = client.post("/api/queues/steered/update/", json.dumps({"concurrency": 7}), "application/json")
    assert resized.json()["config"]["concurrency"] == 7
    bad = client.post("/api/queues/steered/update/", json.dumps({"concurrency": -1}), "application/json")
    assert bad.status_code == 400
    assert client.post("/api/queues/nope/pause/").status_code == 404
    assert client.post("/api/queues/steered/resume/").json()["paused"] is False
    assert LogEntry.objects.filter(object_id="steered").count() == 3


def test_update_queue_sets_changes_and_removes_a_throttle(engine: Engine) -> None:
    api.register_queue("paced", concurrency=3, rate_limit={"limit": 9, "period_ms": 1000, "per": "key"})
    config = api.update_queue("paced", throttle={"limit": 5, "period_ms": 1000, "burst": 2})
    assert config.throttle == Throttle(5, 1000, burst=2)
    assert FlowQueue.objects.get(pk="paced").config["throttle"] == {
        "limit": 5,
        "period_ms": 1000,
        "burst": 2,
        "per": "global",
    }
    assert api.update_queue("paced", concurrency=4).throttle == Throttle(5, 1000, burst=2)  # left as it was
    with pytest.raises(InvalidQueueConfig, match=r"throttle\.burst"):
        api.update_queue("paced", throttle={"limit": 5, "period_ms": 1000, "burst": 0})
    removed = api.update_queue("paced", throttle=None)
    assert removed.throttle is None and removed.key_rate_limit == RateLimit(9, 1000) and removed.concurrency == 4


def test_the_json_api_update_takes_a_throttle_and_refuses_a_bad_one(engine: Engine) -> None:
    api.register_queue("steered", concurrency=2)
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="change_flowqueue"))
    client = Client()
    client.force_login(user)
    body = {"throttle": {"limit": 10, "period_ms": 60_000, "burst": 3, "per": "key"}}
    resized = client.post("/api/queues/steered/update/", json.dumps(body), "application/json")
    assert resized.status_code == 200, resized.content
    assert resized.json()["config"]["throttle"] == body["throttle"]
    bad = client.post(
        "/api/queues/steered/update/", json.dumps({"throttle": {"limit": 10, "every": 5}}), "application/json"
    )
    assert bad.status_code == 400 and "every" in bad.json()["message"], bad.json()
    unknown = client.post("/api/queues/steered/update/", json.dumps({"burst": 3}), "application/json")
    assert unknown.status_code == 400
    assert FlowQueue.objects.get(pk="steered").config["throttle"] == body["throttle"]


def test_pause_and_resume_with_real_workers(
    matching_admission_engine: Engine,
    process_env: dict[str, str],
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
) -> None:
    queue = unique("paused")
    api.register_queue(queue, concurrency=2, retry_ms=200)
    api.pause_queue(queue)
    env = {**process_env, "DURABLE_FLOW_TEST_MARKER": str(tmp_path / "marker")}
    spawn("durable_worker", "--concurrency", "4", env=env)
    spawn("durable_poller", env=env)
    # A process that read "not paused" just before the pause forgets it within one poll interval.
    time.sleep(3 * matching_admission_engine.settings.poller_interval_ms / 1000)
    runs = [api.start("tests.queued", {"queue": queue, "seconds": 0.05, "id": i}).id for i in range(6)]
    wait_for(lambda: waiting(queue) == 6, timeout=60, what="six calls waiting on the paused queue")
    assert not StepCheckpoint.objects.filter(queue=queue).exclude(status=StepStatus.WAITING).exists()
    api.resume_queue(queue)
    wait_for(lambda: completed(runs), timeout=120, what="the resumed queue to drain")
    assert matching_admission_engine.admission.in_flight(queue) == 0
