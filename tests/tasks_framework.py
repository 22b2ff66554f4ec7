"""Django's tasks framework as the backend sees it: `django.tasks` on Django 6, the `django-tasks`
backport on Django 5.2 (the same shim as `durable_flow.contrib.tasks`), so the tests run on both."""

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
    from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch  # type: ignore[import-not-found]
    from django.tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[import-not-found]

    LOGGER = "django.tasks"  # where the framework's own signal receivers log
except ImportError:  # Django 5.2
    from django_tasks import TaskContext, TaskResultStatus, default_task_backend, task, task_backends
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started

    LOGGER = "django_tasks"

__all__ = [
    "LOGGER",
    "InvalidTaskError",
    "TaskContext",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "default_task_backend",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
