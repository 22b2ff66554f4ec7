"""System checks: a bad `DURABLE_FLOW` shows in `manage.py check` with an id and a hint.

- `durable_flow.E001`: the setting does not parse (a top-level key, QUEUES, POLLER, HEARTBEAT...);
- `durable_flow.E002` / `E003`: the admission / transport backend's class cannot be imported;
- `durable_flow.E004` / `E005`: the admission / transport backend refuses its options (an
  unknown key, a bad value, an `RQ_QUEUES` name that is not there), checked by the backend class
  without building it or connecting to anything;
- `durable_flow.E006`: the dashboard's sampling (`POLLER["SAMPLE_INTERVAL_S"]`,
  `POLLER["SAMPLE_RETENTION_S"]`) is out of range.
"""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from durable_flow.options import Configurable

HINTS = {
    "E001": (
        "See the settings reference in README.md: every number has a documented range, and NaN, "
        "infinities and True/False are refused."
    ),
    "E002": "Install the backend's extra dependencies or fix the dotted path.",
    "E003": "Install the backend's extra dependencies or fix the dotted path.",
    "E004": "Each admission backend's options are listed in README.md (and in its OPTIONS).",
    "E005": "Each transport's options are listed in README.md (and in its OPTIONS).",
    "E006": (
        "SAMPLE_INTERVAL_S is 1 to 3600 s, SAMPLE_RETENTION_S 3600 s (the charts show an hour) to a year (31536000 s)."
    ),
    "W001": "Use the 'local', 'db' or 'redis' admission backend, or drop concurrency= (see README, Step concurrency).",
}


def _error(message: str, check_id: str) -> checks.Error:
    return checks.Error(message, hint=HINTS[check_id], id=f"durable_flow.{check_id}")


@checks.register("durable_flow")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Parse `DURABLE_FLOW`, import both backends and have each check its options."""
    from django.conf import settings

    from durable_flow.conf import SamplingMisconfigured, parse_settings

    try:
        config = parse_settings(getattr(settings, "DURABLE_FLOW", {}))
    except SamplingMisconfigured as exc:
        return [_error(str(exc), "E006")]
    except ImproperlyConfigured as exc:
        return [_error(str(exc), "E001")]
    errors: list[checks.CheckMessage] = []
    for key, spec, import_id, options_id in (
        ("ADMISSION", config.admission, "E002", "E004"),
        ("TRANSPORT", config.transport, "E003", "E005"),
    ):
        try:
            cls = import_string(spec.path)
        except ImportError as exc:
            errors.append(_error(f'DURABLE_FLOW["{key}"]: cannot import backend {spec.path!r}: {exc}', import_id))
            continue
        if isinstance(cls, type) and issubclass(cls, Configurable):
            try:
                cls.check_options(spec.options)
            except ImproperlyConfigured as exc:
                errors.append(_error(str(exc), options_id))
        if key == "ADMISSION" and not getattr(cls, "SUPPORTS_CONSTRAINTS", False):
            errors.extend(_unenforced_step_concurrency())
    return errors


def _unenforced_step_concurrency() -> list[checks.CheckMessage]:
    from durable_flow.registry import workflows

    declaring = sorted(name for name, definition in workflows().items() if definition.concurrency)
    if not declaring:
        return []
    message = (
        f'DURABLE_FLOW["ADMISSION"] cannot enforce step concurrency, declared by {", ".join(declaring[:5])}'
        f"{' and others' if len(declaring) > 5 else ''}: starting those runs will fail"
    )
    return [checks.Warning(message, hint=HINTS["W001"], id="durable_flow.W001")]
