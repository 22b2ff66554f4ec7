"""Every malformed `DURABLE_FLOW` setting fails `manage.py check` with an id, the key and a hint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import django
import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.test import override_settings

from tests.conftest import ManagedProcess

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
        'DURABLE_FLOW["ADMISSION"]["INSTANCE_TTL_MS"]: must be an integer from 1 to 3600000 (milliseconds), got',
    ),
    (
        "unknown key under POLLER",
        {"POLLER": {"INTERVAL": 500}},
        "durable_flow.E001",
        'DURABLE_FLOW["POLLER"]: unknown option(s) INTERVAL',
    ),
    (
        "unknown key under HEARTBEAT",
        {"HEARTBEAT": {"TTL": 30}},
        "durable_flow.E001",
        'DURABLE_FLOW["HEARTBEAT"]: unknown option(s) TTL',
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
        'DURABLE_FLOW["TRANSPORT"]["POLL_INTERVAL_S"]: must be a number above 0 and at most 60 (seconds), got 0',
    ),
    (
        "fractional batch size",
        {"POLLER": {"BATCH_SIZE": 0.5}},
        "durable_flow.E001",
        'DURABLE_FLOW["POLLER"]["BATCH_SIZE"]: must be an integer from 1 to 10000, got 0.5',
    ),
    (
        "absurd concurrency",
        {"TRANSPORT": {"BACKEND": "db", "CONCURRENCY": 10**30}},
        "durable_flow.E005",
        'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]: must be an integer from 1 to 1024, got 1000',
    ),
    (
        "samples more than once a second",
        {"POLLER": {"SAMPLE_INTERVAL_S": 0.5}},
        "durable_flow.E006",
        'DURABLE_FLOW["POLLER"]["SAMPLE_INTERVAL_S"]: must be a number from 1 to 3600 (seconds), got 0.5',
    ),
    (
        "samples kept less than the charts' hour",
        {"POLLER": {"SAMPLE_RETENTION_S": 600}},
        "durable_flow.E006",
        'DURABLE_FLOW["POLLER"]["SAMPLE_RETENTION_S"]: must be a number from 3600 to 31536000 (seconds), got 600',
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


# -- numbers: every numeric setting refuses bools, NaN, infinities and values out of its bounds ----
def reported() -> list[Any]:
    """The durable_flow checks' messages that `manage.py check` would show (the test settings
    silence the `inline` transport's warning, which `run_checks` alone does not)."""
    return [message for message in run_checks(tags=["durable_flow"]) if not message.is_silenced()]


NAN, INF = float("nan"), float("inf")
NOT_NUMBERS: tuple[object, ...] = (NAN, INF, -INF, 10**30, True, "5")


Build = Callable[[object], dict[str, Any]]


def under(section: str, key: str, **beside: object) -> Build:
    return lambda value: {section: {key: value, **beside}}


def top(key: str) -> Build:
    return lambda value: {key: value}


def backend(section: str, name: str, key: str) -> Build:
    return lambda value: {section: {"BACKEND": name, key: value}}


def adaptive(field: str) -> Build:
    return lambda value: {"TRANSPORT": {"BACKEND": "db", "CONCURRENCY": {"mode": "adaptive", field: value}}}


def queue(fields: Build) -> Build:
    return lambda value: {"QUEUES": [{"name": "q", **fields(value)}]}


TEN_YEARS_S = 10 * 365 * 86_400
# (DURABLE_FLOW for a value, check id, the setting as the message names it, other values refused)
NUMERIC_SETTINGS: list[tuple[Build, str, str, tuple[object, ...]]] = [
    (under("POLLER", "INTERVAL_MS"), "E001", 'DURABLE_FLOW["POLLER"]["INTERVAL_MS"]:', (0, -1, 3_600_001)),
    (under("POLLER", "BATCH_SIZE"), "E001", 'DURABLE_FLOW["POLLER"]["BATCH_SIZE"]:', (0, -1, 2.5, 10_001)),
    (under("POLLER", "MAINTENANCE_S"), "E001", 'DURABLE_FLOW["POLLER"]["MAINTENANCE_S"]:', (0, -1, 3601)),
    (under("POLLER", "SAMPLE_INTERVAL_S"), "E006", 'DURABLE_FLOW["POLLER"]["SAMPLE_INTERVAL_S"]:', (0, 0.5, 3601)),
    (under("POLLER", "SAMPLE_RETENTION_S"), "E006", 'DURABLE_FLOW["POLLER"]["SAMPLE_RETENTION_S"]:', (0, 600, 10**8)),
    (under("POLLER", "REFUSAL_RETENTION_S"), "E009", 'DURABLE_FLOW["POLLER"]["REFUSAL_RETENTION_S"]:', (0, 600, 10**8)),
    (
        under("POLLER", "VACUUM_DEAD_ROWS"),
        "E014",
        'DURABLE_FLOW["POLLER"]["VACUUM_DEAD_ROWS"]:',
        (0, 999, 1.5, 10**9 + 1),
    ),
    (under("POLLER", "VACUUM_DEAD_FRACTION"), "E014", 'DURABLE_FLOW["POLLER"]["VACUUM_DEAD_FRACTION"]:', (-0.1, 101)),
    (
        under("POLLER", "VACUUM_MIN_INTERVAL_S"),
        "E014",
        'DURABLE_FLOW["POLLER"]["VACUUM_MIN_INTERVAL_S"]:',
        (0, 0.5, 86_401),
    ),
    (
        under("POLLER", "RUN_RETENTION_S"),
        "E015",
        'DURABLE_FLOW["POLLER"]["RUN_RETENTION_S"]:',
        (0, 600, TEN_YEARS_S + 1),
    ),
    (under("POLLER", "PURGE_BATCH_SIZE"), "E015", 'DURABLE_FLOW["POLLER"]["PURGE_BATCH_SIZE"]:', (0, 1.5, 10_001)),
    (under("POLLER", "PURGE_BATCHES"), "E015", 'DURABLE_FLOW["POLLER"]["PURGE_BATCHES"]:', (0, -1, 1001)),
    (under("POLLER", "PURGE_PASS_S"), "E015", 'DURABLE_FLOW["POLLER"]["PURGE_PASS_S"]:', (0, -1, 61, "1")),
    (under("HEARTBEAT", "INTERVAL_S", TTL_S=86_400), "E001", 'DURABLE_FLOW["HEARTBEAT"]["INTERVAL_S"]:', (0, -1, 3601)),
    (under("HEARTBEAT", "TTL_S"), "E001", 'DURABLE_FLOW["HEARTBEAT"]["TTL_S"]:', (0, -1, 86_401)),
    (top("MAX_PAYLOAD_BYTES"), "E001", 'DURABLE_FLOW["MAX_PAYLOAD_BYTES"]:', (0, -1, 1.5, 2**30 + 1)),
    (top("REDISPATCH_AFTER_S"), "E001", 'DURABLE_FLOW["REDISPATCH_AFTER_S"]:', (0, -1, 7 * 86_400 + 1)),
    (queue(lambda v: {"concurrency": v}), "E001", "'q'.concurrency:", (0, -1, 2**31)),
    (queue(lambda v: {"retry_ms": v}), "E001", "'q'.retry_ms:", (0, -1)),
    (queue(lambda v: {"rate_limit": {"limit": v, "period_ms": 1000}}), "E001", "'q'.rate_limit.limit:", (0, 2**31)),
    (queue(lambda v: {"rate_limit": {"limit": 1, "period_ms": v}}), "E001", "'q'.rate_limit.period_ms:", (0, -1)),
    (queue(lambda v: {"throttle": {"limit": 1, "period_ms": 1, "burst": v}}), "E001", "'q'.throttle.burst:", (0, -1)),
    (backend("TRANSPORT", "db", "VISIBILITY_TIMEOUT_S"), "E005", '["VISIBILITY_TIMEOUT_S"]:', (0, -1, 86_401)),
    (backend("TRANSPORT", "db", "POLL_INTERVAL_S"), "E005", '["POLL_INTERVAL_S"]:', (0, -1, 61)),
    (backend("TRANSPORT", "db", "CONCURRENCY"), "E005", '["TRANSPORT"]["CONCURRENCY"]:', (0, -1, 1025)),
    (adaptive("min"), "E005", '["CONCURRENCY"]["min"]:', (0, -1, 1025)),
    (adaptive("max"), "E005", '["CONCURRENCY"]["max"]:', (0, -1, 1025)),
    (adaptive("tick_ms"), "E005", '["CONCURRENCY"]["tick_ms"]:', (0, 9, 60_001)),
    (adaptive("ram_ceiling_pct"), "E005", '["CONCURRENCY"]["ram_ceiling_pct"]:', (0, -1, 101)),
    (adaptive("cpu_ceiling_pct"), "E005", '["CONCURRENCY"]["cpu_ceiling_pct"]:', (0, -1, 101)),
    (backend("TRANSPORT", "rq", "RESULT_TTL"), "E005", '["RESULT_TTL"]:', (-2, 1.5, TEN_YEARS_S + 1)),
    (backend("TRANSPORT", "rq", "FAILURE_TTL"), "E005", '["FAILURE_TTL"]:', (-2, 1.5, TEN_YEARS_S + 1)),
    (backend("ADMISSION", "redis", "INSTANCE_TTL_MS"), "E004", '["INSTANCE_TTL_MS"]:', (0, -1, 1.5, 3_600_001)),
]


@pytest.mark.parametrize(
    ("durable_flow", "check_id", "names"),
    [
        pytest.param(build(value), check_id, names, id=f"{names}{value!r}")
        for build, check_id, names, refused in NUMERIC_SETTINGS
        for value in (*NOT_NUMBERS, *refused)
    ],
)
def test_every_numeric_setting_refuses_non_finite_and_out_of_bounds_values(
    durable_flow: dict[str, Any], check_id: str, names: str
) -> None:
    with override_settings(DURABLE_FLOW=durable_flow):
        errors = reported()
    assert [error.id for error in errors] == [f"durable_flow.{check_id}"]
    assert names in errors[0].msg and " must be " in errors[0].msg
    assert errors[0].hint


@pytest.mark.parametrize(
    ("names", "durable_flow"),
    [pytest.param(names, build, id=names) for build, _, names, _ in NUMERIC_SETTINGS],
)
def test_every_numeric_setting_accepts_a_value_within_its_bounds(names: str, durable_flow: Build) -> None:
    sane = {
        "SAMPLE_RETENTION_S": 7200,
        "REFUSAL_RETENTION_S": 7200,
        "VACUUM_DEAD_ROWS": 5000,
        "RUN_RETENTION_S": 7200,
        "tick_ms": 2000,
        "RESULT_TTL": -1,
    }
    value = next((value for key, value in sane.items() if key in names), 20)
    with override_settings(DURABLE_FLOW=durable_flow(value)):
        assert reported() == []


def test_an_unknown_redis_admission_connection_fails_check_without_connecting() -> None:
    setting = {"ADMISSION": {"BACKEND": "redis", "CONNECTION": "nope"}}
    with override_settings(DURABLE_FLOW=setting, RQ_QUEUES={"default": {"URL": "redis://unreachable.invalid:1/0"}}):
        errors = reported()
    assert [error.id for error in errors] == ["durable_flow.E004"]
    assert 'DURABLE_FLOW["ADMISSION"]["CONNECTION"]: \'nope\' is not a queue in settings.RQ_QUEUES' in errors[0].msg
    assert errors[0].hint


@pytest.mark.parametrize("command", ["durable_poller", "durable_worker"])
def test_a_process_with_a_bad_setting_refuses_to_start_with_the_check_error(
    command: str, spawn: Callable[..., ManagedProcess]
) -> None:
    """`durable_poller` and `durable_worker` run the system checks first: a NaN heartbeat TTL
    (which used to crash the poller mid-pass) stops them before they start."""
    process = spawn(command, env={"DURABLE_FLOW_HEARTBEAT_TTL_S": "nan", "DURABLE_FLOW_TRANSPORT": "db"})
    assert process.proc.wait(60) != 0
    output = process.output()
    assert "SystemCheckError" in output and "durable_flow.E001" in output
    assert 'DURABLE_FLOW["HEARTBEAT"]["TTL_S"]: must be ' in output and "HINT:" in output


@pytest.mark.django_db
@pytest.mark.parametrize("flag", ["--batch-size", "--interval-ms"])
@pytest.mark.parametrize("value", ["0", str(10**30)])
def test_the_pollers_flags_are_bounded_like_its_settings(flag: str, value: str) -> None:
    with pytest.raises(CommandError, match=f"{flag} must be an integer from 1 to"):
        call_command("durable_poller", "--once", flag, value)


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
