"""Step concurrency in the engine: declarations, the constraints a run stores, and how many
steps the engine lets execute at once (turns and steps driven by hand)."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_flow import start, workflow
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.definitions.step_concurrency import parse_concurrency, plan_run
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidInput, RegistrationError
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from tests import sc_workflows
from tests.conftest import MovableClock, local_engine
from tests.engine_support import ManualTransport, transport_of
from tests.support.redis_keys import delete_keys

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def executing(account: str | None = None) -> int:
    """Steps dispatched and not yet settled (of one account's runs)."""
    steps = StepCheckpoint.objects.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED)
    if account is not None:
        steps = steps.filter(run__input__account=account)
    return steps.count()


# -- declarations ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "limit must be an integer from 0 to"),
        ({"limit": "2"}, "limit must be an integer from 0 to"),
        ({"limit": 2, "scope": "galaxy"}, "scope must be one of"),
        ({"limit": 2, "scope": "env"}, "scope 'env' requires a key"),
        ({"limit": 2, "scope": "account"}, "scope 'account' requires a key"),
        ([{"limit": 1}, {"limit": 2, "key": "input.a"}, {"limit": 3, "key": "input.b"}], "at most 2"),
        ({"limit": 2, "key": "input.("}, "not a valid CEL expression"),
        ({"limit": 2, "key": 42}, "key must be a CEL expression or a callable"),
        ({"limit": 2, "keys": "input.a"}, "unknown field"),
    ],
)
def test_a_bad_declaration_fails_registration_naming_the_workflow(value: Any, message: str) -> None:
    with pytest.raises(RegistrationError, match=message) as error:
        workflow("sc.bad", concurrency=value)
    assert "'sc.bad'" in str(error.value)


def test_the_shorthands_parse_to_the_same_constraint() -> None:
    (int_form,) = parse_concurrency("wf", 10)
    (dict_form,) = parse_concurrency("wf", {"limit": 10})
    assert (int_form.limit, int_form.scope, int_form.key) == (dict_form.limit, dict_form.scope, dict_form.key)
    assert parse_concurrency("wf", 0) == () and parse_concurrency("wf", {"limit": 0}) == ()


# -- what a run stores ----------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_a_run_stores_its_evaluated_constraints(engine: Engine) -> None:
    run = start("sc.two", {"account": "acme", "seconds": 0})
    assert WorkflowRun.objects.get(pk=run.id).step_concurrency == [
        {"resource": "sc:acct:openai", "limit": 5},
        {"resource": "sc:fn:sc.two:acme", "limit": 2},
    ]


def test_scopes_name_their_resources() -> None:
    (env_spec,) = parse_concurrency("wf", {"scope": "env", "key": 'input.a + "-" + workflow', "limit": 3})
    (fn_callable,) = parse_concurrency("wf", {"key": lambda payload: payload["a"], "limit": 3})
    (run_scoped,) = parse_concurrency("wf", {"key": "run_id", "limit": 1})
    assert env_spec.resource("wf", "staging", {"a": "x"}, "r1") == "sc:env:staging:x-wf"
    assert fn_callable.resource("wf", "staging", {"a": "x"}, "r1") == "sc:fn:wf:x"
    assert run_scoped.resource("wf", "staging", {}, "r1") == "sc:fn:wf:r1"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("payload", [{"account": 7}, {"other": "x"}, None])
def test_a_key_that_is_not_a_string_refuses_the_start(engine: Engine, payload: Any) -> None:
    with pytest.raises(InvalidInput, match=r"'sc.per_account'.*input\.account"):
        start("sc.per_account", payload)
    assert not WorkflowRun.objects.exists()


class NoConstraintsBackend(LocalAdmissionBackend):
    """A third-party backend that does not claim step concurrency (every shipped one does)."""

    SUPPORTS_CONSTRAINTS = False


@pytest.mark.django_db(transaction=True)
def test_a_backend_that_cannot_enforce_constraints_refuses_the_start(engine: Engine) -> None:
    with pytest.raises(ImproperlyConfigured, match=r'DURABLE_FLOW\["ADMISSION"\]'):
        plan_run(sc_workflows.per_account, {"account": "a"}, "r1", "default", NoConstraintsBackend())


def test_every_shipped_backend_enforces_step_concurrency() -> None:
    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    assert all(b.SUPPORTS_CONSTRAINTS for b in (LocalAdmissionBackend, DatabaseAdmissionBackend, RedisAdmissionBackend))


# -- how many execute -----------------------------------------------------------------------
@pytest.fixture(params=["local", "db", "redis"])
def manual_sc(request: pytest.FixtureRequest, clock: MovableClock, transactional_db: None) -> Iterator[Engine]:
    engine = local_engine(clock, ManualTransport())
    if request.param == "db":
        engine.admission = DatabaseAdmissionBackend(clock=lambda: clock.ms)
    elif request.param == "redis":
        from durable_flow.admission.redis.backend import RedisAdmissionBackend

        prefix = f"test:sc:{uuid.uuid4().hex[:12]}"
        engine.admission = RedisAdmissionBackend(url=REDIS_URL, clock=lambda: clock.ms, key_prefix=prefix)
    transport_of(engine).bind(engine)
    yield engine
    if request.param == "redis":
        engine.admission.close()
        client = engine.admission.redis
        delete_keys(client, f"{prefix}:*")


def test_two_accounts_each_execute_at_most_their_limit(manual_sc: Engine) -> None:
    transport = transport_of(manual_sc)
    runs = [start("sc.per_account", {"account": acct, "seconds": 0, "id": i}) for acct in "ab" for i in range(5)]
    transport.run_turns()
    assert (executing("a"), executing("b")) == (2, 2)
    assert StepCheckpoint.objects.filter(status=StepStatus.WAITING).count() == 6
    peaks: Counter[str] = Counter()

    def watch(_: Any) -> None:
        for acct in "ab":
            peaks[acct] = max(peaks[acct], executing(acct))

    transport.run_all(on_step=watch)
    assert peaks == Counter(a=2, b=2)
    assert WorkflowRun.objects.filter(pk__in=[r.id for r in runs], status=RunStatus.COMPLETED).count() == 10


def test_a_sleeping_run_holds_no_slot(manual_sc: Engine, clock: MovableClock) -> None:
    transport = transport_of(manual_sc)
    runs = [start("sc.sleeper", {"seconds": 0, "id": i, "sleep": 60}) for i in range(15)]
    transport.run_all()
    # Every run's first step ran (10 at a time) and every run now sleeps: no slot held.
    assert WorkflowRun.objects.filter(status=RunStatus.SUSPENDED).count() == 15
    assert executing() == 0
    clock.advance(seconds=61)
    from durable_flow.runtime.poller import TimerPoller

    TimerPoller(manual_sc).tick()
    transport.run_turns()
    assert executing() == 10
    transport.run_all()
    assert WorkflowRun.objects.filter(pk__in=[r.id for r in runs], status=RunStatus.COMPLETED).count() == 15


def test_parallel_steps_take_a_slot_each(manual_sc: Engine) -> None:
    transport = transport_of(manual_sc)
    run = start("sc.fan", {"seconds": 0, "id": "f"})
    transport.run_turns()
    assert executing() == 3
    peak = 0

    def watch(_: Any) -> None:
        nonlocal peak
        peak = max(peak, executing())

    transport.run_all(on_step=watch)
    assert peak == 3
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED


def test_a_step_started_on_a_freed_slot_keeps_the_run_due_at_the_earliest_deadline(
    manual_sc: Engine, clock: MovableClock
) -> None:
    """A run is woken by the earliest deadline of its steps in flight: a step granted a slot
    later (its deadline later) leaves the run due at the deadline of the one still running."""
    from durable_flow.runtime.poller import TimerPoller

    transport = transport_of(manual_sc)
    run = start("sc.fan_deadline", {"seconds": 0, "id": "d"})
    transport.run_turns()
    first_deadline = clock() + timedelta(seconds=5)
    assert executing() == 2
    clock.advance(seconds=1)
    transport.execute(transport.steps.pop(0))  # frees a slot: the third step starts, due at +6 s
    assert executing() == 2
    run.refresh_from_db()
    assert run.wake_at == first_deadline
    clock.advance(seconds=4)
    assert TimerPoller(manual_sc).tick() == [run.id]  # the step still running from the start timed out


def test_two_constraints_hold_together(manual_sc: Engine) -> None:
    transport = transport_of(manual_sc)
    for acct in "abcd":
        for i in range(3):
            start("sc.two", {"account": acct, "seconds": 0, "id": f"{acct}{i}"})
    transport.run_turns()
    # Shared ceiling 5, per account 2: 5 executing, no account over 2.
    assert executing() == 5
    assert max(executing(acct) for acct in "abcd") == 2
    peaks = {"all": 0, "acct": 0}

    def watch(_: Any) -> None:
        peaks["all"] = max(peaks["all"], executing())
        peaks["acct"] = max(peaks["acct"], *(executing(acct) for acct in "abcd"))

    transport.run_all(on_step=watch)
    assert peaks == {"all": 5, "acct": 2}


def test_a_higher_limit_on_a_shared_key_may_start_more(manual_sc: Engine) -> None:
    transport = transport_of(manual_sc)
    for i in range(6):
        start("sc.wide", {"seconds": 0, "id": f"w{i}", "account": "w"})
    transport.run_turns()
    assert executing() == 6  # "openai" has 6 active: sc.two (limit 5) must wait
    start("sc.two", {"account": "x", "seconds": 0, "id": "t"})
    transport.run_turns()
    assert executing("x") == 0
    start("sc.wide", {"seconds": 0, "id": "w6", "account": "w"})
    transport.run_turns()
    assert executing("w") == 7


def test_a_changed_key_expression_leaves_queued_runs_on_their_old_key(manual_sc: Engine) -> None:
    transport = transport_of(manual_sc)
    first = start("sc.queued_free", {"account": "a", "region": "eu", "seconds": 0})
    second = start("sc.queued_free", {"account": "a", "region": "eu", "seconds": 0})
    transport.run_turns()
    assert executing() == 1
    # Redeploy with the key on region: new runs get the new key, the queued one keeps "a".
    fn = sc_workflows.queued_free.fn
    workflow("sc.queued_free", concurrency={"limit": 1, "key": "input.region"})(fn)
    try:
        third = start("sc.queued_free", {"account": "a", "region": "eu", "seconds": 0})
    finally:
        workflow("sc.queued_free", concurrency={"limit": 1, "key": "input.account"})(fn)
    assert WorkflowRun.objects.get(pk=second.id).step_concurrency[0]["resource"] == "sc:fn:sc.queued_free:a"
    assert WorkflowRun.objects.get(pk=third.id).step_concurrency[0]["resource"] == "sc:fn:sc.queued_free:eu"
    transport.run_turns()
    assert executing() == 2  # the new key has its own slot
    transport.run_all()
    assert WorkflowRun.objects.filter(pk__in=[first.id, second.id, third.id], status=RunStatus.COMPLETED).count() == 3


def test_a_freed_slot_never_goes_to_a_step_of_a_paused_queue(manual_sc: Engine) -> None:
    from durable_flow.operations import api

    transport = transport_of(manual_sc)
    open_q, paused_q = f"sc-open-{uuid.uuid4().hex[:6]}", f"sc-paused-{uuid.uuid4().hex[:6]}"
    api.register_queue(open_q, concurrency=5)
    api.register_queue(paused_q, concurrency=5)
    first = start("sc.queued", {"account": "acme", "queue": open_q, "seconds": 0, "id": "1"})
    second = start("sc.queued", {"account": "acme", "queue": paused_q, "seconds": 0, "id": "2"})
    transport.run_turns()
    assert executing() == 1  # the second waits for acme's one slot
    api.pause_queue(paused_q)
    transport.run_all()  # the first's step ends and frees acme's slot: not for a paused queue
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
    waiting = StepCheckpoint.objects.get(run_id=second.id, kind=StepKind.STEP)
    assert waiting.status == StepStatus.WAITING and executing() == 0
    api.resume_queue(paused_q)  # resuming grants it the slot
    assert executing() == 1
    transport.run_all()
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED


def test_the_admin_run_page_shows_the_evaluated_constraints(engine: Engine, admin_client: Any) -> None:
    run = start("sc.two", {"account": "acme", "seconds": 0})
    page = admin_client.get(f"/admin/durable_flow/workflowrun/{run.id}/change/")
    assert page.status_code == 200
    assert "sc:acct:openai" in page.content.decode() and "sc:fn:sc.two:acme" in page.content.decode()


def test_check_warns_when_the_backend_cannot_enforce_step_concurrency(settings: Any) -> None:
    from durable_flow.checks import check_settings
    from durable_flow.config.settings import reset_settings

    backend = f"{__name__}.NoConstraintsBackend"
    settings.DURABLE_FLOW = {**settings.DURABLE_FLOW, "ADMISSION": {"BACKEND": backend}}
    reset_settings()
    try:
        warnings = [m for m in check_settings() if m.id == "durable_flow.W001"]
    finally:
        reset_settings()
    assert warnings and "sc.per_account" in warnings[0].msg
