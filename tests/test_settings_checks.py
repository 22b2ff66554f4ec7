"""Every malformed `DURABLE_FLOW` setting fails `manage.py check` with an id, the key and a hint."""

from __future__ import annotations

from typing import Any

import pytest
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


def test_well_formed_settings_pass_manage_py_check() -> None:
    setting = {
        "ADMISSION": {"BACKEND": "db"},
        "TRANSPORT": {"BACKEND": "db", "CONCURRENCY": 8, "POLL_INTERVAL_S": 0.2},
        "POLLER": {"INTERVAL_MS": 250, "BATCH_SIZE": 100},
        "HEARTBEAT": {"INTERVAL_S": 2, "TTL_S": 15},
    }
    with override_settings(DURABLE_FLOW=setting):
        call_command("check")
