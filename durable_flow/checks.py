"""System checks: a bad `DURABLE_FLOW` shows in `manage.py check` with a hint."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string


@checks.register("durable_flow")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E001: the setting does not parse. E002/E003: a backend's class cannot be imported."""
    from django.conf import settings

    from durable_flow.conf import parse_settings

    try:
        config = parse_settings(getattr(settings, "DURABLE_FLOW", {}))
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), hint="See the settings reference in README.md.", id="durable_flow.E001")]
    errors: list[checks.CheckMessage] = []
    for key, spec, check_id in (("ADMISSION", config.admission, "E002"), ("TRANSPORT", config.transport, "E003")):
        try:
            import_string(spec.path)
        except ImportError as exc:
            errors.append(
                checks.Error(
                    f'DURABLE_FLOW["{key}"]: cannot import backend {spec.path!r}: {exc}',
                    hint="Install the backend's extra dependencies or fix the dotted path.",
                    id=f"durable_flow.{check_id}",
                )
            )
    return errors
