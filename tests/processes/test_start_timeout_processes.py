"""Start timeouts with real worker and poller processes, on `db` and `redis` admission (SQLite,
or PostgreSQL with DATABASE_URL): under a full queue and under a full step-concurrency key, a
call whose start timeout runs out gives up, fails its run with `StartTimeoutError`, and frees its
place, so the call queued behind it is the one the slot goes to.

The step holding the slot (`tests.file_gate`) runs until the test opens its gate, which it does
only once it has seen the impatient call give up: no verdict rests on a step's duration, only on
the poller waking a parked run at its deadline.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from durable_flow import register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.support.workers import unique

#: The impatient call's start timeout (s): the slot's holder runs until the test has seen it give up.
START_TIMEOUT_S = 2


def status_of(run_id: str) -> str:
    return WorkflowRun.objects.values_list("status", flat=True).get(pk=run_id)


def executions(marker: Path) -> list[tuple[str, str]]:
    if not marker.exists():
        return []
    return [(line.split()[0], line.split()[1]) for line in marker.read_text().splitlines()]


def give_up_behind_a_held_slot(
    workflow: str,
    spawn: Callable[..., ManagedProcess],
    env: dict[str, str],
    tmp_path: Path,
    shared: dict[str, object],
) -> tuple[str, str, str]:
    """Holder (gated), then impatient (start timeout), then patient (none), all through `shared`
    (a queue or an account); workers and a poller. Returns the three run ids once the impatient
    one gave up and the gate is open."""
    gate_file = tmp_path / "open"
    holder = start(workflow, {**shared, "value": "holder", "open": str(gate_file)}).id
    for _ in range(2):
        spawn("durable_worker", "--concurrency", "4", env=env)
    spawn("durable_poller", env=env)
    wait_for(lambda: ("file_gate", "holder") in executions(tmp_path / "marker"), timeout=60, what="the holder to start")
    impatient = start(workflow, {**shared, "value": "impatient", "start_timeout": START_TIMEOUT_S}).id
    patient = start(workflow, {**shared, "value": "patient"}).id
    wait_for(lambda: status_of(impatient) == RunStatus.FAILED, timeout=90, what="the impatient call to give up")
    assert status_of(holder) == RunStatus.RUNNING  # it gave up while the slot was still held
    gate_file.touch()
    wait_for(
        lambda: status_of(holder) == status_of(patient) == RunStatus.COMPLETED,
        timeout=90,
        what="the holder, then the call behind the one that gave up, to complete",
    )
    return holder, impatient, patient


def assert_gave_up(impatient: str, marker: Path, held_by: str) -> None:
    run = WorkflowRun.objects.get(pk=impatient)
    assert run.error["type"] == "durable_flow.exceptions.StartTimeoutError"
    assert f"(start timeout {START_TIMEOUT_S} s): {held_by}" in run.error["message"]
    cp = StepCheckpoint.objects.get(run_id=impatient)
    assert (cp.status, cp.attempt, cp.holds_slot) == (StepStatus.FAILED, 0, False)
    assert ("echo", "impatient") not in executions(marker)  # never ran
    assert ("echo", "patient") in executions(marker)


def test_a_call_gives_up_under_a_full_queue_and_the_next_waiter_takes_the_slot(
    matching_admission_engine: Engine, process_env: dict[str, str], spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    queue = unique("deadline")
    register_queue(queue, concurrency=1)
    env = {**process_env, "DURABLE_FLOW_TEST_MARKER": str(tmp_path / "marker")}
    _, impatient, _ = give_up_behind_a_held_slot("tests.queued_deadline", spawn, env, tmp_path, {"queue": queue})
    assert_gave_up(impatient, tmp_path / "marker", "its cap of 1 was full")
    admission = matching_admission_engine.admission
    assert admission.in_flight(queue) == 0 and admission.waiting(queue) == 0  # no slot kept, no waiter left


def test_a_call_gives_up_under_a_full_step_concurrency_key_and_frees_its_place(
    matching_admission_engine: Engine, process_env: dict[str, str], spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    account = f"acct-{uuid.uuid4().hex[:8]}"
    env = {**process_env, "DURABLE_FLOW_TEST_MARKER": str(tmp_path / "marker")}
    _, impatient, _ = give_up_behind_a_held_slot("tests.keyed_deadline", spawn, env, tmp_path, {"account": account})
    assert_gave_up(impatient, tmp_path / "marker", f"step-concurrency key {account!r} (limit 1) was full")
    usage = matching_admission_engine.admission.constraint_usage(f"sc:fn:tests.keyed_deadline:{account}")
    assert not usage or all(row.active == 0 and row.waiting == 0 for row in usage)
