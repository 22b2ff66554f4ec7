"""Why a call waits, as the engine records it when it parks the call (`wait_cause` and
`wait_detail` on its checkpoint), on both engine pairs: a queue's cap, a rate window, a key's
step-concurrency limit, a paused queue, a signal. Each cause is cleared when the call is
admitted (or the signal arrives), and the queue wait's detail stays on the attempt it preceded.
The run list filters by it, and the run page names it in operator words."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.test import Client

from durable_flow import pause_queue, register_queue, resume_queue, send_signal, start
from durable_flow.admission.base import AdmissionBackend, AdmissionRequest
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig, RateLimit
from durable_flow.definitions.step_concurrency import Constraint
from durable_flow.engine import Engine
from durable_flow.engine.wait_causes import admission_cause
from durable_flow.models import RunStatus, StepAttempt, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.observe.run_filters import filtered_runs
from durable_flow.observe.timeline import build_timeline
from durable_flow.observe.waits import describe
from durable_flow.runtime.poller import TimerPoller
from durable_flow.transports.inline import InlineTransport
from tests import sc_workflows  # noqa: F401 - registers the step-concurrency workflows
from tests.conftest import MovableClock, local_engine
from tests.support.engine_pairs import db_engine
from tests.support.held import queued
from tests.support.redis_admission import REDIS_URL
from tests.support.redis_keys import delete_keys
from tests.support.statements import capture


def step_of(run: Any) -> StepCheckpoint:
    return StepCheckpoint.objects.get(run_id=run.id, kind=StepKind.STEP)


def waiting_for(cause: str) -> set[str]:
    return set(filtered_runs({"waiting": cause}).values_list("pk", flat=True))


def hold(engine: Engine, queue: str, ticket: str, constraints: tuple[Constraint, ...] = ()) -> None:
    """Take a slot as another call would, so the next call finds it full."""
    assert engine.admission.try_admit(AdmissionRequest(queue=queue, ticket=ticket, constraints=constraints)).admitted


def test_a_full_cap_is_recorded_and_cleared_when_the_call_is_admitted(engine: Engine, clock: MovableClock) -> None:
    register_queue("render", concurrency=1)
    hold(engine, "render", "holder/1")
    run = start("tests.queued", queued("render", "a"))
    cp = step_of(run)
    assert (cp.status, cp.wait_cause) == (StepStatus.WAITING, "cap")
    assert cp.wait_detail == {"cause": "cap", "queue": "render", "limit": 1}
    assert describe(cp.wait_detail) == "queue `render`: cap 1/1"
    assert waiting_for("cap") == {run.id} and waiting_for("rate") == set()
    clock.advance(seconds=30)
    engine.grants.release_ticket("render", "holder/1")  # the slot goes back: granted to the waiter
    cp = step_of(run)
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert cp.wait_cause == ""  # admitted: waiting for nothing
    assert waiting_for("cap") == set()
    # The queue wait stays with the attempt it preceded, for the timeline.
    assert StepAttempt.objects.get(checkpoint=cp).waited == {"cause": "cap", "queue": "render", "limit": 1}
    (row,) = [r for r in build_timeline(WorkflowRun.objects.get(pk=run.id), now=clock()).rows if r.key == cp.key]
    assert row.segments[0].kind == "queue" and row.segments[0].seconds > 25  # created_at is the wall clock
    assert row.segments[0].label == "queue wait: queue `render`: cap 1/1"


def test_a_full_rate_window_is_recorded_with_when_it_reopens(engine: Engine, clock: MovableClock) -> None:
    register_queue("api", rate_limit={"limit": 1, "period_ms": 60_000})
    first = start("tests.queued", queued("api", "a"))
    second = start("tests.queued", queued("api", "b"))
    assert step_of(first).wait_cause == ""  # admitted at once: nothing recorded
    assert StepAttempt.objects.get(checkpoint=step_of(first)).waited is None
    cp = step_of(second)
    assert cp.wait_cause == "rate"
    assert {k: cp.wait_detail[k] for k in ("queue", "limit", "period_ms")} == {
        "queue": "api",
        "limit": 1,
        "period_ms": 60_000,
    }
    assert describe(cp.wait_detail, clock()).startswith("queue `api`: rate window 1/1 per 60 s until ")
    assert waiting_for("rate") == {second.id}
    clock.advance(seconds=61)
    engine.grants.grant("api")  # what the grant timer does when the window reopens
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED
    assert step_of(second).wait_cause == ""


def test_a_keys_step_concurrency_limit_is_recorded_with_the_keys_value(engine: Engine) -> None:
    hold(engine, "", "holder/1", (Constraint("sc:fn:sc.queued_free:cust-7", 1),))
    run = start("sc.queued_free", {"account": "cust-7", "seconds": 0})
    cp = step_of(run)
    assert cp.wait_cause == "key"
    assert cp.wait_detail == {
        "cause": "key",
        "queue": "",
        "resource": "sc:fn:sc.queued_free:cust-7",
        "key": "cust-7",
        "scope": "fn",
        "limit": 1,
    }
    assert describe(cp.wait_detail) == "key `cust-7` limit 1"  # no queue: none named
    assert waiting_for("key") == {run.id}
    engine.grants.release_ticket("", "holder/1")
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert step_of(run).wait_cause == ""


def test_a_paused_queue_is_recorded_and_cleared_on_resume(engine: Engine) -> None:
    register_queue("exports", concurrency=5)
    pause_queue("exports")
    run = start("tests.queued", queued("exports", "a"))
    cp = step_of(run)
    assert (cp.wait_cause, cp.wait_detail) == ("paused", {"cause": "paused", "queue": "exports"})
    assert describe(cp.wait_detail) == "queue `exports`: queue paused"
    assert waiting_for("paused") == {run.id}
    resume_queue("exports")
    TimerPoller(engine).tick()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert step_of(run).wait_cause == ""


def test_a_signal_wait_names_its_signal_and_its_timeout_and_clears_when_it_arrives(
    engine: Engine, clock: MovableClock
) -> None:
    run = start("tests.signal_waiter", 86_400)  # times out tomorrow
    cp = StepCheckpoint.objects.get(run_id=run.id, kind=StepKind.SIGNAL)
    assert cp.wait_cause == "signal" and cp.wait_detail["names"] == ["approve"]
    text = describe(cp.wait_detail, clock())
    assert text.startswith("signal `approve`, times out ")
    assert (clock() + timedelta(days=1)).date().isoformat() in text  # the date: not today
    assert waiting_for("signal") == {run.id}
    send_signal(run.id, "approve", {"by": "me"})
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert StepCheckpoint.objects.get(pk=cp.pk).wait_cause == ""
    assert waiting_for("signal") == set()


def test_the_run_page_names_the_wait_and_the_signal_it_waits_for(engine: Engine, admin_client: Client) -> None:
    register_queue("render", concurrency=1)
    hold(engine, "render", "holder/1")
    parked = start("tests.queued", queued("render", "a"))
    page = admin_client.get(f"/dashboard/runs/{parked.id}/").content.decode()
    assert "queue `render`: cap 1/1" in page
    waiter = start("tests.signal_waiter", None)
    page = admin_client.get(f"/dashboard/runs/{waiter.id}/").content.decode()
    assert "signal `approve`, no timeout" in page
    assert 'value="approve"' in page  # the form offers the awaited name
    listed = admin_client.get("/dashboard/runs/?waiting=cap").content.decode()
    assert parked.id in listed and waiter.id not in listed


def test_a_keys_own_rate_limit_is_recorded_with_the_key(engine: Engine, clock: MovableClock) -> None:
    register_queue("per-tenant", rate_limit={"limit": 1, "period_ms": 60_000, "per": "key"}, fairness="key")
    first = start("tests.queued", queued("per-tenant", "a", key="cust-7"))
    other = start("tests.queued", queued("per-tenant", "b", key="cust-8"))
    second = start("tests.queued", queued("per-tenant", "c", key="cust-7"))
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
    assert WorkflowRun.objects.get(pk=other.id).status == RunStatus.COMPLETED  # another key: its own window
    cp = step_of(second)
    assert cp.wait_cause == "key_rate"
    assert {k: cp.wait_detail[k] for k in ("queue", "key", "limit", "period_ms")} == {
        "queue": "per-tenant",
        "key": "cust-7",
        "limit": 1,
        "period_ms": 60_000,
    }
    assert describe(cp.wait_detail, clock()).startswith("queue `per-tenant`: key `cust-7` limit 1 per 60 s until ")
    assert waiting_for("key_rate") == {second.id}


def test_asking_again_for_a_parked_call_rewrites_its_cause_only_when_it_changed(engine: Engine) -> None:
    """A turn's replay asks admission again for each call still in line: an unchanged cause
    costs no write (a fan-out's parked calls would otherwise each cost an UPDATE per turn); a
    changed one is rewritten."""
    register_queue("render", concurrency=1)
    hold(engine, "render", "holder/1")
    run = start("tests.queued", queued("render", "a"))
    cp = StepCheckpoint.objects.select_related("run").get(run_id=run.id, kind=StepKind.STEP)
    with transaction.atomic(), capture() as sent:
        assert not engine.admitter.admit(cp)
    assert not sent.writes_to(StepCheckpoint)
    pause_queue("render")
    with transaction.atomic(), capture() as sent:
        assert not engine.admitter.admit(cp)
    assert len(sent.writes_to(StepCheckpoint)) == 1
    assert StepCheckpoint.objects.get(pk=cp.pk).wait_cause == "paused"


# -- the same words on every admission backend ------------------------------------------------
def told(backend: AdmissionBackend, request: AdmissionRequest, workflow: str = "wf") -> str:
    """What the run page would say of `request` parked by `backend` (no "until": the backends
    read their own clocks)."""
    decision = backend.try_admit(request)
    assert not decision.admitted
    cause, detail = admission_cause(decision, request.queue, workflow, request.key, request.constraints)
    return describe({"cause": cause, **detail}).partition(" until ")[0]


def test_every_backend_tells_a_full_cap_in_the_same_words(admission_backend: AdmissionBackend) -> None:
    admission_backend.register(QueueConfig(name="capped", concurrency=2))
    for ticket in ("a/1", "b/1"):
        assert admission_backend.try_admit(AdmissionRequest("capped", ticket)).admitted
    assert told(admission_backend, AdmissionRequest("capped", "c/1")) == "queue `capped`: cap 2/2"


def test_every_backend_names_the_window_that_held_a_call_the_queues_or_its_keys(
    admission_backend: AdmissionBackend,
) -> None:
    """A queue with both a queue-wide and a per-key window: a key whose own window is full is
    told so while the queue's has room; once the queue's is full, every key is told that."""
    admission_backend.register(
        QueueConfig(
            name="api",
            rate_limit=RateLimit(2, 60_000),
            key_rate_limit=RateLimit(1, 60_000),
            fairness="key",
        )
    )
    assert admission_backend.try_admit(AdmissionRequest("api", "a/1", fairness_key="cust-7")).admitted
    held_by_key = told(admission_backend, AdmissionRequest("api", "b/1", fairness_key="cust-7"))
    assert held_by_key == "queue `api`: key `cust-7` limit 1 per 60 s"
    assert admission_backend.try_admit(AdmissionRequest("api", "c/1", fairness_key="cust-8")).admitted
    held_by_queue = told(admission_backend, AdmissionRequest("api", "d/1", fairness_key="cust-9"))
    assert held_by_queue == "queue `api`: rate window 2/2 per 60 s"


@pytest.mark.parametrize("queue", ["", "render"])
def test_every_backend_names_the_step_concurrency_constraint_that_held_a_call(
    admission_backend: AdmissionBackend, queue: str
) -> None:
    """A call with two constraints is told the one that was full (the first, when both are),
    whether it has a queue or is gated by its constraints alone."""
    if queue:
        admission_backend.register(QueueConfig(name=queue, concurrency=10))
    own, shared = Constraint("sc:fn:wf:cust-7", 1), Constraint("sc:acct:acme", 2)
    for holder in ("x/1", "y/1"):
        assert admission_backend.try_admit(AdmissionRequest(queue, holder, constraints=(shared,))).admitted
    named = f"queue `{queue}`: " if queue else ""
    second_full = AdmissionRequest(queue, "z/1", constraints=(own, shared))
    assert told(admission_backend, second_full) == named + "key `acme` (account) limit 2"
    assert admission_backend.try_admit(AdmissionRequest(queue, "w/1", constraints=(own,))).admitted
    both_full = AdmissionRequest(queue, "v/1", constraints=(own, shared))
    assert told(admission_backend, both_full) == named + "key `cust-7` limit 1"


@pytest.fixture(params=["local", "db", "redis"])
def any_admission(request: pytest.FixtureRequest, clock: MovableClock, transactional_db: None) -> Iterator[Engine]:
    """An engine on each admission backend, on the test's clock: `local` and `db` as the engine
    pairs run them, `redis` on the inline transport."""
    if request.param == "db":
        yield db_engine(clock)
        return
    engine = local_engine(clock, InlineTransport())
    if request.param == "local":
        yield engine
        return
    prefix = f"df:t:{uuid.uuid4().hex[:8]}"
    backend = RedisAdmissionBackend(url=REDIS_URL, clock=lambda: clock.ms, key_prefix=prefix)
    engine.admission = backend
    try:
        yield engine
    finally:
        backend.close()
        delete_keys(backend.redis, f"{prefix}:*")


def test_the_run_page_names_which_window_held_a_call_on_every_backend(
    any_admission: Engine, admin_client: Client
) -> None:
    register_queue(
        "per-tenant",
        rate_limit=[{"limit": 2, "period_ms": 60_000}, {"limit": 1, "period_ms": 60_000, "per": "key"}],
        fairness="key",
    )
    start("tests.queued", queued("per-tenant", "a", key="cust-7"))
    by_key = start("tests.queued", queued("per-tenant", "b", key="cust-7"))
    start("tests.queued", queued("per-tenant", "c", key="cust-8"))
    by_queue = start("tests.queued", queued("per-tenant", "d", key="cust-9"))
    assert (step_of(by_key).wait_cause, step_of(by_queue).wait_cause) == ("key_rate", "rate")
    page = admin_client.get(f"/dashboard/runs/{by_key.id}/").content.decode()
    assert "key `cust-7` limit 1 per 60 s until " in page
    page = admin_client.get(f"/dashboard/runs/{by_queue.id}/").content.decode()
    assert "rate window 2/2 per 60 s until " in page


def test_the_run_page_names_which_constraint_held_a_call_on_every_backend(
    any_admission: Engine, admin_client: Client
) -> None:
    """`sc.two` declares the shared "openai" ceiling first and its account's limit second: with
    the account's full, the page names the account's."""
    for holder in ("h1/1", "h2/1"):
        hold(any_admission, "", holder, (Constraint("sc:fn:sc.two:acme", 2),))
    run = start("sc.two", {"account": "acme", "seconds": 0})
    assert step_of(run).wait_detail["resource"] == "sc:fn:sc.two:acme"
    page = admin_client.get(f"/dashboard/runs/{run.id}/").content.decode()
    assert "key `acme` limit 2" in page
