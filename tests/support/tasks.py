"""Task runs as the `django.tasks` backend stores them."""

from __future__ import annotations

from typing import Any


def task_payload(path: str, *args: Any) -> dict[str, Any]:
    """A task run's input as the backend stores it, naming `path`."""
    return {
        "task": path,
        "args": list(args),
        "kwargs": {},
        "queue": "default",
        "priority": 0,
        "run_after": None,
        "takes_context": False,
        "backend": "default",
        "result_id": "forged",
    }
