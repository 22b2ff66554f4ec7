"""`durable_flow.current_step()`: a step knows its run, call, attempt and idempotency key, in
sync and async steps, in this process (inline transport) and in a real worker process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from durable_flow import NotInStep, current_step
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint, WorkflowRun
from durable_flow.operations import api
from durable_flow.transports.db.transport import DatabaseTransport
from tests import workflows
from tests.conftest import ManagedProcess, wait_for


def expected(run_id: str, name: str, attempt: int) -> dict[str, Any]:
    key = StepCheckpoint.objects.get(run_id=run_id, name=name).key
    return {"run_id": run_id, "key": key, "attempt": attempt, "idempotency_key": f"{run_id}/{key}"}


def test_outside_a_step_current_step_raises_a_typed_error() -> None:
    with pytest.raises(NotInStep):
        current_step()


def test_sync_and_async_steps_see_their_run_key_and_attempt_inline(engine: Engine) -> None:
    run = api.start("tests.whereami", "never", run_id="where-1")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == [expected("where-1", "tests.whereami", 1), expected("where-1", "tests.whereami_async", 1)]
    with pytest.raises(NotInStep):  # reset once the step returned
        current_step()


def test_a_retried_attempt_sees_its_attempt_number_and_the_same_idempotency_key(engine: Engine) -> None:
    workflows.FAILURES_LEFT["where-2"] = 1
    run = api.start("tests.whereami", "where-2", run_id="where-2")
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and "attempt 1" in str(run.error)
    api.retry("where-2")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    first = run.output[0]
    assert first == expected("where-2", "tests.whereami", 2)
    assert first["idempotency_key"] == f"where-2/{first['key']}"


def test_a_real_worker_process_gives_steps_their_current_step(
    transactional_db: None, spawn: Callable[..., ManagedProcess]
) -> None:
    set_engine(Engine(admission=LocalAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings()))
    api.start("tests.whereami", "never", run_id="where-3")
    worker = spawn("durable_worker", "--concurrency", "2", env={"DURABLE_FLOW_TRANSPORT": "db"})
    wait_for(
        lambda: WorkflowRun.objects.get(pk="where-3").status == RunStatus.COMPLETED,
        timeout=60,
        what=f"the run to complete on the worker; log:\n{worker.log_path}",
    )
    output = WorkflowRun.objects.get(pk="where-3").output
    assert output == [expected("where-3", "tests.whereami", 1), expected("where-3", "tests.whereami_async", 1)]
    assert StepCheckpoint.objects.get(run_id="where-3", name="tests.whereami").worker not in ("", "inline")
