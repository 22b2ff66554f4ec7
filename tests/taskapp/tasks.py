"""Found by the task-declaration scan of installed apps' `tasks` modules, never imported by path."""

from __future__ import annotations

from tests.tasks_framework import task


@task
def ping(value: int) -> str:
    return f"pong {value}"
