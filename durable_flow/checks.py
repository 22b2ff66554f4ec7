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
- `durable_flow.E016`: a queue's start timeout in `QUEUES` (`start_timeout_s`, `on_start_timeout`)
  is wrong: negative, zero, NaN, infinite or over a week, or an outcome other than fail/skip;
- `durable_flow.E020`: `EVENTS` is not a list of well-formed event names, each once;
- `durable_flow.E021` / `E023`: a workflow's `trigger=` / `cancel_on=` names an event that
  `EVENTS` does not declare;
- `durable_flow.E022` / `E024`: a workflow's `trigger_if` or `cancel_on` match does not compile /
  its event declaration is malformed (raised when its module is imported, as a bad schedule:
  `durable_flow.definitions.events`);
- `durable_flow.E030`: the admission backend cannot keep a declaration (the `redis` backend on Redis
  Cluster: a workflow placed in a shard whose step-concurrency keys would cross hash slots);
- `durable_flow.E040` to `E049`: the `rq` transport's lanes (`TRANSPORT["ROUTES"]`): `E040` a route
  to an `RQ_QUEUES` entry that is not there, `E042` a lane named like another lane's tier, `E043` a
  tier listed in `RQ_QUEUES` on another Redis than its lane; `W041` a route for a flow-control queue
  `QUEUES` does not declare;
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
    DurableFlowSettings,
    EventsMisconfigured,
    RefusalRetentionMisconfigured,
    RunRetentionMisconfigured,
    SamplingMisconfigured,
    StartTimeoutMisconfigured,
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
    "E016": (
        "start_timeout_s is a number of seconds above 0 and at most 604800 (a week), or omitted to wait as long as "
        "it takes; on_start_timeout is 'fail' or 'skip' (docs/flow-control.md, Start timeouts)."
    ),
    "E030": (
        "On Redis Cluster one admission stays in one shard: keep a workflow declaring env- or account-scope "
        "concurrency (and the queues its steps use) out of SHARDS, in the 'default' shard (docs/redis-cluster.md)."
    ),
    "E020": (
        'EVENTS is a list of event names such as ["orders/created", "orders/paid"]: a letter or digit first, then '
        "letters, digits and _ . : / - (docs/events.md)."
    ),
    "E021": 'Add the event to DURABLE_FLOW["EVENTS"] or fix the trigger= name (docs/events.md).',
    "E023": 'Add the event to DURABLE_FLOW["EVENTS"] or fix the cancel_on event name (docs/events.md).',
    "E040": "Add the entry to settings.RQ_QUEUES (its URL names the Redis) or route the queue to one that is "
    "there (docs/deployment.md, Several Redis servers for rq).",
    "W041": 'Declare the queue in DURABLE_FLOW["QUEUES"] or fix the name: a step of a queue no route names goes '
    "on QUEUE's Redis.",
    "E042": "Rename the RQ_QUEUES entry: a lane's tiers are '<entry>:high' and '<entry>:low', so no other lane "
    "may be named so.",
    "E043": "Point the tier's RQ_QUEUES entry at the same Redis as its lane, or drop it (a tier not listed "
    "is built on its lane's connection).",
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
    except StartTimeoutMisconfigured as exc:
        return [_error(str(exc), "E016")]
    except EventsMisconfigured as exc:
        return [_error(str(exc), "E020")]
    except ImproperlyConfigured as exc:
        return [_error(str(exc), "E001")]
    errors: list[checks.CheckMessage] = _undeclared_events(config)
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
                errors.append(_error(str(exc), getattr(exc, "check_id", options_id)))
            else:
                errors.extend(_undeclarable(cls, spec.options) if key == "ADMISSION" else [])
                if key == "TRANSPORT":
                    errors.extend(_deployment_problems(cls, spec.options, [q.name for q in config.queues]))
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


def _deployment_problems(cls: Any, options: Any, declared_queues: list[str]) -> list[checks.CheckMessage]:
    """What the transport finds wrong with where its work goes (`Transport.deployment_problems`)."""
    found = cls.deployment_problems(options, declared_queues) if hasattr(cls, "deployment_problems") else []
    level = {"E": checks.Error, "W": checks.Warning}
    return [
        level[check_id[0]](message, hint=HINTS[check_id], id=f"durable_flow.{check_id}") for check_id, message in found
    ]


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


def _undeclarable(cls: type, options: Any) -> list[checks.CheckMessage]:
    """The admission backend's word on the declarations it could not keep (E030)."""
    problems = getattr(cls, "declaration_problems", None)
    if problems is None:
        return []
    return [
        _error(f'DURABLE_FLOW["ADMISSION"]: {message}', "E030") for message in problems(options, workflows().values())
    ]


def _unenforced_step_concurrency() -> list[checks.CheckMessage]:

    declaring = sorted(name for name, definition in workflows().items() if definition.concurrency)
    if not declaring:
        return []
    message = (
        f'DURABLE_FLOW["ADMISSION"] cannot enforce step concurrency, declared by {", ".join(declaring[:5])}'
        f"{' and others' if len(declaring) > 5 else ''}: starting those runs will fail"
    )
    return [checks.Warning(message, hint=HINTS["W001"], id="durable_flow.W001")]


def _undeclared_events(config: DurableFlowSettings) -> list[checks.CheckMessage]:
    """A trigger or a `cancel_on` naming an event `EVENTS` does not declare: it would never fire."""
    errors = []
    for name, definition in sorted(workflows().items()):
        for trigger in definition.triggers:
            if trigger.event not in config.events:
                message = f'workflow {name!r}: trigger {trigger.event!r} is not declared in DURABLE_FLOW["EVENTS"]'
                errors.append(_error(message, "E021"))
        for cancel in definition.cancel_on:
            if cancel.event not in config.events:
                message = (
                    f'workflow {name!r}: cancel_on event {cancel.event!r} is not declared in DURABLE_FLOW["EVENTS"]'
                )
                errors.append(_error(message, "E023"))
    return errors
