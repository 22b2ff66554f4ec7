"""System checks: a bad `DURABLE_FLOW` shows in `manage.py check` with an id and a hint.

- `durable_flow.E001`: the setting does not parse (a top-level key, QUEUES, POLLER, HEARTBEAT...);
- `durable_flow.E002` / `E003`: the admission / transport backend's class cannot be imported;
- `durable_flow.E004` / `E005`: the admission / transport backend refuses its options (an
  unknown key, a bad value, an `RQ_QUEUES` name that is not there), checked by the backend class
  without building it or connecting to anything;
- `durable_flow.E006`: the dashboard's sampling (`POLLER["SAMPLE_INTERVAL_S"]`,
  `POLLER["SAMPLE_RETENTION_S"]`) is out of range;
- `durable_flow.E009`: the refusal history's retention (`POLLER["REFUSAL_RETENTION_S"]`) is out
  of range;
- `durable_flow.E010` to `E013`: a workflow's `schedule=` does not parse (raised when its module
  is imported, so every command stops at start-up: `durable_flow.definitions.schedules`);
- `durable_flow.E014`: the poller's vacuum of the hot tables (`POLLER["VACUUM_DEAD_ROWS"]`,
  `["VACUUM_DEAD_FRACTION"]`, `["VACUUM_MIN_INTERVAL_S"]`) is out of range;
- `durable_flow.E015`: run retention (`POLLER["RUN_RETENTION_S"]`, `["PURGE_BATCH_SIZE"]`,
  `["PURGE_BATCHES"]`, `["PURGE_PASS_S"]`) is out of range, or a workflow's `retention` is;
- `durable_flow.E007`: `TASKS` names the tasks backend on Django 5.2 but `django_tasks` is not
  installed (its checks never run, and `override_settings(TASKS=...)` keeps the old backends);
- `durable_flow.E008`: the admin's run pages cannot find the app's templates;
- `durable_flow.W002`: the transport is `inline` (the default, a test mode: steps run inside the
  process that starts the run, the web process included) while `DEBUG` is off.

The dashboard's wiring (Channels routing, channel layer, templates, URLs) is checked by
`dashboard/checks.py`.
"""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from durable_flow.config.options import Configurable
from durable_flow.config.settings import (
    TRANSPORT_BACKENDS,
    RefusalRetentionMisconfigured,
    RunRetentionMisconfigured,
    SamplingMisconfigured,
    VacuumMisconfigured,
    parse_settings,
)
from durable_flow.definitions.registry import workflows

HINTS = {
    "E001": (
        "See docs/settings.md: every number has a documented range, and NaN, infinities and True/False are refused."
    ),
    "E002": "Install the backend's extra dependencies or fix the dotted path.",
    "E003": "Install the backend's extra dependencies or fix the dotted path.",
    "E004": "Each admission backend's options are listed in docs/settings.md (and in its OPTIONS).",
    "E005": "Each transport's options are listed in docs/settings.md (and in its OPTIONS).",
    "E006": (
        "SAMPLE_INTERVAL_S is 1 to 3600 s, SAMPLE_RETENTION_S 3600 s (the charts show an hour) to a year (31536000 s)."
    ),
    "E009": "REFUSAL_RETENTION_S is 3600 s (the quota page's chart shows an hour) to a year (31536000 s).",
    "E014": (
        "VACUUM_DEAD_ROWS is None (off) or 1000 to 1000000000 rows, VACUUM_DEAD_FRACTION 0 to 100, "
        "VACUUM_MIN_INTERVAL_S 1 to 86400 s (docs/settings.md)."
    ),
    "E015": (
        "RUN_RETENTION_S is None (keep every run) or 3600 s to ten years (315360000 s); PURGE_BATCH_SIZE 1 to 10000; "
        "PURGE_BATCHES 1 to 1000; PURGE_PASS_S above 0, at most 60 s. See docs/deployment.md, Retention."
    ),
    "W001": "Use the 'local', 'db' or 'redis' admission backend, or drop concurrency= (see docs/step-concurrency.md).",
    "E007": 'Add "django_tasks" to INSTALLED_APPS (the django-tasks backport; Django 6 has it built in).',
    "E008": 'Set "APP_DIRS": True on the DjangoTemplates backend in TEMPLATES (or list the app directories loader).',
    "W002": 'Set DURABLE_FLOW["TRANSPORT"] to "db" or "rq" and run `manage.py durable_worker` (docs/deployment.md); '
    "silence durable_flow.W002 in test settings.",
}

# A template of the admin's run pages: found only if the app's templates directory is searched.
ADMIN_TEMPLATE = "admin/durable_flow/workflowrun/change_form.html"


def _error(message: str, check_id: str) -> checks.Error:
    return checks.Error(message, hint=HINTS[check_id], id=f"durable_flow.{check_id}")


@checks.register("durable_flow")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Parse `DURABLE_FLOW`, import both backends and have each check its options."""
    from django.conf import settings

    try:
        config = parse_settings(getattr(settings, "DURABLE_FLOW", {}))
    except SamplingMisconfigured as exc:
        return [_error(str(exc), "E006")]
    except RefusalRetentionMisconfigured as exc:
        return [_error(str(exc), "E009")]
    except VacuumMisconfigured as exc:
        return [_error(str(exc), "E014")]
    except RunRetentionMisconfigured as exc:
        return [_error(str(exc), "E015")]
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
    if config.transport.path == TRANSPORT_BACKENDS["inline"] and not settings.DEBUG:
        explicit = "TRANSPORT" in (getattr(settings, "DURABLE_FLOW", None) or {})
        message = (
            f'DURABLE_FLOW["TRANSPORT"] is "inline"{"" if explicit else " (the default)"} with DEBUG off: '
            "every step runs inside the process that starts or resumes its run, the web process included"
        )
        errors.append(checks.Warning(message, hint=HINTS["W002"], id="durable_flow.W002"))
    return errors


@checks.register("durable_flow")
def check_tasks_app(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """On Django 5.2 the tasks framework is an app: without it in INSTALLED_APPS its
    `setting_changed` receiver and its checks are never loaded."""
    import django
    from django.apps import apps
    from django.conf import settings

    if django.VERSION >= (6,) or apps.is_installed("django_tasks"):
        return []
    tasks = getattr(settings, "TASKS", None)
    aliases = sorted(
        alias
        for alias, options in (tasks.items() if isinstance(tasks, dict) else ())
        if isinstance(options, dict) and str(options.get("BACKEND", "")).startswith("durable_flow.")
    )
    if not aliases:
        return []
    message = f"TASKS[{aliases[0]!r}] uses durable_flow's tasks backend but django_tasks is not in INSTALLED_APPS"
    return [_error(message, "E007")]


@checks.register(checks.Tags.templates)
def check_admin_templates(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The admin's run pages extend templates shipped in `durable_flow/templates/`."""
    from django.apps import apps

    if not apps.is_installed("django.contrib.admin"):
        return []
    return [_error(message, "E008") for message in missing_templates([ADMIN_TEMPLATE])]


def missing_templates(names: list[str]) -> list[str]:
    """A message for each template no configured engine finds (none when no engine is set up:
    Django's own checks report that)."""
    from django.template import TemplateDoesNotExist, engines
    from django.template.loader import get_template

    if not engines.all():
        return []
    missing = []
    for name in names:
        try:
            get_template(name)
        except TemplateDoesNotExist:
            missing.append(f"template {name!r} not found: the app's templates directory is not searched")
    return missing


def _unenforced_step_concurrency() -> list[checks.CheckMessage]:

    declaring = sorted(name for name, definition in workflows().items() if definition.concurrency)
    if not declaring:
        return []
    message = (
        f'DURABLE_FLOW["ADMISSION"] cannot enforce step concurrency, declared by {", ".join(declaring[:5])}'
        f"{' and others' if len(declaring) > 5 else ''}: starting those runs will fail"
    )
    return [checks.Warning(message, hint=HINTS["W001"], id="durable_flow.W001")]
