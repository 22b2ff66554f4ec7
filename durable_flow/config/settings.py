"""`settings.DURABLE_FLOW`, parsed and validated once into a frozen value.

Every key, the nested `POLLER`, `HEARTBEAT` and `METRICS` ones included, is declared as an
`Option` (`SETTINGS_OPTIONS`) and checked by `options.parse_options`, as the backends' options
are: every error is an `ImproperlyConfigured` that names the key's path, e.g.
`DURABLE_FLOW["POLLER"]["BATCH_SIZE"]: must be an integer from 1 to 10000, got 0`. Every number
goes through `validation.number_problem`: a bool, NaN or an infinity is never a number, and
each has a finite maximum (documented in docs/settings.md), so a value that
passes `manage.py check` cannot overflow a `timedelta`, a column or a sleep later.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from durable_flow.config.limits import EVENT_NAME_LENGTH
from durable_flow.config.options import (
    Option,
    Refusal,
    Validator,
    list_of,
    non_empty_str,
    number,
    optional,
    parse_options,
    seconds,
    table,
    text,
)
from durable_flow.config.queues import QueueConfig
from durable_flow.config.validation import DAY_S, HOUR_S, MAX_DURATION, WEEK_S, event_name_problem
from durable_flow.exceptions import InvalidQueueConfig, InvalidStartTimeout

ADMISSION_BACKENDS = {
    "local": "durable_flow.admission.local.LocalAdmissionBackend",
    "db": "durable_flow.admission.db.backend.DatabaseAdmissionBackend",
    "redis": "durable_flow.admission.redis.backend.RedisAdmissionBackend",
}
TRANSPORT_BACKENDS = {
    "inline": "durable_flow.transports.inline.InlineTransport",
    "db": "durable_flow.transports.db.transport.DatabaseTransport",
    "rq": "durable_flow.transports.rq.RQTransport",
}
#: The poller's longest sleep between ticks, and the most runs it wakes in one tick (one
#: transaction): the bounds of POLLER's INTERVAL_MS and BATCH_SIZE and of the command's flags.
MAX_POLLER_INTERVAL_MS = HOUR_S * 1000
MAX_POLLER_BATCH_SIZE = 10_000
#: The bounds of POLLER's VACUUM_DEAD_ROWS: below a thousand dead rows a vacuum costs more than
#: it saves; past a billion it would never come.
MIN_VACUUM_DEAD_ROWS, MAX_VACUUM_DEAD_ROWS = 1_000, 1_000_000_000
#: The longest a finished run may be kept before retention deletes it: ten years
#: (`validation.MAX_DURATION`), so `now - retention` never leaves `datetime`'s range.
MAX_RUN_RETENTION_S = MAX_DURATION.total_seconds()
#: The most runs one retention transaction deletes, and the most transactions one poller pass takes.
MAX_PURGE_BATCH_SIZE = 10_000
MAX_PURGE_BATCHES = 1000
#: The longest a poller pass may spend purging (POLLER's PURGE_PASS_S): a minute.
MAX_PURGE_PASS_S = 60.0


@dataclass(frozen=True)
class BackendSpec:
    """A pluggable backend: a dotted class path and the options passed to it."""

    path: str
    options: Mapping[str, Any] = field(default_factory=dict)
    alias: str = ""


@dataclass(frozen=True)
class DurableFlowSettings:
    """The validated `DURABLE_FLOW` setting."""

    workflows: tuple[str, ...] = ()
    queues: tuple[QueueConfig, ...] = ()
    admission: BackendSpec = BackendSpec(ADMISSION_BACKENDS["local"], alias="local")
    transport: BackendSpec = BackendSpec(TRANSPORT_BACKENDS["inline"], alias="inline")
    poller_interval_ms: int = 500
    poller_batch_size: int = 500
    #: How often the poller looks for dead workers' steps and jobs (its maintenance pass).
    poller_maintenance_s: float = 5.0
    #: How often the poller writes a QueueSample per queue (and a WorkerSample per live worker).
    sample_interval_s: float = 10.0
    #: How long samples are kept; older ones are pruned by the poller.
    sample_retention_s: float = 86_400.0
    #: How long refused starts (`StartRefusal`, `QuotaRefusal`) are kept; the poller deletes older ones.
    refusal_retention_s: float = 7 * 86_400.0
    #: The poller vacuums a hot table (PostgreSQL) once its dead rows pass this many plus
    #: `vacuum_dead_fraction` of its live rows; None: never (leave it to autovacuum).
    vacuum_dead_rows: int | None = 2_000
    vacuum_dead_fraction: float = 0.05
    #: The shortest time between two of the poller's vacuums of one table.
    vacuum_min_interval_s: float = 10.0
    #: How long a finished run is kept (with its checkpoints, attempts and signals) before the
    #: poller deletes it; None keeps every run (a workflow's own `retention` still applies).
    run_retention_s: float | None = None
    #: Runs deleted per transaction by retention, and transactions per poller pass.
    purge_batch_size: int = 500
    purge_batches: int = 10
    #: The time a poller pass may spend purging: it stops after the batch that reaches it.
    purge_pass_s: float = 0.5
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 15.0
    max_payload_bytes: int = 1_000_000
    redispatch_after_s: float = 600.0
    metrics_token: str | None = None
    #: Names the `env` scope of step concurrency (`sc:env:<environment>:<key>`).
    environment: str = "default"
    #: The event names this project sends, triggers on and waits for (docs/events.md).
    events: frozenset[str] = frozenset()


class SamplingMisconfigured(ImproperlyConfigured):
    """POLLER's SAMPLE_INTERVAL_S / SAMPLE_RETENTION_S are wrong (`manage.py check`: E006)."""


class RefusalRetentionMisconfigured(ImproperlyConfigured):
    """POLLER's REFUSAL_RETENTION_S is wrong (`manage.py check`: E009)."""


class RoutesMisconfigured(ImproperlyConfigured):
    """The `rq` transport's `ROUTES` cannot be kept (`manage.py check`: `check_id`, E040 to E049)."""

    def __init__(self, message: str, check_id: str) -> None:
        super().__init__(message)
        self.check_id = check_id


class VacuumMisconfigured(ImproperlyConfigured):
    """POLLER's VACUUM_DEAD_ROWS / VACUUM_DEAD_FRACTION / VACUUM_MIN_INTERVAL_S are wrong
    (`manage.py check`: E014)."""


class EventsMisconfigured(ImproperlyConfigured):
    """EVENTS is not a list of event names, each once (`manage.py check`: E020)."""


class RunRetentionMisconfigured(ImproperlyConfigured):
    """POLLER's RUN_RETENTION_S, PURGE_BATCH_SIZE, PURGE_BATCHES or PURGE_PASS_S is wrong
    (`manage.py check`: E015)."""


class StartTimeoutMisconfigured(ImproperlyConfigured):
    """A queue's `start_timeout_s` or `on_start_timeout` in QUEUES is wrong (`manage.py check`: E016)."""


def backend(aliases: Mapping[str, str]) -> Validator:
    """`ADMISSION` / `TRANSPORT`: an alias, a dotted class path, or a dict with `BACKEND` (one of
    those) and the backend's options, which the backend class checks itself (`E004`/`E005`)."""
    default = next(iter(aliases))

    def validate(value: Any) -> str | None:
        value = _backend_dict(value, default)
        if not isinstance(value, Mapping):
            return f'must be a dict like {{"BACKEND": "{default}"}}, got {type(value).__name__}'
        name = value.get("BACKEND", default)
        if not isinstance(name, str) or (name not in aliases and "." not in name):
            return f'["BACKEND"]: must be one of {", ".join(aliases)} or a dotted class path, got {reprlib.repr(name)}'
        return None

    return validate


def _backend_spec(raw: object, aliases: Mapping[str, str]) -> BackendSpec:
    """The `BackendSpec` of a value `backend(aliases)` took."""
    default = next(iter(aliases))
    raw = _backend_dict(raw, default)
    assert isinstance(raw, Mapping)
    name = raw.get("BACKEND", default)
    options = {k: v for k, v in raw.items() if k != "BACKEND"}
    return BackendSpec(path=aliases.get(name, name), options=options, alias=name)


def _backend_dict(value: object, default: str) -> object:
    """The dict form of a backend's setting: None is the default backend, a string its `BACKEND`."""
    if value is None:
        return {"BACKEND": default}
    return {"BACKEND": value} if isinstance(value, str) else value


def _queues(value: Any) -> str | None:
    """A list of queue dicts (`QueueConfig.from_mapping`), each name once."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        return f"must be a list of queue dicts, got {type(value).__name__}"
    seen: set[str] = set()
    for index, entry in enumerate(value):
        try:
            name = QueueConfig.from_mapping(entry, where=f"[{index}]").name
        except InvalidStartTimeout as exc:
            return Refusal(str(exc), StartTimeoutMisconfigured)
        except InvalidQueueConfig as exc:
            return str(exc)
        if name in seen:
            return f"queue {name!r} is declared twice (entry {index})"
        seen.add(name)
    return None


def _events(value: Any) -> str | None:
    """A list of event names (`validation.event_name_problem`), each once."""
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        return f"must be a list of event names, got {reprlib.repr(value)}"
    seen: set[str] = set()
    for index, name in enumerate(value):
        if problem := event_name_problem(name, EVENT_NAME_LENGTH):
            return f"[{index}]: {problem}"
        if name in seen:
            return f"event {name!r} is declared twice (entry {index})"
        seen.add(name)
    return None


POLLER_OPTIONS = {
    "INTERVAL_MS": Option(
        "The poller's longest sleep between ticks, and the pace of its grants and schedules (ms); a run "
        "due sooner wakes it at its wake time.",
        number(1, MAX_POLLER_INTERVAL_MS, unit="milliseconds"),
    ),
    "BATCH_SIZE": Option(
        "The most runs the poller wakes in one tick (one transaction).",
        number(1, MAX_POLLER_BATCH_SIZE, integer=True),
    ),
    "MAINTENANCE_S": Option("How often the poller looks for dead workers' steps and jobs.", seconds(HOUR_S)),
    # From 1 s to an hour between samples (each one is a row per queue and live worker; the
    # charts show the last hour), and a retention from one hour (the charts' span) to a year.
    "SAMPLE_INTERVAL_S": Option(
        "How often the poller writes the dashboard's samples.",
        number(1, HOUR_S, unit="seconds"),
        SamplingMisconfigured,
    ),
    "SAMPLE_RETENTION_S": Option(
        "How long samples are kept.", number(HOUR_S, 365 * DAY_S, unit="seconds"), SamplingMisconfigured
    ),
    # From an hour (the quota page's chart) to a year.
    "REFUSAL_RETENTION_S": Option(
        "How long refused starts are kept (the quota page's history).",
        number(HOUR_S, 365 * DAY_S, unit="seconds"),
        RefusalRetentionMisconfigured,
    ),
    # The poller's vacuum of the hot tables (PostgreSQL; durable_flow/runtime/vacuum.py).
    "VACUUM_DEAD_ROWS": Option(
        "Dead rows past which the poller vacuums a hot table (None: never).",
        optional(number(MIN_VACUUM_DEAD_ROWS, MAX_VACUUM_DEAD_ROWS, integer=True, unit="rows")),
        VacuumMisconfigured,
    ),
    "VACUUM_DEAD_FRACTION": Option(
        "Added to VACUUM_DEAD_ROWS: this fraction of the table's live rows.",
        number(0, 100),
        VacuumMisconfigured,
    ),
    "VACUUM_MIN_INTERVAL_S": Option(
        "The shortest time between two of the poller's vacuums of one table.",
        number(1, DAY_S, unit="seconds"),
        VacuumMisconfigured,
    ),
    # From an hour (a run just finished stays on the pages a while) to ten years; None: forever.
    "RUN_RETENTION_S": Option(
        "How long a finished run is kept before the poller deletes it (None: kept forever).",
        optional(number(HOUR_S, MAX_RUN_RETENTION_S, unit="seconds")),
        RunRetentionMisconfigured,
    ),
    "PURGE_BATCH_SIZE": Option(
        "The most finished runs retention deletes in one transaction.",
        number(1, MAX_PURGE_BATCH_SIZE, integer=True),
        RunRetentionMisconfigured,
    ),
    "PURGE_BATCHES": Option(
        "The most retention transactions in one poller pass.",
        number(1, MAX_PURGE_BATCHES, integer=True),
        RunRetentionMisconfigured,
    ),
    "PURGE_PASS_S": Option(
        "The time a poller pass may spend purging (it stops after the batch that reaches it).",
        number(0, MAX_PURGE_PASS_S, above_minimum=True, unit="seconds"),
        RunRetentionMisconfigured,
    ),
}
HEARTBEAT_OPTIONS = {
    "INTERVAL_S": Option("How often a worker beats.", seconds(HOUR_S)),
    "TTL_S": Option("A worker silent this long is dead; above INTERVAL_S.", seconds(DAY_S)),
}
METRICS_OPTIONS = {
    "TOKEN": Option(
        "The bearer token of /metrics/ (None: staff sessions only).", optional(text(min_length=16, secret=True))
    ),
}
#: Every key of `settings.DURABLE_FLOW` (docs/settings.md).
SETTINGS_OPTIONS = {
    "WORKFLOWS": Option("Modules that declare workflows, imported at startup.", list_of(non_empty_str, "module paths")),
    "QUEUES": Option("Flow-control queues (docs/flow-control.md).", _queues),
    "ADMISSION": Option("The admission backend and its options.", backend(ADMISSION_BACKENDS)),
    "TRANSPORT": Option("The transport and its options.", backend(TRANSPORT_BACKENDS)),
    "POLLER": Option("The timer poller.", table(POLLER_OPTIONS)),
    "HEARTBEAT": Option("Workers' heartbeats.", table(HEARTBEAT_OPTIONS)),
    "MAX_PAYLOAD_BYTES": Option(
        "The largest input, output or payload, as JSON.", number(1, 2**30, integer=True, unit="bytes")
    ),
    "REDISPATCH_AFTER_S": Option("When a lost step of no known worker is sent again.", seconds(WEEK_S)),
    "METRICS": Option("The /metrics/ endpoint.", table(METRICS_OPTIONS)),
    "ENVIRONMENT": Option("Names the `env` scope of step concurrency.", text(max_length=100, forbidden=":")),
    "EVENTS": Option(
        "The event names sent, triggered on and waited for (docs/events.md).", _events, EventsMisconfigured
    ),
}
#: Where each key of a section lands in `DurableFlowSettings`.
_FIELDS = {
    "poller": {
        "interval_ms": "poller_interval_ms",
        "batch_size": "poller_batch_size",
        "maintenance_s": "poller_maintenance_s",
        "sample_interval_s": "sample_interval_s",
        "sample_retention_s": "sample_retention_s",
        "refusal_retention_s": "refusal_retention_s",
        "vacuum_dead_rows": "vacuum_dead_rows",
        "vacuum_dead_fraction": "vacuum_dead_fraction",
        "vacuum_min_interval_s": "vacuum_min_interval_s",
        "run_retention_s": "run_retention_s",
        "purge_batch_size": "purge_batch_size",
        "purge_batches": "purge_batches",
        "purge_pass_s": "purge_pass_s",
    },
    "heartbeat": {"interval_s": "heartbeat_interval_s", "ttl_s": "heartbeat_ttl_s"},
    "metrics": {"token": "metrics_token"},
}
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "workflows": tuple,
    "events": frozenset,
    "queues": lambda entries: tuple(QueueConfig.from_mapping(entry) for entry in entries),
    "admission": lambda raw: _backend_spec(raw, ADMISSION_BACKENDS),
    "transport": lambda raw: _backend_spec(raw, TRANSPORT_BACKENDS),
    "poller_interval_ms": int,
    "poller_maintenance_s": float,
    "sample_interval_s": float,
    "sample_retention_s": float,
    "refusal_retention_s": float,
    "vacuum_dead_fraction": float,
    "vacuum_min_interval_s": float,
    "run_retention_s": lambda value: None if value is None else float(value),
    "purge_pass_s": float,
    "redispatch_after_s": float,
}


def parse_settings(raw: object) -> DurableFlowSettings:
    """Validate a `DURABLE_FLOW` dict; raise `ImproperlyConfigured` naming the bad key.

    Each key is checked by its `Option` (`parse_options`); the rules across keys come after.
    """
    given = parse_options(SETTINGS_OPTIONS, {} if raw is None else raw, "DURABLE_FLOW")  # type: ignore[arg-type]
    for section, fields in _FIELDS.items():
        given |= {fields[key]: value for key, value in given.pop(section, {}).items()}
    config = DurableFlowSettings(**{key: _CONVERT.get(key, _same)(value) for key, value in given.items()})
    _check_heartbeat(config)
    return config


def _same(value: Any) -> Any:
    return value


def _check_heartbeat(config: DurableFlowSettings) -> None:
    """A worker would be declared dead between two of its own beats."""
    ttl, interval = config.heartbeat_ttl_s, config.heartbeat_interval_s
    if ttl <= interval:
        raise ImproperlyConfigured(
            f'DURABLE_FLOW["HEARTBEAT"]: TTL_S ({ttl}) must be greater than INTERVAL_S ({interval})'
        )


def build_backend(spec: BackendSpec) -> Any:
    """Instantiate a backend class from its settings spec.

    A class with a `from_options(options)` classmethod is built by it; otherwise its
    constructor gets the options as lower-case keyword arguments.
    """
    cls = import_string(spec.path)
    factory = getattr(cls, "from_options", None)
    if factory is not None:
        return factory(dict(spec.options))
    return cls(**{key.lower(): value for key, value in spec.options.items()})


@cache
def get_settings() -> DurableFlowSettings:
    """The project's validated settings (cached; `reset_settings()` after overriding them in tests)."""
    return parse_settings(getattr(settings, "DURABLE_FLOW", {}))


def reset_settings() -> None:
    """Forget the cached settings (used by tests that override `DURABLE_FLOW`)."""
    get_settings.cache_clear()
