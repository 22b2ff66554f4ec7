"""The engine's parts stand alone: each is built from what it calls, with no engine behind it,
and can be driven on its own (`durable_flow/engine/__init__.py` lists them)."""

from __future__ import annotations

import pytest

from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.definitions.registry import get_step
from durable_flow.engine import Engine
from durable_flow.engine.dispatch import Dispatcher
from durable_flow.engine.turn import StepOptions
from durable_flow.engine.wake import Waker
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.transports.inline import InlineTransport
from tests.conftest import MovableClock

PARTS = (
    "dispatcher",
    "grants",
    "releases",
    "admitter",
    "start_window",
    "waker",
    "lifecycle",
    "turns",
    "results",
    "first_turns",
)


class RecordingQueue:
    """A transport's queueing side (`engine.base.TaskQueue`) that only records what it is sent."""

    def __init__(self) -> None:
        self.turns: list[str] = []
        self.steps: list[tuple[str, str, int, int]] = []
        self.queues: list[str] = []

    def enqueue_turn(self, run_id: str) -> None:
        self.turns.append(run_id)

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        self.turns.append(run_id)

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        self.steps.append((run_id, step_key, attempt, priority))

    def enqueue_step_of_queue(self, queue: str, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        self.queues.append(queue)
        self.enqueue_step(run_id, step_key, attempt, priority)


def test_no_part_holds_the_engine() -> None:
    engine = Engine(admission=LocalAdmissionBackend(), transport=InlineTransport(), settings=get_settings())
    for name in PARTS:
        part = getattr(engine, name)
        assert not any(isinstance(value, Engine) for value in vars(part).values()), name


def test_setting_another_backend_rebuilds_the_parts_around_it() -> None:
    engine = Engine(admission=LocalAdmissionBackend(), transport=InlineTransport(), settings=get_settings())
    other = LocalAdmissionBackend()
    engine.admission = other
    for name in PARTS:
        held = vars(getattr(engine, name)).get("admission")
        assert held is None or held is other, name


@pytest.mark.django_db
def test_a_waker_queues_a_turn_for_a_parked_run_only(clock: MovableClock) -> None:
    queue = RecordingQueue()
    waker = Waker(queue, clock)
    parked = WorkflowRun.objects.create(workflow="tests.three_steps", status=RunStatus.SUSPENDED)
    done = WorkflowRun.objects.create(workflow="tests.three_steps", status=RunStatus.COMPLETED)
    assert waker.wake(parked.id)
    assert not waker.wake(done.id)
    assert queue.turns == [parked.id]
    assert WorkflowRun.objects.get(pk=parked.id).status == RunStatus.PENDING


@pytest.mark.django_db
def test_a_dispatcher_writes_the_attempt_and_sends_it_to_its_queue(clock: MovableClock) -> None:
    queue = RecordingQueue()
    dispatcher = Dispatcher(get_settings(), LocalAdmissionBackend(), queue, clock)
    run = WorkflowRun.objects.create(workflow="tests.three_steps", status=RunStatus.RUNNING)
    cp = dispatcher.create_step_checkpoint(
        run, key="1", sequence=1, step=get_step("tests.echo"), input=7, options=StepOptions(priority=3), group=""
    )
    dispatcher.dispatch(cp)
    assert queue.steps == [(run.id, "1", 1, 3)]
    stored = StepCheckpoint.objects.get(run=run, key="1")
    assert (stored.status, stored.attempt, stored.dispatched_at) == (StepStatus.DISPATCHED, 1, clock())
