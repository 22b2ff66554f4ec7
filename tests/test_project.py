"""The project's own settings modules load and pass Django's system checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import django
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", ["settings.embedded", "settings.production"])
def test_settings_module_passes_the_system_checks(module: str, tmp_path: Path) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": module, "DURABLE_FLOW_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


OVERRIDE_TASKS = """
import django
django.setup()
from django.test import override_settings
from django_tasks import task_backends
task_backends["default"]  # the project's backend, now cached
with override_settings(TASKS={"default": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"}}):
    print(type(task_backends["default"]).__name__)
"""


@pytest.mark.skipif(django.VERSION >= (6,), reason="Django 6 has the tasks framework built in")
def test_overriding_tasks_replaces_the_backend(tmp_path: Path) -> None:
    """The `django-tasks` backport is an installed app, so its `setting_changed` receiver drops
    the cached backends when a host project's test overrides TASKS."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "settings.embedded", "DURABLE_FLOW_VAR_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", OVERRIDE_TASKS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ImmediateBackend"
