"""Prometheus counters and histograms counted at the event by real worker processes, read by a
scrape of this (web) process; OpenMetrics on request; a worker's series keep its stable name
across restarts and end with a graceful stop."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

from durable_flow import cancel, register_queue, start
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.exceptions import ConcurrencyLimitError
from durable_flow.models import RunStatus, WorkerHeartbeat, WorkflowRun
from durable_flow.transports.db.transport import DatabaseTransport
from tests.conftest import ManagedProcess, wait_for
from tests.processes.test_metrics import PROCESS_ENV, scrape

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def labels(**given: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(given.items()))


def delta(before: Scrape, after: Scrape, name: str, **given: str) -> float:
    key = (name, labels(**given))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
def db_engine(transactional_db: None) -> Engine:
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    return engine


def test_counters_and_histograms_follow_real_runs(
    db_engine: Engine, staff_client: Client, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    register_queue("counted", concurrency=2)
    gate = tmp_path / "open"
    gate.touch()
    before = scrape(staff_client)
    assert ("durable_flow_runs_finished_total", labels(status="completed", workflow="tests.file_gated")) not in before

    done = [start("tests.file_gated", {"path": str(gate), "queue": "counted", "id": f"c{i}"}) for i in range(4)]
    failing = start("tests.fails", None)  # always_fails: retries=1, so two failed attempts
    holder = start("tests.quota_sleeper", {"tenant": "t", "seconds": 600})
    with pytest.raises(ConcurrencyLimitError):  # the tenant's one slot is held
        start("tests.quota_sleeper", {"tenant": "t", "seconds": 600})

    spawn("durable_poller", env=PROCESS_ENV)
    spawn("durable_worker", "--concurrency", "3", env=PROCESS_ENV)
    finished = [r.id for r in done] + [failing.id]
    wait_for(
        lambda: (
            WorkflowRun.objects.filter(pk__in=finished, status__in=[RunStatus.COMPLETED, RunStatus.FAILED]).count()
            == len(finished)
        ),
        timeout=60,
        what="the runs to finish",
    )
    wait_for(lambda: WorkflowRun.objects.get(pk=holder.id).status == RunStatus.SUSPENDED, timeout=30, what="a sleep")
    cancel(holder.id)  # in this process: counted here, written by the scrape's flush

    def counted() -> Scrape | None:
        now = scrape(staff_client)
        return (
            now
            if delta(before, now, "durable_flow_step_duration_seconds_count", step="tests.file_gate") == 4
            and (delta(before, now, "durable_flow_runs_finished_total", status="failed", workflow="tests.fails") == 1)
            else None
        )

    after = wait_for(counted, timeout=30, what="the worker's counts to be flushed on its heartbeat")
    runs = "durable_flow_runs_finished_total"
    assert delta(before, after, runs, status="completed", workflow="tests.file_gated") == 4
    assert delta(before, after, runs, status="failed", workflow="tests.fails") == 1
    assert delta(before, after, runs, status="cancelled", workflow="tests.quota_sleeper") == 1
    attempts = "durable_flow_step_attempts_total"
    assert delta(before, after, attempts, outcome="completed", step="tests.file_gate") == 4
    assert delta(before, after, attempts, outcome="failed", step="tests.always_fails") == 2
    assert delta(before, after, "durable_flow_step_retries_total", step="tests.always_fails") == 1
    assert delta(before, after, "durable_flow_starts_refused_total", workflow="tests.quota_sleeper") == 1
    # Real histograms: a count, a sum, and cumulative buckets ending in +Inf = the count.
    assert delta(before, after, "durable_flow_admission_wait_seconds_count", queue="counted") == 4
    assert delta(before, after, "durable_flow_schedule_to_start_seconds_count", queue="counted") == 4
    assert delta(before, after, "durable_flow_step_duration_seconds_count", step="tests.always_fails") == 2
    buckets = sorted(
        (float(dict(lbls)["le"]), value)
        for (name, lbls), value in after.items()
        if name == "durable_flow_step_duration_seconds_bucket" and ("step", "tests.file_gate") in lbls
    )
    assert [value for _, value in buckets] == sorted(value for _, value in buckets)  # cumulative
    assert buckets[-1] == (float("inf"), 4)
    assert after[("durable_flow_step_duration_seconds_sum", labels(step="tests.file_gate"))] > 0

    # Counters only grow: a retried run's earlier failure stays counted.
    again = scrape(staff_client)
    assert delta(after, again, runs, status="failed", workflow="tests.fails") == 0


def test_a_scraper_asking_for_openmetrics_gets_it(db_engine: Engine, staff_client: Client) -> None:
    register_queue("om", concurrency=1)
    start("tests.quota_sleeper", {"tenant": "om", "seconds": 600})
    with pytest.raises(ConcurrencyLimitError):
        start("tests.quota_sleeper", {"tenant": "om", "seconds": 600})
    response = staff_client.get(
        "/metrics/", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0; charset=utf-8,text/plain;q=0.5"
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text")
    text = response.content.decode()
    assert text.endswith("# EOF\n")
    families = {family.name: family for family in openmetrics_families(text)}  # strict: fails on bad syntax
    assert families["durable_flow_starts_refused"].type == "counter"
    assert [s.value for s in families["durable_flow_starts_refused"].samples if s.name.endswith("_total")] == [1]
    assert families["durable_flow_step_duration_seconds"].type == "histogram"
    assert families["durable_flow_queue_concurrency_limit_slots"].samples[0].value == 1
    # Without the Accept header: the Prometheus text format.
    plain = staff_client.get("/metrics/")
    assert plain["Content-Type"].startswith("text/plain") and "# EOF" not in plain.content.decode()


def worker_series(scraped: Scrape) -> dict[str, float]:
    return {dict(lbls)["worker"]: v for (name, lbls), v in scraped.items() if name == "durable_flow_worker_up"}


def test_a_worker_keeps_its_name_across_restarts_and_its_series_end_with_a_graceful_stop(
    db_engine: Engine, staff_client: Client, spawn: Callable[..., ManagedProcess]
) -> None:
    host = socket.gethostname()
    first = spawn("durable_worker", env=PROCESS_ENV)
    wait_for(lambda: worker_series(scrape(staff_client)) == {f"{host}:w0": 1}, timeout=30, what="w0 up")
    second = spawn("durable_worker", env=PROCESS_ENV)  # the next free number on this host
    wait_for(
        lambda: worker_series(scrape(staff_client)) == {f"{host}:w0": 1, f"{host}:w1": 1}, timeout=30, what="w1 up"
    )

    assert first.terminate() == 0  # SIGTERM: a graceful stop
    assert WorkerHeartbeat.objects.get(pk=f"{host}:w0").stopped_at is not None
    # Gone at once, not `worker_up 0` for an hour (an alert would fire on every deploy).
    assert worker_series(scrape(staff_client)) == {f"{host}:w1": 1}

    restarted = spawn("durable_worker", env=PROCESS_ENV)  # takes the lowest free name again: w0
    wait_for(
        lambda: worker_series(scrape(staff_client)) == {f"{host}:w0": 1, f"{host}:w1": 1},
        timeout=30,
        what="the restarted worker under its old name",
    )
    assert WorkerHeartbeat.objects.filter(host=host).count() == 2  # no new identity, no new row
    assert restarted.terminate() == 0 and second.terminate() == 0
    assert worker_series(scrape(staff_client)) == {}


def test_a_named_worker_that_crashed_reads_0_and_its_restart_takes_the_name_back(
    db_engine: Engine, staff_client: Client, spawn: Callable[..., ManagedProcess], settings: Any
) -> None:
    settings.DURABLE_FLOW = {**settings.DURABLE_FLOW, "HEARTBEAT": {"INTERVAL_S": 0.5, "TTL_S": 2}}
    reset_settings()
    env = {**PROCESS_ENV, "DURABLE_FLOW_HEARTBEAT_TTL_S": "2"}
    worker_id = f"{socket.gethostname()}:billing"
    crashed = spawn("durable_worker", "--name", "billing", env=env)
    wait_for(lambda: worker_series(scrape(staff_client)) == {worker_id: 1}, timeout=30, what="billing up")
    crashed.kill()  # SIGKILL: no stop recorded
    # Silent past the TTL: down, and still reported (until WORKER_HORIZON), so an alert can fire.
    wait_for(lambda: worker_series(scrape(staff_client)) == {worker_id: 0}, timeout=30, what="billing down")
    spawn("durable_worker", "--name", "billing", env=env)
    wait_for(lambda: worker_series(scrape(staff_client)) == {worker_id: 1}, timeout=30, what="billing back")
    reset_settings()
