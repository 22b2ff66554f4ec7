"""Fan-out and child runs: `ctx.all` waves never exceed `concurrency` in flight; a child fan keeps
two waves of `concurrency // 2` in flight; a parent waits holding nothing; a child's failure
surfaces as `ChildFailed`."""

from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import (
    TERMINAL_RUN_STATUSES,
    RunStatus,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkflowRun,
)
from durable_flow.runtime.poller import TimerPoller
from tests.conftest import MovableClock, executed
from tests.engine_support import StepJob, transport_of


def unfinished_children(parent_id: str) -> list[str]:
    return sorted(
        WorkflowRun.objects.filter(parent_id=parent_id)
        .exclude(status__in=TERMINAL_RUN_STATUSES)
        .values_list("id", flat=True)
    )


@pytest.mark.parametrize(("n", "concurrency"), [(10, 3), (7, 7), (5, 1)])
def test_step_fan_never_has_more_than_concurrency_steps_in_flight(manual: Engine, n: int, concurrency: int) -> None:
    """Sampled at every step execution: the dispatched steps all belong to one wave, and there
    are at most `concurrency` of them (and exactly that many while a full wave is out)."""
    transport = transport_of(manual)
    run = start("tests.fan", {"n": n, "concurrency": concurrency})
    seen: list[int] = []

    def probe(job: StepJob) -> None:
        in_flight = StepCheckpoint.objects.filter(run=run, kind=StepKind.STEP, status=StepStatus.DISPATCHED)
        assert in_flight.values("group").distinct().count() == 1
        seen.append(in_flight.count())

    transport.run_all(on_step=probe)
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == [i * 2 for i in range(n)]
    assert sorted(executed("double")) == list(range(n))  # each input exactly once
    assert max(seen) == concurrency
    assert run.turns == -(-n // concurrency) + 1  # one turn per settled wave, plus the first


def test_step_fan_sends_the_next_wave_only_when_the_whole_wave_settled(manual: Engine) -> None:
    transport = transport_of(manual)
    run = start("tests.fan", {"n": 4, "concurrency": 2})
    transport.run_turns()
    assert sorted(job.key for job in transport.steps) == ["1.0", "1.1"]
    transport.execute(transport.take("1.0"))
    transport.run_turns()
    assert [job.key for job in transport.steps] == ["1.1"]  # one settled: nothing new yet
    transport.execute(transport.take("1.1"))
    transport.run_turns()
    assert sorted(job.key for job in transport.steps) == ["1.2", "1.3"]
    transport.run_all()
    run.refresh_from_db()
    assert run.output == [0, 2, 4, 6]


@pytest.mark.parametrize(("concurrency", "most"), [(4, 4), (5, 4), (3, 2), (1, 1)])
def test_child_fan_keeps_at_most_concurrency_children_in_flight(manual: Engine, concurrency: int, most: int) -> None:
    """Two waves of `concurrency // 2` children; with concurrency=1 one child at a time (two
    waves of one would be two in flight, over the limit)."""
    transport = transport_of(manual)
    run = start("tests.child_fan", {"n": 9, "concurrency": concurrency})
    seen: list[int] = []
    transport.run_all(on_step=lambda job: seen.append(len(unfinished_children(run.id))))
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == [(i + 1) * 2 + 1 for i in range(9)]
    assert max(seen) == most
    assert WorkflowRun.objects.filter(parent_id=run.id).count() == 9


def test_child_fan_starts_the_next_wave_as_soon_as_one_wave_settles(manual: Engine) -> None:
    """concurrency=4: waves of 2, two in flight. Finishing wave 0 alone starts wave 2 while
    wave 1 is still running."""
    transport = transport_of(manual)
    run = start("tests.child_fan", {"n": 8, "concurrency": 4})
    transport.run_turns()
    child = [f"{run.id}:1.{i}" for i in range(8)]
    assert unfinished_children(run.id) == sorted(child[:4])
    while WorkflowRun.objects.filter(id__in=child[:2]).exclude(status=RunStatus.COMPLETED).exists():
        job = next(job for job in transport.steps if job.run_id in child[:2])
        transport.steps.remove(job)
        transport.execute(job)
        transport.run_turns()
    assert unfinished_children(run.id) == sorted(child[2:6])
    assert not WorkflowRun.objects.filter(id__in=child[6:]).exists()
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED


def test_a_parent_waits_for_its_child_suspended_and_holding_nothing(manual: Engine) -> None:
    transport = transport_of(manual)
    parent = start("tests.child_parent", 5)
    transport.run_turns()
    parent.refresh_from_db()
    assert parent.status == RunStatus.SUSPENDED and parent.wake_at is None
    child_cp = StepCheckpoint.objects.get(run=parent)
    assert child_cp.kind == StepKind.CHILD and child_cp.status == StepStatus.DISPATCHED
    assert not child_cp.holds_slot
    assert {job.run_id for job in transport.steps} == {child_cp.child_run_id}  # only the child works
    transport.run_all()
    parent.refresh_from_db()
    assert parent.status == RunStatus.COMPLETED and parent.output == 13 + 1000
    assert WorkflowRun.objects.get(pk=child_cp.child_run_id).output == 13


def test_a_failed_child_raises_child_failed_in_the_parent(manual: Engine, clock: MovableClock) -> None:
    transport = transport_of(manual)
    parent = start("tests.child_of_failing", None)
    transport.run_all()
    clock.advance(seconds=1)  # the child's step backoff
    assert TimerPoller(manual).tick() == [f"{parent.id}:1"]
    transport.run_all()
    parent.refresh_from_db()
    assert parent.status == RunStatus.COMPLETED
    assert parent.output == {"child": f"{parent.id}:1", "status": RunStatus.FAILED}
    assert WorkflowRun.objects.get(pk=f"{parent.id}:1").status == RunStatus.FAILED


def test_two_children_of_one_wave_finishing_at_once_wake_the_parent(manual: Engine) -> None:
    """Child A's last step result (and with it A's final turn) has settled its parent checkpoint
    but not committed when child B's last result lands. B must not conclude from a stale read
    that A is still running, or neither child wakes the parent and it waits forever."""
    transport = transport_of(manual)
    parent = start("tests.child_fan", {"n": 2})
    children = [f"{parent.id}:1.0", f"{parent.id}:1.1"]
    held: dict[str, StepJob] = {}
    while transport.turns or transport.steps:  # run both children up to (not through) their last step
        transport.run_turns()
        if transport.steps:
            job = transport.steps.pop(0)
            if job.key == "3":
                held[job.run_id] = job
            else:
                transport.execute(job)
    assert sorted(held) == children
    a_settled, a_release, b_done = threading.Event(), threading.Event(), threading.Event()

    def finish(run_id: str, hold: bool) -> None:
        try:
            with transaction.atomic():
                transport.execute(held[run_id])
                if hold:
                    a_settled.set()
                    a_release.wait(10)
            if not hold:
                b_done.set()
        finally:
            connections.close_all()

    child_a = threading.Thread(target=finish, args=(children[0], True))
    child_b = threading.Thread(target=finish, args=(children[1], False))
    child_a.start()
    try:
        assert a_settled.wait(10)
        child_b.start()
        b_done.wait(0.5)  # B finishes now, or waits for A's locks (SQLite: for A's write lock)
    finally:
        a_release.set()
        child_a.join(15)
        child_b.join(15)
    assert all(WorkflowRun.objects.get(pk=child).status == RunStatus.COMPLETED for child in children)
    assert transport.turns == [parent.id], "no child woke the parent"
    transport.run_all()
    parent.refresh_from_db()
    assert parent.status == RunStatus.COMPLETED and parent.output == [3, 5]
