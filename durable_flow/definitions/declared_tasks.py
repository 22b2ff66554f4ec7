"""The tasks a task run may call: `@task`s declared in code, found by module path, never
imported by it.

A task run's input names its task (`"task": "billing.tasks.send_invoice"`). That input is
stored data, chosen by whoever started the run or wrote the row; importing it would run any
module's top-level code and call any function (`os.system`). So the path is only a key into
the `Task` objects the code declared:

- every `Task` a `DurableFlowBackend` validates is declared in that process (`@task` validates
  when its module is imported, `enqueue` again);
- the first time a path is missing, the modules the settings name are imported and scanned, once
  a process, with `vars()` (no attribute hooks run): each installed app's `tasks` module (Django's
  `autodiscover_modules("tasks")` idiom) and each module of `DURABLE_FLOW["WORKFLOWS"]`. A worker
  that never imported a task's module finds it there; a path no such module declares fails with
  `TaskNotDeclared`, and nothing is imported for it.
"""

from __future__ import annotations

import threading
from importlib import import_module
from typing import TYPE_CHECKING

from django.apps import apps
from django.utils.module_loading import module_has_submodule

from durable_flow.config.settings import get_settings
from durable_flow.exceptions import TaskNotDeclared

if TYPE_CHECKING:
    from django_tasks.base import Task

_declared: dict[str, Task] = {}
_scanned = False
_scan_lock = threading.Lock()


def declare(task: Task) -> None:
    """Let task runs call `task`, a `Task` a `DurableFlowBackend` validated, by its module path."""
    _declared.setdefault(task.module_path, task)


def declared_task(path: object) -> Task:
    """The declared `Task` whose module path is `path`; `TaskNotDeclared` if there is none."""
    if isinstance(path, str):
        task = _declared.get(path)
        if task is None and not _scanned:
            _scan()
            task = _declared.get(path)
        if task is not None:
            return task
    raise TaskNotDeclared(path)


def _scan() -> None:
    """Import the modules the settings name and declare the tasks they hold (once a process;
    an import error propagates, as Django's autodiscovery's does, and the next miss retries)."""
    global _scanned
    with _scan_lock:
        if _scanned:
            return
        task_class = _task_class()
        if task_class is None:  # neither `django.tasks` nor the backport: no task can be declared
            _scanned = True
            return
        for name in _declaring_modules():
            for value in list(vars(import_module(name)).values()):
                if isinstance(value, task_class) and _runs_declared_tasks(value.get_backend()):
                    declare(value)
        _scanned = True


def _task_class() -> type[Task] | None:
    """The tasks framework's `Task` (Django 6's own, else the `django-tasks` backport's), or None."""
    try:
        from django.tasks.base import Task  # type: ignore[import-not-found]
    except ImportError:
        try:
            from django_tasks.base import Task
        except ImportError:
            return None
    task_class: type[Task] = Task
    return task_class


def _runs_declared_tasks(backend: object) -> bool:
    """Whether `backend` runs task calls as durable runs (a `DurableFlowBackend`), told by the
    method the built-in workflow calls (`call_declared_task`), so this module does not import
    the backend, which imports the framework and this module."""
    return callable(getattr(backend, "call_declared_task", None))


def _declaring_modules() -> list[str]:
    """`DURABLE_FLOW["WORKFLOWS"]`, then the `tasks` module of each installed app that has one."""
    names = list(get_settings().workflows)
    for config in apps.get_app_configs():
        if module_has_submodule(config.module, "tasks"):
            names.append(f"{config.name}.tasks")
    return names
