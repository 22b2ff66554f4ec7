"""The project's own settings modules load and pass Django's system checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import django
import pytest

ROOT = Path(__file__).resolve().parents[2]
# What settings.production needs from the environment (docs/deployment.md).
PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "settings.production",
    "DJANGO_SECRET_KEY": "a-test-only-secret-0123456789-abcdefghijklmnopqrstuvwxyz-ABCDEFGHIJ",
    "DJANGO_ALLOWED_HOSTS": "durable-flow.example.com,testserver",
}


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize("module", ["settings.embedded", "settings.production"])
def test_settings_module_passes_the_system_checks(module: str, tmp_path: Path) -> None:
    env = {**os.environ, **PRODUCTION_ENV, "DJANGO_SETTINGS_MODULE": module, "DURABLE_FLOW_VAR_DIR": str(tmp_path)}
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


def production_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, **PRODUCTION_ENV, "DJANGO_STATIC_ROOT": str(tmp_path / "static"), **extra}
    env.pop("DATABASE_URL", None)
    # The browser tests set it in this process (Playwright's sync API beside Django); a
    # deployment never does, and `check --deploy` rightly refuses it (async.E001).
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return env


def test_production_settings_pass_the_deployment_checks_without_a_warning(tmp_path: Path) -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=production_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "no issues (0 silenced)" in result.stdout
    assert "WARNINGS" not in result.stderr


def test_production_settings_refuse_to_start_without_a_secret_key(tmp_path: Path) -> None:
    result = manage("check", env=production_env(tmp_path, DJANGO_SECRET_KEY=""))
    assert result.returncode == 1
    assert "ImproperlyConfigured: DJANGO_SECRET_KEY is not set" in result.stderr


SERVE_LIVE_JS = """
import django
django.setup()
from django.templatetags.static import static
from django.test import Client
response = Client().get(static("dashboard/live.js"), secure=True)
print(response.status_code)
"""


def test_production_collects_and_serves_the_dashboards_static_files_without_debug(tmp_path: Path) -> None:
    env = production_env(tmp_path)
    collected = manage("collectstatic", "--noinput", env=env)
    assert collected.returncode == 0, collected.stderr
    assert (tmp_path / "static" / "dashboard" / "live.js").is_file()
    assert (tmp_path / "static" / "staticfiles.json").is_file()  # hashed names, cached forever
    served = subprocess.run(
        [sys.executable, "-c", SERVE_LIVE_JS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert served.stdout.strip() == "200", served.stderr
