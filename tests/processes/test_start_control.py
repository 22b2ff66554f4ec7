"""Debounce and singleton: decided at start, held in the database, safe under concurrent starts.

Time is the engine's injected clock: the poller's tick is called directly, so no test waits on
a wall-clock margin."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from durable_flow import InvalidInput, RegistrationError, workflow
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store.counters import start_outcomes
from tests.conftest import ManagedProcess, MovableClock, wait_for
from tests.engine_support import transport_of
from tests.workflows import add_one

BEGUN: list[Any] = []


@workflow("sc.debounced", debounce={"key": '"user:" + input.user', "period": timedelta(seconds=5)})
def debounced(ctx: Any, input: dict[str, Any]) -> Any:
    BEGUN.append(input)
    return input["n"]


@workflow(
    "sc.capped",
    debounce={"key": lambda payload: payload["user"], "period": timedelta(seconds=2), "max_wait": timedelta(seconds=5)},
)
def capped(ctx: Any, input: dict[str, Any]) -> Any:
    return input["n"]


@workflow("sc.only_one", singleton={"key": "input.account", "mode": "skip"})
def only_one(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow("sc.latest_wins", singleton={"key": "input.account", "mode": "cancel"})
def latest_wins(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow(
    "sc.max_wait_is_period",
    debounce={"key": "input.user", "period": timedelta(seconds=2), "max_wait": timedelta(seconds=2)},
)
def max_wait_is_period(ctx: Any, input: dict[str, Any]) -> Any:
    return input["n"]


@workflow("sc.one_step", singleton={"key": "input.account", "mode": "skip"})
def one_step(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.step(add_one, input["n"])


@workflow("sc.one_step_latest_wins", singleton={"key": "input.account", "mode": "cancel"})
def one_step_latest_wins(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.step(add_one, input["n"])


@workflow(
    "sc.debounced_quota",
    debounce={"key": "input.user", "period": timedelta(seconds=1)},
    quota={"key": "input.user", "limit": 1},
)
def debounced_quota(ctx: Any, input: dict[str, Any]) -> Any:
    return input["n"]


@pytest.fixture(autouse=True)
def _forget_begun() -> None:
    BEGUN.clear()


def began_with(input: dict[str, Any]) -> bool:
    """The debounced body ran, each time with `input` only. It is replay code: on `db-db` the
    worker's optimistic first turn replays it before the locked turn that records its end."""
    return bool(BEGUN) and all(begun == input for begun in BEGUN)


def runs(name: str) -> list[WorkflowRun]:
    return list(WorkflowRun.objects.filter(workflow=name).order_by("created_at"))


# -- debounce -------------------------------------------------------------------------------------


def test_fifty_starts_in_two_seconds_make_one_run_with_the_last_input(engine: Engine, clock: MovableClock) -> None:
    poller = TimerPoller(engine)
    returned = set()
    for n in range(50):
        returned.add(api.start("sc.debounced", {"user": "ann", "n": n}).pk)
        clock.advance(milliseconds=40)  # 50 starts over 2 s, each well inside the 5 s period
        assert poller.tick() == []
    assert len(returned) == 1
    (run,) = runs("sc.debounced")
    assert run.status == RunStatus.DEBOUNCED and BEGUN == []

    clock.advance(seconds=5)
    assert poller.tick() == [run.pk]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == 49
    assert began_with({"user": "ann", "n": 49})
    assert start_outcomes()[("sc.debounced", "debounced")] == 49


def test_the_run_begins_only_when_a_whole_period_passes_with_no_new_start(engine: Engine, clock: MovableClock) -> None:
    poller = TimerPoller(engine)
    run = api.start("sc.debounced", {"user": "ann", "n": 1})
    clock.advance(seconds=4)
    api.start("sc.debounced", {"user": "ann", "n": 2})
    clock.advance(seconds=4)  # 8 s after the first start, 4 s after the last
    assert poller.tick() == []
    clock.advance(seconds=1)
    assert poller.tick() == [run.pk]


def test_keys_debounce_apart(engine: Engine, clock: MovableClock) -> None:
    ann = api.start("sc.debounced", {"user": "ann", "n": 1})
    bob = api.start("sc.debounced", {"user": "bob", "n": 2})
    assert ann.pk != bob.pk
    clock.advance(seconds=5)
    assert sorted(TimerPoller(engine).tick()) == sorted([ann.pk, bob.pk])
    assert sorted(r.output for r in runs("sc.debounced")) == [1, 2]


def test_a_start_after_the_run_is_due_opens_a_new_run(engine: Engine, clock: MovableClock) -> None:
    first = api.start("sc.debounced", {"user": "ann", "n": 1})
    clock.advance(seconds=5)  # due, though the poller has not ticked yet
    second = api.start("sc.debounced", {"user": "ann", "n": 2})
    assert second.pk != first.pk
    assert TimerPoller(engine).tick() == [first.pk]
    first.refresh_from_db()
    assert first.output == 1 and WorkflowRun.objects.get(pk=second.pk).status == RunStatus.DEBOUNCED


def test_max_wait_caps_how_far_starts_push_the_run_back(engine: Engine, clock: MovableClock) -> None:
    poller = TimerPoller(engine)
    first = api.start("sc.capped", {"user": "ann", "n": 0})
    for n in range(1, 5):  # a start every second: the 2 s period alone would never pass
        clock.advance(seconds=1)
        assert api.start("sc.capped", {"user": "ann", "n": n}).pk == first.pk
        assert poller.tick() == []
    clock.advance(seconds=1)  # 5 s after the first start: max_wait
    assert poller.tick() == [first.pk]
    first.refresh_from_db()
    assert first.status == RunStatus.COMPLETED and first.output == 4
    assert api.start("sc.capped", {"user": "ann", "n": 5}).pk != first.pk


def test_a_max_wait_equal_to_the_period_is_allowed_and_never_lets_starts_push_the_run_back(
    engine: Engine, clock: MovableClock
) -> None:
    """`max_wait` must be at least the period: equal is allowed, and then the run begins one
    period after the first start, however many starts follow."""
    poller = TimerPoller(engine)
    first = api.start("sc.max_wait_is_period", {"user": "ann", "n": 0})
    clock.advance(seconds=1)
    assert api.start("sc.max_wait_is_period", {"user": "ann", "n": 1}).pk == first.pk
    clock.advance(seconds=1)
    assert poller.tick() == [first.pk]
    first.refresh_from_db()
    assert first.status == RunStatus.COMPLETED and first.output == 1


def test_the_pending_debounce_lives_in_the_database(engine: Engine, clock: MovableClock) -> None:
    """A process that never saw the starts (a restarted poller, a new engine) begins the run."""
    from durable_flow.transports.inline import InlineTransport
    from tests.conftest import local_engine

    run = api.start("sc.debounced", {"user": "ann", "n": 7})
    stored = WorkflowRun.objects.get(pk=run.pk)
    assert stored.status == RunStatus.DEBOUNCED and stored.wake_at == clock() + timedelta(seconds=5)
    clock.advance(seconds=5)
    assert TimerPoller(local_engine(clock, InlineTransport())).tick() == [run.pk]
    assert WorkflowRun.objects.get(pk=run.pk).output == 7


def test_a_stray_turn_does_not_begin_a_debounced_run(engine: Engine) -> None:
    run = api.start("sc.debounced", {"user": "ann", "n": 1})
    engine.run_turn(run.pk)
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.DEBOUNCED and BEGUN == []


def test_a_cancelled_debounced_run_never_begins(engine: Engine, clock: MovableClock) -> None:
    run = api.start("sc.debounced", {"user": "ann", "n": 1})
    assert api.cancel(run.pk).status == RunStatus.CANCELLED
    clock.advance(seconds=10)
    assert TimerPoller(engine).tick() == [] and BEGUN == []
    assert api.start("sc.debounced", {"user": "ann", "n": 2}).pk != run.pk


def test_folded_starts_take_no_quota_slot_and_the_debounced_run_holds_one(engine: Engine, clock: MovableClock) -> None:
    from durable_flow import ConcurrencyLimitError

    run = api.start("sc.debounced_quota", {"user": "ann", "n": 1})
    assert api.start("sc.debounced_quota", {"user": "ann", "n": 2}).pk == run.pk  # limit 1, not refused
    clock.advance(seconds=1)  # due, not yet begun: a new start would be a second run of the key
    with pytest.raises(ConcurrencyLimitError):
        api.start("sc.debounced_quota", {"user": "ann", "n": 3})
    TimerPoller(engine).tick()
    assert WorkflowRun.objects.get(pk=run.pk).output == 2


# -- singleton ------------------------------------------------------------------------------------


def test_skip_returns_the_run_in_progress_and_creates_nothing(engine: Engine) -> None:
    first = api.start("sc.only_one", {"account": "a1"})
    assert first.status == RunStatus.PENDING
    assert api.start("sc.only_one", {"account": "a1"}).pk == first.pk
    assert api.start("sc.only_one", {"account": "a2"}).pk != first.pk
    assert len(runs("sc.only_one")) == 2
    assert start_outcomes()[("sc.only_one", "skipped")] == 1


def test_skip_starts_a_new_run_once_the_last_one_finished(engine: Engine) -> None:
    first = api.start("sc.only_one", {"account": "a1"})
    api.send_signal(first.pk, "go", "done")
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.COMPLETED
    assert api.start("sc.only_one", {"account": "a1"}).pk != first.pk


def test_cancel_mode_cancels_the_run_in_progress_and_starts_the_new_one(engine: Engine) -> None:
    first = api.start("sc.latest_wins", {"account": "a1"})
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.SUSPENDED  # waiting for its signal
    second = api.start("sc.latest_wins", {"account": "a1"})
    assert second.pk != first.pk
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.CANCELLED
    assert WorkflowRun.objects.get(pk=second.pk).status == RunStatus.SUSPENDED
    assert start_outcomes()[("sc.latest_wins", "replaced")] == 1


@pytest.mark.parametrize("name", ["sc.only_one", "sc.latest_wins"])
def test_a_retry_is_refused_while_another_run_of_its_singleton_key_is_in_progress(engine: Engine, name: str) -> None:
    from durable_flow.exceptions import RetryRefused

    first = api.start(name, {"account": "a1"})
    api.cancel(first.pk)
    second = api.start(name, {"account": "a1"})
    with pytest.raises(RetryRefused, match=second.pk):
        api.retry(first.pk)
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.CANCELLED
    api.send_signal(second.pk, "go", "done")
    api.retry(first.pk)  # the key's run finished: the retried run is the one in progress
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.SUSPENDED


def test_a_replacing_start_refused_by_its_quota_leaves_the_run_in_progress(engine: Engine) -> None:
    """The cancel and the refusal share one transaction: refused, nothing is cancelled or counted."""
    from durable_flow import ConcurrencyLimitError

    first = api.start("sc.latest_wins", {"account": "a1"})
    holder = api.start("sc.latest_wins", {"account": "a2"}, quota={"key": "closed", "limit": 1})
    with pytest.raises(ConcurrencyLimitError):
        api.start("sc.latest_wins", {"account": "a1"}, quota={"key": "closed", "limit": 1})
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.SUSPENDED
    assert {run.pk for run in runs("sc.latest_wins")} == {first.pk, holder.pk}
    assert ("sc.latest_wins", "replaced") not in start_outcomes()


def test_skip_counts_a_pending_run_as_in_progress(manual: Engine) -> None:
    first = api.start("sc.one_step", {"account": "a1", "n": 1})
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.PENDING  # its first turn is queued
    assert api.start("sc.one_step", {"account": "a1", "n": 2}).pk == first.pk
    assert len(runs("sc.one_step")) == 1


def test_skip_counts_a_run_whose_step_executes_as_in_progress(manual: Engine) -> None:
    first = api.start("sc.one_step", {"account": "a1", "n": 1})
    transport_of(manual).run_turns()
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.RUNNING
    assert api.start("sc.one_step", {"account": "a1", "n": 2}).pk == first.pk
    assert len(runs("sc.one_step")) == 1


def test_skip_does_not_count_a_cancelling_run_as_in_progress(manual: Engine) -> None:
    """A run cancelled mid-step only waits for its ignored result: a new start makes a new run."""
    transport = transport_of(manual)
    first = api.start("sc.one_step", {"account": "a1", "n": 1})
    transport.run_turns()
    assert api.cancel(first.pk).status == RunStatus.CANCELLING
    second = api.start("sc.one_step", {"account": "a1", "n": 2})
    assert second.pk != first.pk and getattr(second, "start_outcome", None) is None
    assert ("sc.one_step", "skipped") not in start_outcomes()
    transport.run_all()
    assert [(run.status, run.output) for run in runs("sc.one_step")] == [
        (RunStatus.CANCELLED, None),
        (RunStatus.COMPLETED, 3),
    ]


def test_cancel_mode_leaves_a_cancelling_run_alone_and_counts_no_replacement(manual: Engine) -> None:
    transport = transport_of(manual)
    first = api.start("sc.one_step_latest_wins", {"account": "a1", "n": 1})
    transport.run_turns()
    assert api.cancel(first.pk).status == RunStatus.CANCELLING
    second = api.start("sc.one_step_latest_wins", {"account": "a1", "n": 2})
    assert second.pk != first.pk
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.CANCELLING  # still waiting for its step
    assert ("sc.one_step_latest_wins", "replaced") not in start_outcomes()


# -- bad declarations and bad keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": {"key": "input.(", "period": timedelta(seconds=1)}}, "not a valid CEL expression"),
        ({"debounce": {"key": "input.a", "period": timedelta(0)}}, "period must be a positive timedelta"),
        ({"debounce": {"key": "input.a", "period": 5}}, "period must be a positive timedelta"),
        ({"debounce": {"key": "input.a"}}, "needs a 'period'"),
        ({"debounce": {"period": timedelta(seconds=1)}}, "needs a 'key'"),
        (
            {"debounce": {"key": "input.a", "period": timedelta(seconds=5), "max_wait": timedelta(seconds=1)}},
            "must be at least the period",
        ),
        ({"debounce": {"key": "input.a", "period": timedelta(seconds=1), "delay": 1}}, "unknown field(s) delay"),
        ({"singleton": {"key": "input.a", "mode": "replace"}}, "mode must be one of skip, cancel"),
        ({"singleton": {"key": 42}}, "key must be a CEL expression or a callable"),
        ({"singleton": "input.a"}, "singleton must be a dict"),
        (
            {"singleton": {"key": "input.a"}, "debounce": {"key": "input.a", "period": timedelta(seconds=1)}},
            "cannot be combined",
        ),
    ],
)
def test_a_bad_declaration_fails_registration_naming_the_workflow(options: dict[str, Any], message: str) -> None:
    with pytest.raises(RegistrationError, match=r"workflow 'sc\.bad'") as caught:
        workflow("sc.bad", **options)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("name", "input"),
    [("sc.debounced", {"user": 7, "n": 1}), ("sc.debounced", {"n": 1}), ("sc.only_one", {"account": ""})],
)
def test_a_key_that_is_not_a_string_refuses_the_start_and_creates_nothing(
    engine: Engine, name: str, input: dict[str, Any]
) -> None:
    with pytest.raises(InvalidInput, match=name.replace(".", r"\.")):
        api.start(name, input)
    assert not WorkflowRun.objects.exists()


# -- visible -------------------------------------------------------------------------------------


def test_outcomes_show_in_the_metrics_and_on_the_overview(engine: Engine, django_user_model: Any) -> None:
    from django.test import Client

    from durable_flow.contrib.metrics import render_metrics

    for _ in range(3):
        api.start("sc.debounced", {"user": "ann", "n": 1})
    api.start("sc.only_one", {"account": "a1"})
    api.start("sc.only_one", {"account": "a1"})
    text = render_metrics()[0].decode()
    assert 'durable_flow_start_outcomes_total{outcome="debounced",workflow="sc.debounced"} 2.0' in text
    assert 'durable_flow_start_outcomes_total{outcome="skipped",workflow="sc.only_one"} 1.0' in text
    assert 'durable_flow_runs{status="debounced",workflow="sc.debounced"} 1.0' in text

    client = Client()
    client.force_login(django_user_model.objects.create_user("ops", password="pw", is_staff=True, is_superuser=True))
    page = client.get("/").content.decode()
    assert 'id="start-control"' in page
    row = page[page.index('data-workflow="sc.debounced"') :].split("</tr>")[0]
    assert "debounce 5 s" in row and re.search(r'class="debouncing num"[^>]*>1</td>', row)
    assert re.search(r'class="debounced num"[^>]*>2</td>', row)


def test_the_json_api_answers_200_when_no_run_was_created_and_400_for_a_bad_key(
    engine: Engine, django_user_model: Any
) -> None:
    import json

    from django.contrib.auth.models import Permission
    from django.test import Client

    user = django_user_model.objects.create_user("api", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="start_workflowrun"))
    client = Client()
    client.force_login(user)

    def post(body: dict[str, Any]) -> Any:
        return client.post("/api/runs/", data=json.dumps(body), content_type="application/json")

    first = post({"workflow": "sc.debounced", "input": {"user": "ann", "n": 1}})
    folded = post({"workflow": "sc.debounced", "input": {"user": "ann", "n": 2}})
    assert (first.status_code, folded.status_code) == (201, 200)
    assert folded.json()["id"] == first.json()["id"] and folded.json()["status"] == "debounced"
    assert folded.json()["input"] == {"user": "ann", "n": 2}
    assert post({"workflow": "sc.only_one", "input": {"account": "a1"}}).status_code == 201
    assert post({"workflow": "sc.only_one", "input": {"account": "a1"}}).status_code == 200
    bad = post({"workflow": "sc.only_one", "input": {"account": 5}})
    assert bad.status_code == 400 and "singleton key" in bad.content.decode()


def test_the_admin_shows_a_runs_start_key_and_finds_runs_by_it(engine: Engine, django_user_model: Any) -> None:
    from django.test import Client

    run = api.start("sc.capped", {"user": "ann", "n": 1})
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))
    page = client.get(f"/admin/durable_flow/workflowrun/{run.pk}/change/").content.decode()
    assert "Start key" in page and "Debounce until" in page
    found = client.get("/admin/durable_flow/workflowrun/", {"q": "ann"}).content.decode()
    assert run.pk in found


# -- concurrent starts ----------------------------------------------------------------------------


def race(starters: int, start: Callable[[int], WorkflowRun]) -> list[str]:
    """`starters` threads call `start(n)` at once; the run ids they got back."""
    barrier = threading.Barrier(starters)
    got: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def starter(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            run = start(n)
            with lock:
                got.append(run.pk)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=starter, args=(n,)) for n in range(starters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and len(got) == starters
    return got


def test_concurrent_debounced_starts_make_one_run(engine: Engine, clock: MovableClock) -> None:
    got = race(12, lambda n: api.start("sc.debounced", {"user": "ann", "n": n}))
    (run,) = runs("sc.debounced")
    assert set(got) == {run.pk} and run.status == RunStatus.DEBOUNCED
    assert start_outcomes()[("sc.debounced", "debounced")] == 11
    clock.advance(seconds=5)
    TimerPoller(engine).tick()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and began_with(run.input)


def test_concurrent_singleton_skips_leave_one_run(engine: Engine) -> None:
    got = race(12, lambda n: api.start("sc.only_one", {"account": "a1"}))
    (run,) = runs("sc.only_one")
    assert set(got) == {run.pk}
    assert start_outcomes()[("sc.only_one", "skipped")] == 11


def test_concurrent_singleton_cancels_leave_one_run_in_progress(engine: Engine) -> None:
    got = race(12, lambda n: api.start("sc.latest_wins", {"account": "a1"}))
    assert len(set(got)) == 12
    statuses = [run.status for run in runs("sc.latest_wins")]
    assert statuses.count(RunStatus.CANCELLED) == 11
    assert len([s for s in statuses if s in ("pending", "running", "suspended")]) == 1
    assert start_outcomes()[("sc.latest_wins", "replaced")] == 11


# -- real processes -------------------------------------------------------------------------------


def test_fifty_starts_in_two_seconds_run_once_with_the_last_input_on_real_processes(
    db_transport_engine: Engine,
    spawn: Callable[..., ManagedProcess],
    tmp_path: Path,
) -> None:
    """A poller and a worker process, real time: 50 starts 40 ms apart (the 5 s period is over
    a hundred times the gap), then exactly one run, which adds one to the last input."""
    marker = tmp_path / "marker"
    env = {"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_TEST_MARKER": str(marker)}
    spawn("durable_poller", env=env)
    spawn("durable_worker", "--concurrency", "2", env=env)
    ids = set()
    for n in range(50):
        ids.add(api.start("tests.debounced", {"user": "ann", "n": n}).pk)
        time.sleep(0.04)
    (run_id,) = ids
    run = wait_for(
        lambda: WorkflowRun.objects.filter(pk=run_id, status=RunStatus.COMPLETED).first(),
        timeout=60,
        what="the debounced run to complete",
    )
    assert run.output == 50 and WorkflowRun.objects.filter(workflow="tests.debounced").count() == 1
    executions = [line.split()[:2] for line in marker.read_text().splitlines()]
    assert executions == [["add_one", "49"]]
