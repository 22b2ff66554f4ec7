"""A task run calls only a declared `@task`: no path from a run's input, a request or a stored
row is ever imported, and the tasks backend's built-in workflow cannot be started by name.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

from durable_flow import start
from durable_flow.contrib.task_runner import TASK_WORKFLOW, run_task
from durable_flow.engine import Engine, get_engine
from durable_flow.exceptions import WorkflowNotFound
from durable_flow.models import RunStatus, StepCheckpoint, WorkflowRun
from durable_flow.operations import api
from tests import task_functions
from tests.conftest import ROOT, ManagedProcess, wait_for
from tests.support.tasks import task_payload
from tests.tasks_framework import InvalidTaskError, TaskResultStatus

MODULE_NEVER_IMPORTED = "tests.not_a_task"


def step_error(run_id: str) -> dict[str, Any]:
    return StepCheckpoint.objects.get(run_id=run_id, kind="step").error


@pytest.fixture
def starter(transactional_db: None) -> Client:
    """A staff user holding only the permission to start runs."""
    user = get_user_model().objects.create_user("starter", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="durable_flow", codename="start_workflowrun")
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture(autouse=True)
def _forget_calls() -> None:
    task_functions.CALLS.clear()


@pytest.fixture
def rescan(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that has not scanned for declared tasks yet (the scan runs once a process)."""
    from durable_flow.definitions import declared_tasks

    monkeypatch.setattr(declared_tasks, "_declared", dict(declared_tasks._declared))
    monkeypatch.setattr(declared_tasks, "_scanned", False)
    yield


# -- the exploit, on a real worker ---------------------------------------------------------------


def test_starting_the_built_in_workflow_through_the_json_api_runs_nothing_on_a_worker(
    db_admission_engine: Engine, starter: Client, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    exploit = task_payload("os.system", f"touch {marker}")
    response = starter.post(
        "/api/runs/", data=json.dumps({"workflow": TASK_WORKFLOW, "input": exploit}), content_type="application/json"
    )
    legit = task_functions.add.enqueue(2, 3)
    spawn("durable_worker", "--concurrency", "1", env={"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"})
    wait_for(
        lambda: not WorkflowRun.objects.exclude(status__in=[RunStatus.COMPLETED, RunStatus.FAILED]).exists(),
        timeout=60,
        what="the worker to finish every run",
    )
    assert not marker.exists(), "the worker ran os.system from a run's input"
    assert (response.status_code, response.json()["error"]) == (404, "WorkflowNotFound")
    assert list(WorkflowRun.objects.values_list("pk", flat=True)) == [legit.id]
    assert task_functions.add.get_result(legit.id).return_value == 5  # a declared task still runs


def test_a_stored_run_naming_a_non_task_fails_on_a_worker_without_importing_it(
    db_admission_engine: Engine, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    imported, called = tmp_path / "imported", tmp_path / "called"
    # What a row written straight into the database looks like: the internal start path.
    forged = get_engine().start(TASK_WORKFLOW, task_payload(f"{MODULE_NEVER_IMPORTED}.touch", str(called)))
    spawn(
        "durable_worker",
        "--concurrency",
        "1",
        env={
            "DURABLE_FLOW_ADMISSION": "db",
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_TEST_IMPORT_MARKER": str(imported),
        },
    )
    wait_for(lambda: WorkflowRun.objects.get(pk=forged.pk).is_terminal, timeout=60, what="the forged run to end")
    assert not imported.exists() and not called.exists()
    assert WorkflowRun.objects.get(pk=forged.pk).status == RunStatus.FAILED
    error = step_error(forged.pk)
    assert error["type"] == "durable_flow.exceptions.TaskNotDeclared"
    assert f"{MODULE_NEVER_IMPORTED}.touch" in error["message"]
    later = task_functions.add.enqueue(1, 1)  # the worker keeps serving
    wait_for(lambda: task_functions.add.get_result(later.id).is_finished, timeout=60, what="a task after it")
    assert task_functions.add.get_result(later.id).return_value == 2


# -- stored input never becomes an import ----------------------------------------------------------


def test_a_stored_path_to_a_module_is_not_imported(engine: Engine, tmp_path: Path) -> None:
    assert MODULE_NEVER_IMPORTED not in sys.modules
    run = engine.start(TASK_WORKFLOW, task_payload(f"{MODULE_NEVER_IMPORTED}.touch", str(tmp_path / "called")))
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.FAILED
    assert MODULE_NEVER_IMPORTED not in sys.modules
    assert not (tmp_path / "called").exists()


def test_a_stored_path_to_a_function_that_is_no_task_is_not_called(engine: Engine, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    run = engine.start(TASK_WORKFLOW, task_payload("os.system", f"touch {marker}"))
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.FAILED
    assert step_error(run.pk)["type"] == "durable_flow.exceptions.TaskNotDeclared"
    assert not marker.exists()


@pytest.mark.parametrize("path", [["os.system"], None, "", "tests.task_functions.os.system", "tests.task_functions"])
def test_a_stored_task_that_is_not_a_declared_path_fails_the_run(engine: Engine, path: object) -> None:
    run = engine.start(TASK_WORKFLOW, task_payload(path))  # type: ignore[arg-type]
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.FAILED
    assert step_error(run.pk)["type"] == "durable_flow.exceptions.TaskNotDeclared"


def test_get_result_of_a_stored_run_naming_a_non_task_does_not_exist(engine: Engine, tmp_path: Path) -> None:
    from tests.tasks_framework import TaskResultDoesNotExist, default_task_backend

    run = engine.start(TASK_WORKFLOW, task_payload(f"{MODULE_NEVER_IMPORTED}.touch", str(tmp_path / "called")))
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(run.pk)
    assert MODULE_NEVER_IMPORTED not in sys.modules


def test_a_stored_exception_class_path_is_not_imported_by_get_result(engine: Engine) -> None:
    """The framework's `TaskError.exception_class` imports the path it holds: a failed run's
    stored error type is resolved among the modules already imported, never imported."""
    from tests.tasks_framework import default_task_backend

    failed = task_functions.explode.enqueue("boom")
    StepCheckpoint.objects.filter(run_id=failed.id, kind="step").update(
        error={"type": f"{MODULE_NEVER_IMPORTED}.Boom", "message": "boom", "traceback": ""}
    )
    error = default_task_backend.get_result(failed.id).errors[0]
    try:
        assert error.exception_class_path == f"{MODULE_NEVER_IMPORTED}.Boom"  # shown as stored
        with pytest.raises(ValueError, match="never imported"):
            _ = error.exception_class
        assert MODULE_NEVER_IMPORTED not in sys.modules
    finally:
        sys.modules.pop(MODULE_NEVER_IMPORTED, None)


def test_a_task_in_an_installed_apps_tasks_module_is_found_by_the_scan(
    engine: Engine, settings: Any, rescan: None
) -> None:
    assert "tests.taskapp.tasks" not in sys.modules
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, "tests.taskapp"]
    try:
        run = engine.start(TASK_WORKFLOW, task_payload("tests.taskapp.tasks.ping", 7))
        assert (WorkflowRun.objects.get(pk=run.pk).status, WorkflowRun.objects.get(pk=run.pk).output) == (
            RunStatus.COMPLETED,
            "pong 7",
        )
    finally:
        sys.modules.pop("tests.taskapp.tasks", None)  # unscanned again for the next engine pair


def test_a_task_of_another_backend_is_not_declared(engine: Engine, rescan: None) -> None:
    run = engine.start(TASK_WORKFLOW, task_payload("tests.task_functions.on_immediate", 1))
    assert step_error(run.pk)["type"] == "durable_flow.exceptions.TaskNotDeclared"


# -- the built-in workflow is not started by name ----------------------------------------------------


@pytest.mark.parametrize("target", [TASK_WORKFLOW, run_task])
def test_the_public_start_refuses_the_built_in_workflow(engine: Engine, target: Any) -> None:
    with pytest.raises(WorkflowNotFound, match=r"durable_flow\.task"):
        start(target, task_payload("tests.task_functions.add", 1, 2))
    assert not WorkflowRun.objects.exists()


def test_the_admin_start_form_neither_lists_nor_starts_the_built_in_workflow(
    engine: Engine, admin_client: Client
) -> None:
    page = admin_client.get("/admin/durable_flow/workflowrun/start/").content.decode()
    assert "tests.three_steps" in page and TASK_WORKFLOW not in page
    admin_client.post(
        "/admin/durable_flow/workflowrun/start/",
        {"workflow": TASK_WORKFLOW, "input": json.dumps(task_payload("tests.task_functions.add", 1, 2))},
    )
    assert not WorkflowRun.objects.exists()


def test_the_dashboard_start_form_neither_lists_nor_starts_the_built_in_workflow(
    engine: Engine, admin_client: Client
) -> None:
    page = admin_client.get("/dashboard/runs/start/").content.decode()
    assert "tests.three_steps" in page and TASK_WORKFLOW not in page
    response = admin_client.post(
        "/dashboard/runs/start/",
        {"workflow": TASK_WORKFLOW, "input": json.dumps(task_payload("tests.task_functions.add", 1, 2))},
    )
    assert response.status_code == 400
    assert not WorkflowRun.objects.exists()


def test_a_task_run_can_be_rerun(engine: Engine) -> None:
    original = task_functions.add.enqueue(2, 3)
    again = api.rerun(original.id)
    assert (again.workflow, WorkflowRun.objects.get(pk=again.pk).output) == (TASK_WORKFLOW, 5)
    assert task_functions.add.get_result(again.pk).return_value == 5


def test_a_failed_task_run_can_be_retried(engine: Engine) -> None:
    failed = task_functions.flaky.enqueue("k")
    assert task_functions.flaky.get_result(failed.id).status == TaskResultStatus.FAILED
    api.retry(failed.id)
    assert task_functions.flaky.get_result(failed.id).return_value == "k"
    assert task_functions.CALLS == [("flaky", "k"), ("flaky", "k")]


def test_a_signal_to_a_task_run_is_kept_and_changes_nothing(manual: Engine) -> None:
    """A task run waits for no signal: one sent to it is stored like any early signal and never
    read, so it cannot change what the run calls."""
    from tests.engine_support import transport_of

    result = task_functions.add.enqueue(2, 3)
    api.send_signal(result.id, "task", {"task": "os.system", "args": ["id"]})
    transport_of(manual).run_all()
    assert task_functions.add.get_result(result.id).return_value == 5


# -- queue names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("queue_name", ["q" * 1000, "a\x00b", ""])
def test_a_queue_name_the_database_cannot_store_is_refused_at_enqueue(engine: Engine, queue_name: str) -> None:
    with pytest.raises(InvalidTaskError, match="queue_name"):
        task_functions.on_any_queue.using(queue_name=queue_name).enqueue(1)
    assert not WorkflowRun.objects.exists()


def test_a_long_valid_queue_name_is_accepted(engine: Engine) -> None:
    result = task_functions.on_any_queue.using(queue_name="q" * 100).enqueue(1)
    assert task_functions.on_any_queue.get_result(result.id).status == TaskResultStatus.SUCCESSFUL


# -- the source --------------------------------------------------------------------------------------

#: Every call that imports by a dotted path, each fed by settings only (operator configuration,
#: Django's convention). A new one fails this test: it must not take a path from data.
SETTINGS_FED_IMPORTS = {
    ("durable_flow/apps.py", "importlib.import_module(module)"),  # DURABLE_FLOW["WORKFLOWS"]
    ("durable_flow/config/settings.py", "import_string(spec.path)"),  # a backend's class path
    ("durable_flow/checks.py", "import_string(spec.path)"),  # the same, in the system checks
    ("durable_flow/definitions/declared_tasks.py", "import_module(name)"),  # WORKFLOWS and installed apps' tasks
    ("dashboard/consumers.py", "import_module(settings.SESSION_ENGINE)"),
    ("dashboard/checks.py", "import_string(path)"),  # settings.ASGI_APPLICATION, as daphne does
}


def test_no_import_takes_a_path_from_data() -> None:
    pattern = re.compile(r"[\w.]*(?:import_string|import_module|__import__)\([^)]*\)")
    found = {
        (str(path.relative_to(ROOT)), call)
        for package in ("durable_flow", "dashboard")
        for path in sorted((ROOT / package).rglob("*.py"))
        for call in pattern.findall(path.read_text())
    }
    assert found == SETTINGS_FED_IMPORTS
