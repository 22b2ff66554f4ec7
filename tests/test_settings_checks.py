"""Every malformed `DURABLE_FLOW` setting fails `manage.py check` with an id, the key and a hint."""

from __future__ import annotations

from typing import Any

import django
import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

MALFORMED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "misspelt option on local",
        {"ADMISSION": {"BACKEND": "local", "WAITER_TTL": 5000}},
        "durable_flow.E004",
        'DURABLE_FLOW["ADMISSION"]: unknown option(s) WAITER_TTL',
    ),
    (
        "misspelt option on db",
        {"ADMISSION": {"BACKEND": "db", "WAITER_TTL": 5000}},
        "durable_flow.E004",
        'DURABLE_FLOW["ADMISSION"]: unknown option(s) WAITER_TTL',
    ),
    (
        "misspelt option on redis",
        {"ADMISSION": {"BACKEND": "redis", "WAITER_TTL": 5000}},
        "durable_flow.E004",
        'DURABLE_FLOW["ADMISSION"]: unknown option(s) WAITER_TTL',
    ),
    (
        "bad admission value",
        {"ADMISSION": {"BACKEND": "redis", "INSTANCE_TTL_MS": "60s"}},
        "durable_flow.E004",
        'DURABLE_FLOW["ADMISSION"]["INSTANCE_TTL_MS"]: must be a positive integer',
    ),
    (
        "unknown key under POLLER",
        {"POLLER": {"INTERVAL": 500}},
        "durable_flow.E001",
        'DURABLE_FLOW["POLLER"]: unknown key(s) INTERVAL',
    ),
    (
        "unknown key under HEARTBEAT",
        {"HEARTBEAT": {"TTL": 30}},
        "durable_flow.E001",
        'DURABLE_FLOW["HEARTBEAT"]: unknown key(s) TTL',
    ),
    (
        "heartbeat TTL below its interval",
        {"HEARTBEAT": {"INTERVAL_S": 10, "TTL_S": 5}},
        "durable_flow.E001",
        'DURABLE_FLOW["HEARTBEAT"]: TTL_S (5) must be greater than INTERVAL_S (10)',
    ),
    (
        "zero poll interval",
        {"TRANSPORT": {"BACKEND": "db", "POLL_INTERVAL_S": 0}},
        "durable_flow.E005",
        'DURABLE_FLOW["TRANSPORT"]["POLL_INTERVAL_S"]: must be a positive number, got 0',
    ),
    (
        "fractional batch size",
        {"POLLER": {"BATCH_SIZE": 0.5}},
        "durable_flow.E001",
        'DURABLE_FLOW["POLLER"]: BATCH_SIZE must be a positive integer, got 0.5',
    ),
    (
        "absurd concurrency",
        {"TRANSPORT": {"BACKEND": "db", "CONCURRENCY": 10**30}},
        "durable_flow.E005",
        'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]: must be between 1 and 1024',
    ),
    (
        "samples more than once a second",
        {"POLLER": {"SAMPLE_INTERVAL_S": 0.5}},
        "durable_flow.E006",
        'DURABLE_FLOW["POLLER"]: SAMPLE_INTERVAL_S must be a number of seconds of at least 1, got 0.5',
    ),
    (
        "samples kept less than the charts' hour",
        {"POLLER": {"SAMPLE_RETENTION_S": 600}},
        "durable_flow.E006",
        'DURABLE_FLOW["POLLER"]: SAMPLE_RETENTION_S must be a number of seconds of at least 3600, got 600',
    ),
    (
        "misspelt transport option",
        {"TRANSPORT": {"BACKEND": "inline", "CONCURENCY": 4}},
        "durable_flow.E005",
        'DURABLE_FLOW["TRANSPORT"]: unknown option(s) CONCURENCY',
    ),
]


# Django 6's `check` runs the database-dependent model checks too (JSONField support), hence
# the database mark on both `manage.py check` tests.
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("durable_flow", "check_id", "message"),
    [pytest.param(setting, check_id, message, id=name) for name, setting, check_id, message in MALFORMED],
)
def test_malformed_setting_fails_manage_py_check(durable_flow: dict[str, Any], check_id: str, message: str) -> None:
    with override_settings(DURABLE_FLOW=durable_flow), pytest.raises(SystemCheckError) as failure:
        call_command("check")
    report = str(failure.value)
    assert check_id in report
    assert message in report
    assert "HINT:" in report


@pytest.mark.django_db
def test_well_formed_settings_pass_manage_py_check() -> None:
    setting = {
        "ADMISSION": {"BACKEND": "db"},
        "TRANSPORT": {"BACKEND": "db", "CONCURRENCY": 8, "POLL_INTERVAL_S": 0.2},
        "POLLER": {"INTERVAL_MS": 250, "BATCH_SIZE": 100},
        "HEARTBEAT": {"INTERVAL_S": 2, "TTL_S": 15},
    }
    with override_settings(DURABLE_FLOW=setting):
        call_command("check")


# The wiring a host project copies from the settings reference: each missing piece is an error
# (or a warning) of `manage.py check`, with a hint.

APP_TEMPLATES_ONLY = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
NO_APP_TEMPLATES = [{**APP_TEMPLATES_ONLY[0], "APP_DIRS": False}]

MISWIRED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "no channel layer",
        {"CHANNEL_LAYERS": {}},
        "durable_flow_dashboard.E001",
        "CHANNEL_LAYERS has no 'default' layer",
    ),
    (
        "no ASGI application",
        {"ASGI_APPLICATION": None},
        "durable_flow_dashboard.E002",
        "ASGI_APPLICATION is not set",
    ),
    (
        "an ASGI application without WebSocket routing",
        {"ASGI_APPLICATION": "django.core.handlers.asgi.ASGIHandler"},
        "durable_flow_dashboard.E002",
        "does not route WebSockets through Channels",
    ),
    (
        "dashboard URLs not included",
        {"ROOT_URLCONF": "durable_flow.urls"},
        "durable_flow_dashboard.E004",
        "the dashboard's URLs are not included",
    ),
    (
        "dashboard templates not searched",
        {"TEMPLATES": NO_APP_TEMPLATES},
        "durable_flow_dashboard.E003",
        "template 'dashboard/base.html' not found",
    ),
    (
        "admin templates not searched",
        {"TEMPLATES": NO_APP_TEMPLATES},
        "durable_flow.E008",
        "template 'admin/durable_flow/workflowrun/change_form.html' not found",
    ),
]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overrides", "check_id", "message"),
    [pytest.param(overrides, check_id, message, id=name) for name, overrides, check_id, message in MISWIRED],
)
def test_missing_wiring_fails_manage_py_check(overrides: dict[str, Any], check_id: str, message: str) -> None:
    with override_settings(**overrides), pytest.raises(SystemCheckError) as failure:
        call_command("check")
    report = str(failure.value)
    assert check_id in report
    assert message in report
    assert "HINT:" in report


def test_apps_carry_their_templates() -> None:
    """A host project with no templates directory of its own finds the dashboard's and the
    admin's pages in the apps."""
    from django.template.loader import get_template

    with override_settings(TEMPLATES=APP_TEMPLATES_ONLY):
        get_template("dashboard/index.html")
        get_template("admin/durable_flow/workflowrun/change_list.html")


@pytest.mark.skipif(django.VERSION >= (6,), reason="Django 6 has the tasks framework built in")
@pytest.mark.django_db
def test_tasks_backend_without_the_django_tasks_app_fails_manage_py_check() -> None:
    without = [app for app in settings.INSTALLED_APPS if app != "django_tasks"]
    with override_settings(INSTALLED_APPS=without), pytest.raises(SystemCheckError) as failure:
        call_command("check")
    report = str(failure.value)
    assert "durable_flow.E007" in report
    assert "django_tasks is not in INSTALLED_APPS" in report


@pytest.mark.django_db
@pytest.mark.parametrize("durable_flow", [{}, {"TRANSPORT": {"BACKEND": "inline"}}], ids=["default", "explicit"])
def test_inline_transport_without_debug_warns(durable_flow: dict[str, Any]) -> None:
    overrides = {"DEBUG": False, "SILENCED_SYSTEM_CHECKS": [], "DURABLE_FLOW": durable_flow}
    with override_settings(**overrides), pytest.raises(SystemCheckError) as failure:
        call_command("check", fail_level="WARNING")
    report = str(failure.value)
    assert "durable_flow.W002" in report
    assert "web process" in report


@pytest.mark.django_db
def test_inline_transport_with_debug_does_not_warn() -> None:
    overrides = {"DEBUG": True, "SILENCED_SYSTEM_CHECKS": [], "DURABLE_FLOW": {}}
    with override_settings(**overrides):
        call_command("check", fail_level="WARNING")
