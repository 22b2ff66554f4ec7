"""Health checks: `/healthz` for web processes, `manage.py durable_health --worker / --poller`
for workers and pollers, against real worker and poller processes and a real unreachable database."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from durable_flow.models import QueueSample, WorkerHeartbeat
from tests.conftest import ManagedProcess, wait_for

ROOT = Path(__file__).resolve().parents[2]
# Nothing listens on port 1: every connection is refused.
UNREACHABLE_DATABASE = {"DATABASE_URL": "postgres://postgres@127.0.0.1:1/postgres"}
PROCESS_ENV = {"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_SAMPLE_INTERVAL_S": "1"}


def healthy(*args: str) -> bool:
    try:
        call_command("durable_health", *args, stdout=io.StringIO())
    except CommandError:
        return False
    return True


def run_with_unreachable_database(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **UNREACHABLE_DATABASE, "DJANGO_SETTINGS_MODULE": "settings.test"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.django_db
def test_healthz_answers_ok_to_a_probe_by_address_over_http() -> None:
    """Probes reach a container by its address, not by a name in ALLOWED_HOSTS."""
    response = Client().get("/healthz", HTTP_HOST="10.11.12.13:8000")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


def test_healthz_answers_503_when_the_database_is_unreachable() -> None:
    code = "import django; django.setup(); from django.test import Client; print(Client().get('/healthz').status_code)"
    result = run_with_unreachable_database("-c", code)
    assert result.stdout.strip() == "503", result.stderr


def test_durable_health_fails_when_the_database_is_unreachable() -> None:
    result = run_with_unreachable_database(str(ROOT / "manage.py"), "durable_health")
    assert result.returncode == 1
    assert "database unavailable" in result.stderr


@pytest.mark.django_db
def test_worker_health_fails_with_only_other_hosts_or_dead_workers() -> None:
    now = timezone.now()
    beat = {"pid": 1, "transport": "db", "started_at": now - timedelta(hours=1)}
    WorkerHeartbeat.objects.create(worker_id="elsewhere:1:a", host="elsewhere", last_seen=now, **beat)
    WorkerHeartbeat.objects.create(
        worker_id="here:1:a", host=socket.gethostname(), last_seen=now - timedelta(minutes=10), **beat
    )
    WorkerHeartbeat.objects.create(
        worker_id="here:2:b", host=socket.gethostname(), last_seen=now, stopped_at=now, **beat
    )
    with pytest.raises(CommandError, match="no live worker on"):
        call_command("durable_health", "--worker")


def test_worker_health_passes_while_a_worker_runs_here(
    transactional_db: None, spawn: Callable[..., ManagedProcess]
) -> None:
    assert not healthy("--worker")
    worker = spawn("durable_worker", "--concurrency", "1", env=PROCESS_ENV)
    wait_for(lambda: healthy("--worker"), timeout=60, interval=0.5, what=f"a live heartbeat: {worker.output()}")


@pytest.mark.django_db
def test_poller_health_fails_when_the_last_sample_is_old() -> None:
    QueueSample.objects.create(queue="", at=timezone.now() - timedelta(minutes=10), interval_s=10)
    with pytest.raises(CommandError, match="no poller running: the last sample is"):
        call_command("durable_health", "--poller")


@pytest.mark.django_db
def test_poller_health_fails_when_no_poller_ever_ran() -> None:
    with pytest.raises(CommandError, match="no poller has run"):
        call_command("durable_health", "--poller")


def test_poller_health_passes_while_a_poller_runs(transactional_db: None, spawn: Callable[..., ManagedProcess]) -> None:
    poller = spawn("durable_poller", env=PROCESS_ENV)
    wait_for(lambda: healthy("--poller"), timeout=60, interval=0.5, what=f"a recent sample: {poller.output()}")
