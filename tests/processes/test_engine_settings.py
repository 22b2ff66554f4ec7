"""Malformed `DURABLE_FLOW` settings are refused with an `ImproperlyConfigured` that names the
offending key, and `manage.py check` reports them as `durable_flow.E001`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from durable_flow.config.settings import parse_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"WORKFLOWS": "tests.workflows"}, 'DURABLE_FLOW["WORKFLOWS"]'),
        ({"QUEUES": {"name": "q"}}, 'DURABLE_FLOW["QUEUES"]'),
        ({"QUEUES": [{"name": "q", "concurrency": 0}]}, "DURABLE_FLOW[\"QUEUES\"][0] 'q'.concurrency"),
        (
            {"QUEUES": [{"name": "q"}, {"name": "r", "rate_limit": {"limit": 1}}]},
            "DURABLE_FLOW[\"QUEUES\"][1] 'r'.rate_limit.period_ms",
        ),
        ({"QUEUES": [{"name": "q"}, {"name": "q"}]}, "queue 'q' is declared twice"),
        ({"POLLER": {"INTERVAL_MS": 0}}, 'DURABLE_FLOW["POLLER"]["INTERVAL_MS"]:'),
        ({"POLLER": []}, 'DURABLE_FLOW["POLLER"]'),
        ({"POLLER": {"MAINTENANCE_S": 0}}, 'DURABLE_FLOW["POLLER"]["MAINTENANCE_S"]:'),
        ({"POLLER": {"MAINTENANCE_S": "5"}}, 'DURABLE_FLOW["POLLER"]["MAINTENANCE_S"]:'),
        ({"HEARTBEAT": {"TTL_S": "15"}}, 'DURABLE_FLOW["HEARTBEAT"]["TTL_S"]:'),
        ({"MAX_PAYLOAD_BYTES": 0}, 'DURABLE_FLOW["MAX_PAYLOAD_BYTES"]'),
        ({"REDISPATCH_AFTER_S": True}, 'DURABLE_FLOW["REDISPATCH_AFTER_S"]'),
        (
            {"TRANSPORT": {"BACKEND": "carrier-pigeon"}},
            'DURABLE_FLOW["TRANSPORT"]["BACKEND"]: must be one of inline, db, rq or a dotted class path',
        ),
        ({"ADMISSION": {"BACKEND": 3}}, 'DURABLE_FLOW["ADMISSION"]'),
        ({"QUEUS": []}, "DURABLE_FLOW: unknown option(s) QUEUS"),
        (["WORKFLOWS"], "DURABLE_FLOW: must be a dict, got list"),
    ],
)
def test_malformed_settings_raise_improperly_configured_naming_the_key(raw: Any, names: str) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        parse_settings(raw)
    assert names in str(info.value)


def test_well_formed_settings_parse_into_their_values() -> None:
    config = parse_settings(
        {
            "QUEUES": [{"name": "q", "concurrency": 2}],
            "TRANSPORT": {"BACKEND": "db", "VISIBILITY_TIMEOUT_S": 5},
            "POLLER": {"INTERVAL_MS": 250, "BATCH_SIZE": 50, "MAINTENANCE_S": 1.5},
            "MAX_PAYLOAD_BYTES": 1024,
        }
    )
    assert config.poller_maintenance_s == 1.5 and parse_settings({}).poller_maintenance_s == 5.0
    assert [queue.name for queue in config.queues] == ["q"] and config.queues[0].concurrency == 2
    assert config.transport.path == "durable_flow.transports.db.transport.DatabaseTransport"
    assert config.transport.options == {"VISIBILITY_TIMEOUT_S": 5}
    assert (config.poller_interval_ms, config.poller_batch_size, config.max_payload_bytes) == (250, 50, 1024)


def test_system_check_reports_malformed_settings_as_e001() -> None:
    with override_settings(DURABLE_FLOW={"POLLER": {"INTERVAL_MS": -5}}):
        errors = run_checks(tags=["durable_flow"])
    assert [error.id for error in errors] == ["durable_flow.E001"]
    assert 'DURABLE_FLOW["POLLER"]["INTERVAL_MS"]:' in errors[0].msg


def test_system_check_reports_an_unimportable_backend_as_e003() -> None:
    with override_settings(DURABLE_FLOW={"TRANSPORT": {"BACKEND": "no_such_pkg.Transport"}}):
        errors = run_checks(tags=["durable_flow"])
    assert [error.id for error in errors] == ["durable_flow.E003"]
    assert "no_such_pkg.Transport" in errors[0].msg


def manage_check(tmp_path: Path, durable_flow: str) -> subprocess.CompletedProcess[str]:
    """`manage.py check` under settings.test with `DURABLE_FLOW` replaced by the given literal."""
    (tmp_path / "bad_df_settings.py").write_text(
        f"from settings.test import *  # noqa: F403\nDURABLE_FLOW = {durable_flow}\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bad_df_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_manage_py_check_with_malformed_settings_fails_naming_the_key(tmp_path: Path) -> None:
    result = manage_check(tmp_path, '{"WORKFLOWS": ["tests.workflows"], "POLLER": {"INTERVAL_MS": -5}}')
    assert result.returncode != 0
    assert (
        'DURABLE_FLOW["POLLER"]["INTERVAL_MS"]: must be a number from 1 to 3600000 (milliseconds), got -5'
        in result.stderr
    )


def test_manage_py_check_reports_malformed_settings_as_e001(tmp_path: Path) -> None:
    result = manage_check(tmp_path, '{"WORKFLOWS": ["tests.workflows"], "POLLER": {"INTERVAL_MS": -5}}')
    assert "durable_flow.E001" in result.stderr + result.stdout


def test_the_poller_runs_its_dead_worker_pass_on_the_configured_period() -> None:
    from django.test import override_settings

    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.config.settings import get_settings, reset_settings
    from durable_flow.engine import Engine
    from durable_flow.runtime.poller import TimerPoller
    from durable_flow.transports.inline import InlineTransport

    with override_settings(DURABLE_FLOW={"POLLER": {"MAINTENANCE_S": 0.75}}):
        reset_settings()
        try:
            engine = Engine(admission=LocalAdmissionBackend(), transport=InlineTransport(), settings=get_settings())
            assert TimerPoller(engine).maintenance_every_s == 0.75
        finally:
            reset_settings()
