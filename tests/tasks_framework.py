"""Django's tasks framework as the backend sees it: `django.tasks` on Django 6, the `django-tasks`
backport on Django 5.2 (the same shim as `durable_flow.tasks`), so the tests run on both."""

from __future__ import annotations

try:  # Django 6
    from django.tasks import (  # type: ignore[import-not-found]
        TaskContext,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django.tasks.exceptions import InvalidTask as InvalidTaskError  # type: ignore[import-not-found]
    from django.tasks.exceptions import TaskResultDoesNotExist  # type: ignore[import-not-found]
except ImportError:  # Django 5.2
    from django_tasks import TaskContext, TaskResultStatus, default_task_backend, task, task_backends
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist

__all__ = [
    "InvalidTaskError",
    "TaskContext",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "default_task_backend",
    "task",
    "task_backends",
]
