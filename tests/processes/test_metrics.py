"""Prometheus metrics: who may scrape, and figures that move while real worker processes run."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from durable_flow import register_queue, start
from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.settings import get_settings, parse_settings, reset_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import counters
from durable_flow.store.counters import admissions, count_admission, decisions
from durable_flow.transports.db.transport import DatabaseTransport
from tests import (
    sc_workflows,  # noqa: F401  (registers the sc.* workflows)
    workflows,
)
from tests.conftest import ManagedProcess, MovableClock, wait_for
from tests.support.clients import StaffLogin
from tests.support.redis_keys import delete_keys

TOKEN = "s3cret-scrape-token-0123456789"
METERED = (("queue", "metered"),)
STEP = (("step", "tests.file_gate"),)
PROCESS_ENV = {"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`{(sample name, sorted labels): value}` of one scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def scrape(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics/")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return samples(response.content.decode())


@pytest.fixture
def staff_login() -> StaffLogin:
    return StaffLogin("ops", superuser=False, csrf=False)


@pytest.fixture
def with_token(settings: Any) -> Any:
    settings.DURABLE_FLOW = {**settings.DURABLE_FLOW, "METRICS": {"TOKEN": TOKEN}}
    reset_settings()
    yield
    reset_settings()


def test_anonymous_scrape_without_token_is_refused_with_401(transactional_db: None) -> None:
    response = Client().get("/metrics/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_a_logged_in_non_staff_user_gets_403(transactional_db: None) -> None:
    client = Client()
    client.force_login(User.objects.create_user("someone", password="pw"))
    assert client.get("/metrics/").status_code == 403


def test_the_bearer_token_from_settings_admits_a_scraper(with_token: Any, transactional_db: None) -> None:
    assert Client().get("/metrics/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert Client().get("/metrics/", HTTP_AUTHORIZATION="Bearer wrong-token-wrong-token").status_code == 401


def test_a_token_is_never_accepted_when_none_is_configured(transactional_db: None) -> None:
    assert get_settings().metrics_token is None
    assert Client().get("/metrics/", HTTP_AUTHORIZATION="Bearer ").status_code == 401


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ("x", 'DURABLE_FLOW["METRICS"]: must be a dict'),
        ({"TOKEN": "short"}, 'DURABLE_FLOW["METRICS"]["TOKEN"]: must be a string of at least 16 characters'),
        # The windowed histograms' look-back is gone with them: the histograms only grow now.
        ({"WINDOW_S": 300}, 'DURABLE_FLOW["METRICS"]: unknown option(s) WINDOW_S'),
        ({"PORT": 9100}, 'DURABLE_FLOW["METRICS"]: unknown option(s) PORT'),
    ],
)
def test_bad_metrics_settings_name_the_key(metrics: Any, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_settings({"METRICS": metrics})


def test_scrape_follows_real_workers_through_a_capped_queue(
    staff_client: Client, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    set_engine(Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings()))
    register_queue("metered", concurrency=1, rate_limit={"limit": 100, "period_ms": 60_000})
    gate = tmp_path / "open"
    runs = [start("tests.file_gated", {"path": str(gate), "queue": "metered", "id": f"m{i}"}) for i in range(3)]
    before = scrape(staff_client)
    assert before[("durable_flow_runs", (("status", "pending"), ("workflow", "tests.file_gated")))] == 3
    # One unit per name: slots, and admissions per rate period.
    assert before[("durable_flow_queue_concurrency_limit_slots", (("queue", "metered"),))] == 1
    assert before[("durable_flow_queue_rate_limit_admissions", (("queue", "metered"),))] == 100
    assert before[("durable_flow_queue_rate_period_seconds", (("queue", "metered"),))] == 60
    assert before[("durable_flow_queue_in_flight", (("queue", "metered"),))] == 0
    admitted = ("durable_flow_admissions_total", (("decision", "admitted"), ("queue", "metered")))
    parked = ("durable_flow_admissions_total", (("decision", "parked"), ("queue", "metered")))
    assert (before[admitted], before[parked]) == (0, 0)

    spawn("durable_poller", env=PROCESS_ENV)
    spawn("durable_worker", "--concurrency", "2", env=PROCESS_ENV)

    def blocked() -> dict[Any, float] | None:
        now = scrape(staff_client)
        in_flight = now[("durable_flow_queue_in_flight", (("queue", "metered"),))]
        waiting = now[("durable_flow_queue_waiting", (("queue", "metered"),))]
        busy = [
            v
            for (name, labels), v in now.items()
            if name == "durable_flow_worker_slots" and ("state", "busy") in labels
        ]
        # The worker writes its admission counts from a background thread, just after the
        # commits that count them (`counters.CountWriter`): wait for those too.
        counted = (now[admitted], now[parked])
        return now if (in_flight, waiting, busy, counted) == (1, 2, [1], (1, 2)) else None

    during = wait_for(blocked, timeout=60, what="one step in flight, two waiting, one busy worker slot, counted")
    (up,) = [v for (name, _), v in during.items() if name == "durable_flow_worker_up"]
    assert up == 1
    assert during[("durable_flow_runs", (("status", "running"), ("workflow", "tests.file_gated")))] == 1
    assert during[("durable_flow_runs", (("status", "suspended"), ("workflow", "tests.file_gated")))] == 2
    assert during[admitted] == 1  # counted by the worker process, read by this one
    assert during[parked] == 2  # the two behind it waited in line

    gate.touch()
    wait_for(
        lambda: WorkflowRun.objects.filter(pk__in=[r.id for r in runs], status=RunStatus.COMPLETED).count() == 3,
        timeout=60,
        what="all three runs to complete",
    )
    # Written by the worker's count writer moments after the grants' commits.
    after = wait_for(
        lambda: (now := scrape(staff_client))[admitted] == 3 and now,
        timeout=60,
        what="the worker's admission counts to be written",
    )
    # The gauge counts unfinished runs only; finished ones are the counter's (below).
    assert ("durable_flow_runs", (("status", "completed"), ("workflow", "tests.file_gated"))) not in after
    assert not after.get(("durable_flow_runs", (("status", "running"), ("workflow", "tests.file_gated"))))
    assert after[("durable_flow_queue_in_flight", (("queue", "metered"),))] == 0
    assert after[("durable_flow_queue_waiting", (("queue", "metered"),))] == 0
    assert after[admitted] == 3  # one direct admission, two grants to waiters
    assert after[parked] == 2  # a granted waiter counts under both; nothing parked twice
    # The histograms, flushed by the worker on its heartbeat.
    after = wait_for(
        lambda: (now := scrape(staff_client)).get(("durable_flow_step_duration_seconds_count", STEP)) == 3 and now,
        timeout=30,
        what="the worker's histogram counts to be written",
    )
    assert after[("durable_flow_admission_wait_seconds_count", METERED)] == 3
    assert after[("durable_flow_admission_wait_seconds_bucket", (("le", "+Inf"), *METERED))] == 3
    assert after[("durable_flow_schedule_to_start_seconds_count", METERED)] == 3
    # The two that queued behind the gate waited at least as long as the first one ran.
    assert after[("durable_flow_admission_wait_seconds_sum", METERED)] > 0
    assert after[("durable_flow_runs_finished_total", (("status", "completed"), ("workflow", "tests.file_gated")))] == 3


@pytest.fixture
def redis_engine(transactional_db: None) -> Iterator[RedisAdmissionBackend]:
    backend = RedisAdmissionBackend.from_options(
        {"CONNECTION": "default", "KEY_PREFIX": f"df:t:{uuid.uuid4().hex[:8]}"}
    )
    set_engine(Engine(admission=backend, transport=DatabaseTransport(), settings=get_settings()))
    yield backend
    delete_keys(backend.redis, f"{backend.prefix}:*")
    backend.close()


def test_in_flight_is_read_from_a_shared_admission_backend_at_scrape_time(
    redis_engine: RedisAdmissionBackend, staff_client: Client
) -> None:
    register_queue("remote", concurrency=3)
    # Slots taken by "another process": no checkpoint holds them, only Redis knows.
    for ticket in ("run-a/1", "run-b/1"):
        assert redis_engine.try_admit(AdmissionRequest(queue="remote", ticket=ticket)).admitted
    assert scrape(staff_client)[("durable_flow_queue_in_flight", (("queue", "remote"),))] == 2
    redis_engine.release("remote", "run-a/1")
    assert scrape(staff_client)[("durable_flow_queue_in_flight", (("queue", "remote"),))] == 1


def test_an_unreachable_admission_backend_does_not_fail_the_scrape(
    redis_engine: RedisAdmissionBackend, staff_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    register_queue("remote", concurrency=3)
    assert redis_engine.try_admit(AdmissionRequest(queue="remote", ticket="run-a/1")).admitted
    # Point the backend's script at a port where no Redis listens: a real connection error.
    redis_engine._script.registered_client = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    with caplog.at_level("WARNING", logger="durable_flow.contrib.metrics"):
        # Falls back to the checkpoints holding a slot (none here), instead of answering 500.
        assert scrape(staff_client)[("durable_flow_queue_in_flight", (("queue", "remote"),))] == 0
    assert "in_flight('remote') failed" in caplog.text


def test_admissions_total_counts_direct_admissions_and_grants_once_each(manual: Engine, staff_client: Client) -> None:
    from tests.engine_support import transport_of

    register_queue("render", concurrency=2)
    runs = [start("tests.queued", {"queue": "render", "value": i}) for i in range(5)]
    transport = transport_of(manual)
    transport.run_turns()
    assert len(transport.steps) == 2 and admissions() == {"render": 2}  # three wait for a slot
    assert decisions() == {"render": {"admitted": 2, "parked": 3}}
    transport.run_all()  # each result grants its slot to the next waiter
    assert WorkflowRun.objects.filter(pk__in=[r.pk for r in runs], status=RunStatus.COMPLETED).count() == 5
    assert decisions() == {"render": {"admitted": 5, "parked": 3}}
    scraped = scrape(staff_client)
    assert scraped[("durable_flow_admissions_total", (("decision", "admitted"), ("queue", "render")))] == 5
    assert scraped[("durable_flow_admissions_total", (("decision", "parked"), ("queue", "render")))] == 3


def test_a_retrys_admission_wait_is_observed_from_the_end_of_its_backoff(
    engine: Engine, clock: MovableClock, staff_client: Client
) -> None:
    """The first attempt is admitted at once; it fails, and when its backoff is over the retry
    finds the queue's one slot taken: it waits 30 s (the test's clock) for it."""
    register_queue("flaky-q", concurrency=1)
    workflows.FAILURES_LEFT["w"] = 1
    before = scrape(staff_client)
    run = start("tests.flaky_queued", {"key": "w", "queue": "flaky-q"})
    assert StepCheckpoint.objects.get(run=run).status == StepStatus.RETRYING
    assert engine.admission.try_admit(AdmissionRequest(queue="flaky-q", ticket="holder/1")).admitted
    clock.advance(seconds=1)  # the backoff is over: the retry asks for the slot, and waits
    TimerPoller(engine).tick()
    assert StepCheckpoint.objects.get(run=run).status == StepStatus.WAITING
    clock.advance(seconds=30)
    engine.grants.release_ticket("flaky-q", "holder/1")  # granted to the retry
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    after = scrape(staff_client)

    def delta(sample: str) -> float:
        key = (f"durable_flow_admission_wait_seconds_{sample}", (("queue", "flaky-q"),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("count") == 2  # both attempts
    # The first attempt's wait is about 0 (the call's creation is the wall clock's, which the
    # test's clock started at); the retry's is the 30 s it waited after its backoff.
    assert 30 <= delta("sum") < 31


def test_a_waiter_offered_again_without_a_slot_is_not_counted_twice(manual: Engine) -> None:
    from tests.engine_support import transport_of

    register_queue("narrow", concurrency=1)
    start("tests.queued", {"queue": "narrow", "value": 1})
    waiter = start("tests.queued", {"queue": "narrow", "value": 2})
    transport = transport_of(manual)
    transport.run_turns()
    manual.wake(waiter.id)  # replays the parked call: still no slot
    transport.run_turns()
    assert decisions() == {"narrow": {"admitted": 1, "parked": 1}}


def test_steps_on_no_queue_are_not_counted_even_when_step_concurrency_parks_them(
    manual: Engine, staff_client: Client
) -> None:
    from tests.engine_support import transport_of

    manual.admission = DatabaseAdmissionBackend()
    transport = transport_of(manual)
    transport.bind(manual)
    runs = [start("sc.per_account", {"account": "a", "seconds": 0, "id": i}) for i in range(3)]
    transport.run_turns()
    assert StepCheckpoint.objects.filter(run__in=[r.id for r in runs], status=StepStatus.WAITING).count() == 1
    transport.run_all()
    assert decisions() == {}  # two admitted, one parked, all per key: no queue "" series
    assert not [labels for (name, labels) in scrape(staff_client) if name == "durable_flow_admissions_total"]


def test_an_admission_in_a_rolled_back_transaction_is_not_counted(transactional_db: None) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        count_admission("q")
        raise RuntimeError("the turn failed")
    assert admissions() == {}
    count_admission("q")
    count_admission("q")
    assert admissions() == {"q": 2}


def test_a_worker_writes_its_counts_from_a_background_thread_summed_per_queue(transactional_db: None) -> None:
    """Inside a worker (`start_background_writes`), committed counts go to the writer thread,
    which sums them per queue: the committing thread sends no UPDATE. Stopping writes the rest;
    a rolled-back count is still never written."""
    statements: list[str] = []

    def log(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    counters.start_background_writes()
    try:
        with connection.execute_wrapper(log):
            for _ in range(5):
                count_admission("q")
            with pytest.raises(RuntimeError), transaction.atomic():
                count_admission("q")
                raise RuntimeError("the turn failed")
        assert not [sql for sql in statements if "queuecounter" in sql.lower()]  # none on this thread
    finally:
        counters.stop_background_writes()
    assert admissions() == {"q": 5}
    count_admission("q")  # stopped: written at the commit again
    assert admissions() == {"q": 6}
