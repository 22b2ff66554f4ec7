"""The fixtures several test modules share, loaded by tests/conftest.py (`pytest_plugins`).

A module that needs a variant overrides the small fixture the shared one reads (`staff_login`,
`own_redis_keeps_data`) instead of defining the shared fixture again."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from django.test import Client

from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.definitions import registry
from durable_flow.definitions.registry import WorkflowDefinition, workflow
from durable_flow.engine import Engine, set_engine
from durable_flow.transports.db.transport import DatabaseTransport
from tests.support.clients import StaffLogin, create_user, logged_in
from tests.support.own_redis import OwnRedis, free_port


# -- the dashboard's staff ---------------------------------------------------------------------
@pytest.fixture
def staff_login() -> StaffLogin:
    """A superuser posting with CSRF checks; override it in a module for another kind of staff."""
    return StaffLogin()


@pytest.fixture
def staff(staff_login: StaffLogin, transactional_db: None) -> Any:
    return create_user(staff_login.username, superuser=staff_login.superuser)


@pytest.fixture
def staff_client(staff: Any, staff_login: StaffLogin) -> Client:
    return logged_in(staff, csrf=staff_login.csrf)


# -- a Redis server of the test's own ----------------------------------------------------------
@pytest.fixture
def own_redis_keeps_data() -> bool:
    """Whether the test's Redis writes an append-only file, so a kill loses no acknowledged write;
    override it to False in a module whose restarts must come back empty."""
    return True


@pytest.fixture
def own_redis(tmp_path: Path, own_redis_keeps_data: bool) -> Iterator[OwnRedis]:
    data_dir = None
    if own_redis_keeps_data:
        data_dir = tmp_path / "redis"
        data_dir.mkdir()
    server = OwnRedis(free_port(), data_dir=data_dir)
    server.start()
    yield server
    server.kill()


# -- engines that hand their tasks to worker processes -----------------------------------------
@pytest.fixture
def db_transport_engine(transactional_db: None) -> Engine:
    """This process starts runs on the `db` transport with in-process admission: the turns go to
    the task table, where worker processes (if the test starts any) take them."""
    engine = Engine(admission=LocalAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    return engine


@pytest.fixture
def db_admission_engine(transactional_db: None) -> Engine:
    """This process on the `db` transport and the `db` admission backend, as the worker processes
    it starts are: the admission counts live in the database all of them share."""
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings())
    set_engine(engine)
    return engine


# -- workflows of one test -----------------------------------------------------------------------
def _input_back(ctx: Any, input: Any) -> Any:
    return input


@pytest.fixture
def declare() -> Iterator[Callable[..., WorkflowDefinition]]:
    """Register a workflow for one test only: no other test's poller starts it (a scheduled
    one: `declare("nightly", schedule="0 3 * * *")`), no other test's events start it, and no
    other test's `manage.py check` (whose settings may declare no events) sees its trigger."""
    names: list[str] = []

    def make(name: str, fn: Callable[[Any, Any], Any] = _input_back, **options: Any) -> WorkflowDefinition:
        names.append(name)
        return workflow(name, **options)(fn)

    yield make
    for name in names:
        registry._workflows.pop(name, None)


@contextmanager
def registered(module: str) -> Iterator[ModuleType]:
    """A test's own workflow module (a fixed name in the test, e.g. `"tests.event_workflows"`),
    imported, or re-run if it was imported before, and its workflows and steps unregistered after:
    a module imported at the top of a test module registers at collection, for the whole session,
    and its triggers would then meet another test's `manage.py check` under settings that declare
    no events."""
    workflows, steps = set(registry._workflows), set(registry._steps)
    loaded = importlib.reload(sys.modules[module]) if module in sys.modules else importlib.import_module(module)
    try:
        yield loaded
    finally:
        for name in set(registry._workflows) - workflows:
            registry._workflows.pop(name, None)
        for name in set(registry._steps) - steps:
            registry._steps.pop(name, None)
