"""Events: `send_event` recorded once per id, triggers starting one run per (event, workflow)
through the start gates, `ctx.wait_for_event` counting only events after the wait, `cancel_on`,
and bad input refused with a typed error.

Time is the engine's injected clock, moved between a wait's start and the events that should
count for it (an event counts for a wait that began at or before it was recorded)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durable_flow
from durable_flow.definitions.events import triggered_run_id
from durable_flow.definitions.registry import WorkflowDefinition
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidEvent, UnknownEvent
from durable_flow.models import Event, EventAction, EventDelivery, RunStatus, StartRefusal, WorkflowRun
from durable_flow.runtime.events import EventDeliverer
from tests.conftest import MovableClock

pytestmark = pytest.mark.django_db(transaction=True)

CREATED = "tests/orders.created"
PAID = "tests/orders.paid"
CANCELLED = "tests/orders.cancelled"


def _echo(ctx: Any, event: Any) -> Any:
    return event


def _wait_paid(ctx: Any, order: Any) -> Any:
    return ctx.wait_for_event(PAID, match="async.data.order == event.data.order", timeout=timedelta(hours=1))


def _wait_forever(ctx: Any, order: Any) -> Any:
    ctx.sleep(timedelta(days=1))
    return order


def _runs(workflow_name: str) -> list[WorkflowRun]:
    return list(WorkflowRun.objects.filter(workflow=workflow_name).order_by("id"))


# -- sending ----------------------------------------------------------------------------------
def test_an_event_id_sent_twice_is_one_event_and_the_second_send_returns_the_first(engine: Engine) -> None:
    first = durable_flow.send_event(CREATED, {"order": 1}, id="order-1")
    again = durable_flow.send_event(CREATED, {"order": 2}, id="order-1")
    assert again.pk == first.pk == "order-1"
    assert again.data == {"order": 1}
    assert Event.objects.count() == 1
    fresh = durable_flow.send_event(CREATED, {"order": 3})
    assert fresh.pk != first.pk and len(fresh.pk) == 32


@pytest.mark.parametrize(
    ("name", "data", "event_id", "error", "says"),
    [
        ("", {}, None, InvalidEvent, "non-empty string"),
        ("orders created", {}, None, InvalidEvent, "letters, digits"),
        ("x" * 201, {}, None, InvalidEvent, "at most 200"),
        (CREATED, [1, 2], None, InvalidEvent, "must be a JSON object"),
        (CREATED, {"when": object()}, None, InvalidEvent, "data of event"),
        (CREATED, {"blob": "x" * 2_000_000}, None, InvalidEvent, "data of event"),
        (CREATED, {}, "", InvalidEvent, "event id must not be empty"),
        (CREATED, {}, 17, InvalidEvent, "event id must be a string"),
        ("tests/never.declared", {}, None, UnknownEvent, "not declared"),
    ],
)
def test_bad_send_event_input_is_a_typed_error_and_records_nothing(
    engine: Engine, name: str, data: Any, event_id: Any, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        durable_flow.send_event(name, data, id=event_id)
    assert not Event.objects.exists()


# -- triggers ---------------------------------------------------------------------------------
def test_each_triggered_workflow_starts_one_run_with_the_event_as_its_input(
    engine: Engine, declare: Callable[..., WorkflowDefinition], clock: MovableClock
) -> None:
    declare("tests.events.a", trigger=CREATED)
    declare("tests.events.b", trigger=[CREATED, PAID])
    declare("tests.events.c", trigger=PAID)
    event = durable_flow.send_event(CREATED, {"order": 7, "total": 120}, id="o-7")

    runs = {run.workflow: run for run in WorkflowRun.objects.filter(workflow__startswith="tests.events.")}
    assert set(runs) == {"tests.events.a", "tests.events.b"}
    expected = {"name": CREATED, "data": {"order": 7, "total": 120}, "id": "o-7", "ts": clock.ms}
    for name, run in runs.items():
        assert run.id == triggered_run_id(name, "o-7")
        assert run.status == RunStatus.COMPLETED and run.output == expected
    event.refresh_from_db()
    assert not event.pending
    actions = set(EventDelivery.objects.values_list("workflow", "action"))
    assert actions == {("tests.events.a", EventAction.STARTED), ("tests.events.b", EventAction.STARTED)}


def test_a_delivery_repeated_after_a_crash_starts_nothing_twice(
    engine: Engine, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("tests.events.a", trigger=CREATED)
    declare("tests.events.b", trigger=CREATED)
    durable_flow.send_event(CREATED, {"order": 1}, id="o-1")
    # As if the sender died after its starts but before it marked the event delivered.
    Event.objects.filter(pk="o-1").update(pending=True, delivered_at=None)
    assert EventDeliverer(engine).deliver("o-1") is True
    assert durable_flow.send_event(CREATED, {"order": 1}, id="o-1").pending is False

    assert [run.id for run in _runs("tests.events.a")] == [triggered_run_id("tests.events.a", "o-1")]
    assert len(_runs("tests.events.b")) == 1
    assert EventDelivery.objects.filter(event_id="o-1").count() == 2


def test_trigger_if_starts_only_the_runs_whose_event_meets_it(
    engine: Engine, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("tests.events.big", trigger=CREATED, trigger_if="event.data.total > 100")
    durable_flow.send_event(CREATED, {"total": 50}, id="small")
    durable_flow.send_event(CREATED, {"total": 150}, id="big")
    durable_flow.send_event(CREATED, {}, id="no-total")  # the field is missing: no match, no error
    assert [run.input["id"] for run in _runs("tests.events.big")] == ["big"]
    assert not Event.objects.filter(pending=True).exists()


def test_a_triggered_start_passes_the_workflows_quota_keyed_by_event_data(
    engine: Engine, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare(
        "tests.events.quota",
        _wait_forever,
        trigger=CREATED,
        quota={"key": '"account:" + event.data.account', "limit": 1},
    )
    durable_flow.send_event(CREATED, {"account": "acme"}, id="e1")
    durable_flow.send_event(CREATED, {"account": "acme"}, id="e2")
    durable_flow.send_event(CREATED, {"account": "other"}, id="e3")

    started = {run.input["id"]: run.concurrency_key for run in _runs("tests.events.quota")}
    assert started == {"e1": "account:acme", "e3": "account:other"}
    refused = EventDelivery.objects.get(event_id="e2")
    assert refused.action == EventAction.REFUSED
    assert refused.run_id == triggered_run_id("tests.events.quota", "e2")
    assert StartRefusal.objects.filter(workflow="tests.events.quota").count() == 1
    # A refused start is not tried again by a later delivery of the same event.
    Event.objects.filter(pk="e2").update(pending=True)
    EventDeliverer(engine).deliver("e2")
    assert StartRefusal.objects.filter(workflow="tests.events.quota").count() == 1


def test_a_triggered_start_under_singleton_is_recorded_as_gated(
    engine: Engine, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("tests.events.one", _wait_forever, trigger=CREATED, singleton={"key": "event.data.account"})
    durable_flow.send_event(CREATED, {"account": "acme"}, id="s1")
    durable_flow.send_event(CREATED, {"account": "acme"}, id="s2")
    assert len(_runs("tests.events.one")) == 1
    actions = dict(EventDelivery.objects.values_list("event_id", "action"))
    assert actions == {"s1": EventAction.STARTED, "s2": EventAction.GATED}


# -- waits ------------------------------------------------------------------------------------
def test_a_wait_counts_only_matching_events_recorded_after_it_began(
    engine: Engine, declare: Callable[..., WorkflowDefinition], clock: MovableClock
) -> None:
    declare("tests.events.wait", _wait_paid)
    durable_flow.send_event(PAID, {"order": 1}, id="early")  # before the wait: never counts
    clock.advance(seconds=1)
    run = durable_flow.start("tests.events.wait", {"data": {"order": 1}})
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED

    clock.advance(seconds=1)
    durable_flow.send_event(PAID, {"order": 2}, id="other-order")  # after, but no match
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED
    durable_flow.send_event(PAID, {"order": 1}, id="late")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == {"name": PAID, "data": {"order": 1}, "id": "late", "ts": clock.ms}
    assert list(EventDelivery.objects.filter(action=EventAction.RESUMED).values_list("event_id", flat=True)) == ["late"]


def test_an_event_recorded_once_the_turn_began_is_found_by_the_waits_look_back(
    engine: Engine, declare: Callable[..., WorkflowDefinition], clock: MovableClock
) -> None:
    """As if the event committed between the turn's start (the wait's beginning, on the clock)
    and the wait's checkpoint: its delivery read no wait, the wait's look-back finds it."""
    declare("tests.events.wait", _wait_paid)
    durable_flow.send_event(PAID, {"order": 5}, id="racing")  # no wait exists yet: nothing resumed
    run = durable_flow.start("tests.events.wait", {"data": {"order": 5}})  # the same instant
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output["id"] == "racing"
    assert not EventDelivery.objects.filter(action=EventAction.RESUMED).exists()  # not through a delivery


def test_a_wait_returns_none_at_its_timeout(engine: Engine, declare: Callable[..., WorkflowDefinition]) -> None:
    from durable_flow.runtime.poller import TimerPoller

    declare("tests.events.wait", _wait_paid)
    run = durable_flow.start("tests.events.wait", {"data": {"order": 1}})
    engine.clock.advance(hours=1, seconds=1)  # type: ignore[attr-defined]
    TimerPoller(engine).drain()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output is None


def test_waits_of_many_runs_resume_only_the_matching_one(
    engine: Engine, declare: Callable[..., WorkflowDefinition], clock: MovableClock
) -> None:
    declare("tests.events.wait", _wait_paid)
    runs = [durable_flow.start("tests.events.wait", {"data": {"order": n}}) for n in range(5)]
    clock.advance(seconds=1)
    durable_flow.send_event(PAID, {"order": 3}, id="p3")
    statuses = {run.input["data"]["order"]: WorkflowRun.objects.get(pk=run.pk).status for run in runs}
    assert statuses == {0: "suspended", 1: "suspended", 2: "suspended", 3: "completed", 4: "suspended"}


# -- cancel_on --------------------------------------------------------------------------------
def test_cancel_on_cancels_the_matching_runs_in_progress_only(
    engine: Engine, declare: Callable[..., WorkflowDefinition], clock: MovableClock
) -> None:
    declare(
        "tests.events.cancellable",
        _wait_forever,
        trigger=CREATED,
        cancel_on=[{"event": CANCELLED, "match": "async.data.order == event.data.order"}],
    )
    durable_flow.send_event(CREATED, {"order": 1}, id="c1")
    durable_flow.send_event(CREATED, {"order": 2}, id="c2")
    clock.advance(seconds=1)
    durable_flow.send_event(CANCELLED, {"order": 2}, id="x2")
    statuses = {run.input["data"]["order"]: run.status for run in _runs("tests.events.cancellable")}
    assert statuses == {1: RunStatus.SUSPENDED, 2: RunStatus.CANCELLED}
    cancel = EventDelivery.objects.get(event_id="x2")
    assert (cancel.action, cancel.run_id) == (EventAction.CANCELLED, triggered_run_id("tests.events.cancellable", "c2"))


# -- from a Django signal ---------------------------------------------------------------------
def test_send_event_on_sends_with_the_saving_transaction_and_not_on_a_rollback(
    engine: Engine, declare: Callable[..., WorkflowDefinition]
) -> None:
    from django.contrib.auth import get_user_model
    from django.db import transaction
    from django.db.models.signals import post_save

    user_model = get_user_model()
    declare("tests.events.welcome", trigger=CREATED)
    receiver = durable_flow.send_event_on(
        post_save,
        CREATED,
        sender=user_model,
        data=lambda instance, created, **kw: {"user": instance.username} if created else None,
        id=lambda instance, **kw: f"user-{instance.pk}",
    )
    try:
        with transaction.atomic():
            user = user_model.objects.create_user("ada")
            assert Event.objects.filter(pk=f"user-{user.pk}", pending=True).exists()  # recorded with the save
            assert not _runs("tests.events.welcome")  # delivered once the save commits
        user.save()  # not created: `data` says None, nothing is sent
        with pytest.raises(RuntimeError), transaction.atomic():
            user_model.objects.create_user("rolled-back")
            raise RuntimeError
    finally:
        # By its uid: Django finds a receiver connected with one only so (by the receiver
        # itself, it stayed connected and sent an event for every later test's new user).
        assert post_save.disconnect(sender=user_model, dispatch_uid=receiver.dispatch_uid)
    event = Event.objects.get()  # one: the update and the rolled-back create sent none
    ts = int(event.received_at.timestamp() * 1000)
    expected = {"name": CREATED, "data": {"user": "ada"}, "id": f"user-{user.pk}", "ts": ts}
    assert [run.input for run in _runs("tests.events.welcome")] == [expected]


@pytest.mark.inline_only("checks a name, runs nothing")
def test_send_event_on_refuses_an_undeclared_name_at_once(engine: Engine) -> None:
    from django.db.models.signals import post_save

    with pytest.raises(UnknownEvent):
        durable_flow.send_event_on(post_save, "tests/never.declared", data=lambda **kw: {})


# -- dashboard and admin ----------------------------------------------------------------------
@pytest.mark.inline_only("about the pages; the engine pair does not change them")
def test_the_events_page_and_topic_list_each_event_with_the_runs_it_started_and_resumed(
    engine: Engine, declare: Callable[..., WorkflowDefinition], clock: MovableClock, staff_client: Any
) -> None:
    from django.urls import reverse

    from durable_flow_dashboard.live import canonical_topic, render_topic

    declare("tests.events.a", _wait_forever, trigger=CREATED, quota={"key": '"one"', "limit": 1})
    declare("tests.events.wait", _wait_paid)
    waiting = durable_flow.start("tests.events.wait", {"data": {"order": 9}})
    clock.advance(seconds=1)
    durable_flow.send_event(CREATED, {"order": 9}, id="page-1")
    durable_flow.send_event(CREATED, {"order": 9}, id="page-2")  # its start is refused: the quota is full
    durable_flow.send_event(PAID, {"order": 9}, id="page-3")

    page = staff_client.get(reverse("dashboard:events")).content.decode()  # loads the pages' topics too
    assert canonical_topic("events") == "events"
    fragments = render_topic({}, "events")
    assert fragments is not None
    table = fragments["events-table"]
    run_url = reverse("dashboard:run", args=[triggered_run_id("tests.events.a", "page-1")])
    assert f'started: <a href="{run_url}">tests.events.a</a>' in table
    assert 'data-action="refused">refused by the start quota: tests.events.a</span>' in table
    assert f'resumed a wait: <a href="{reverse("dashboard:run", args=[waiting.pk])}">' in table
    assert table.index("page-3") < table.index("page-2") < table.index("page-1")  # newest first
    assert 'data-live-topic="events"' in page and 'data-live="events-table"' in page and run_url in page

    admin = staff_client.get(reverse("admin:durable_flow_event_change", args=["page-1"])).content.decode()
    assert triggered_run_id("tests.events.a", "page-1") in admin
    assert staff_client.get(reverse("admin:durable_flow_event_changelist")).status_code == 200
    assert staff_client.get(reverse("admin:durable_flow_event_add")).status_code == 403


@pytest.mark.inline_only("about the pages; the engine pair does not change them")
def test_a_run_waiting_for_an_event_says_so_on_its_pages(
    engine: Engine, declare: Callable[..., WorkflowDefinition], staff_client: Any
) -> None:
    from django.urls import reverse

    declare("tests.events.wait", _wait_paid)
    run = durable_flow.start("tests.events.wait", {"data": {"order": 4}})
    page = staff_client.get(reverse("dashboard:run", args=[run.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    assert "event `tests/orders.paid` where `async.data.order == event.data.order`" in text.replace("&#x60;", "`")
    assert "waits for event `tests/orders.paid`" in text.replace("&#x60;", "`")
    listed = staff_client.get(reverse("dashboard:runs"), {"waiting": "event"}).content.decode()
    assert run.pk in listed
    assert staff_client.get(reverse("admin:durable_flow_workflowrun_change", args=[run.pk])).status_code == 200
