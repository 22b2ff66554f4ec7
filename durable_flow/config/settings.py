"""`settings.DURABLE_FLOW`, parsed and validated once into a frozen value.

Every error is an `ImproperlyConfigured` that names the offending key, e.g.
`DURABLE_FLOW["POLLER"]: BATCH_SIZE must be an integer from 1 to 10000, got 0`. Every number
goes through `validation.number_problem`: a bool, NaN or an infinity is never a number, and
each has a finite maximum (documented in docs/settings.md), so a value that
passes `manage.py check` cannot overflow a `timedelta`, a column or a sleep later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from durable_flow.config.queues import QueueConfig
from durable_flow.config.validation import DAY_S, HOUR_S, WEEK_S, number_problem
from durable_flow.exceptions import InvalidQueueConfig

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
TOP_LEVEL_KEYS = {
    "WORKFLOWS",
    "QUEUES",
    "ADMISSION",
    "TRANSPORT",
    "POLLER",
    "HEARTBEAT",
    "MAX_PAYLOAD_BYTES",
    "REDISPATCH_AFTER_S",
    "METRICS",
    "ENVIRONMENT",
}


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
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 15.0
    max_payload_bytes: int = 1_000_000
    redispatch_after_s: float = 600.0
    metrics_token: str | None = None
    metrics_window_s: float = 300.0
    #: Names the `env` scope of step concurrency (`sc:env:<environment>:<key>`).
    environment: str = "default"


def _fail(key: str, message: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f'DURABLE_FLOW["{key}"]: {message}')


def _refuse(where: str, key: str, problem: str) -> ImproperlyConfigured:
    """`DURABLE_FLOW["POLLER"]: BATCH_SIZE must be ...`, or `DURABLE_FLOW["MAX_PAYLOAD_BYTES"]: must
    be ...` for a top-level key (`where` empty)."""
    return _fail(where, f"{key} {problem}") if where else _fail(key, problem)


def _seconds(raw: Mapping[str, Any], key: str, default: float, where: str, maximum: float) -> float:
    """A duration above 0 s and at most `maximum` s."""
    value = raw.get(key, default)
    problem = number_problem(value, minimum=0, maximum=maximum, above_minimum=True, unit="seconds")
    if problem:
        raise _refuse(where, key, problem)
    return value


def _number(
    raw: Mapping[str, Any], key: str, default: float, where: str, *, minimum: float, maximum: float, **kind: Any
) -> Any:
    """`raw[key]` (or the default) within [minimum, maximum], else `ImproperlyConfigured`."""
    value = raw.get(key, default)
    problem = number_problem(value, minimum=minimum, maximum=maximum, **kind)
    if problem:
        raise _refuse(where, key, problem)
    return value


def _known_keys(raw: Mapping[str, Any], where: str, known: tuple[str, ...]) -> None:
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise _fail(where, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")


def _backend(raw: object, key: str, aliases: Mapping[str, str], default: str) -> BackendSpec:
    if raw is None:
        raw = {"BACKEND": default}
    if isinstance(raw, str):
        raw = {"BACKEND": raw}
    if not isinstance(raw, Mapping):
        raise _fail(key, f'expected a dict like {{"BACKEND": "{default}"}}, got {type(raw).__name__}')
    name = raw.get("BACKEND", default)
    if not isinstance(name, str) or not name:
        raise _fail(key, "BACKEND must be a backend name or a dotted class path")
    if name not in aliases and "." not in name:
        raise _fail(key, f"unknown BACKEND {name!r}; choose one of {', '.join(aliases)} or give a dotted path")
    options = {k: v for k, v in raw.items() if k != "BACKEND"}
    return BackendSpec(path=aliases.get(name, name), options=options, alias=name)


class SamplingMisconfigured(ImproperlyConfigured):
    """POLLER's SAMPLE_INTERVAL_S / SAMPLE_RETENTION_S are wrong (`manage.py check`: E006)."""


def parse_sampling(poller: Mapping[str, Any]) -> tuple[float, float]:
    """The dashboard's sampling interval and retention, in seconds.

    From 1 s to an hour between samples (each one is a row per queue and live worker; the charts
    show the last hour), and a retention from one hour (the charts' span) to a year.
    """
    values: list[float] = []
    for key, default, least, most in (
        ("SAMPLE_INTERVAL_S", 10.0, 1, HOUR_S),
        ("SAMPLE_RETENTION_S", 86_400.0, HOUR_S, 365 * DAY_S),
    ):
        value = poller.get(key, default)
        problem = number_problem(value, minimum=least, maximum=most, unit="seconds")
        if problem:
            raise SamplingMisconfigured(f'DURABLE_FLOW["POLLER"]: {key} {problem}')
        values.append(float(value))
    return values[0], values[1]


def parse_settings(raw: object) -> DurableFlowSettings:
    """Validate a `DURABLE_FLOW` dict; raise `ImproperlyConfigured` naming the bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"DURABLE_FLOW must be a dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - TOP_LEVEL_KEYS)
    if unknown:
        raise ImproperlyConfigured(f"DURABLE_FLOW: unknown key(s) {', '.join(unknown)}")

    workflows = raw.get("WORKFLOWS", [])
    if isinstance(workflows, str) or not isinstance(workflows, list | tuple):
        raise _fail("WORKFLOWS", "must be a list of module paths")
    for module in workflows:
        if not isinstance(module, str) or not module:
            raise _fail("WORKFLOWS", f"every entry must be a module path string, got {module!r}")

    queues_raw = raw.get("QUEUES", [])
    if not isinstance(queues_raw, list | tuple):
        raise _fail("QUEUES", "must be a list of queue dicts")
    queues: list[QueueConfig] = []
    seen: set[str] = set()
    for index, entry in enumerate(queues_raw):
        try:
            config = QueueConfig.from_mapping(entry, where=f'DURABLE_FLOW["QUEUES"][{index}]')
        except InvalidQueueConfig as exc:
            raise ImproperlyConfigured(str(exc)) from exc
        if config.name in seen:
            raise _fail("QUEUES", f"queue {config.name!r} is declared twice (entry {index})")
        seen.add(config.name)
        queues.append(config)

    poller = raw.get("POLLER", {})
    heartbeat = raw.get("HEARTBEAT", {})
    for key, value in (("POLLER", poller), ("HEARTBEAT", heartbeat)):
        if not isinstance(value, Mapping):
            raise _fail(key, "must be a dict")
    _known_keys(
        poller, "POLLER", ("INTERVAL_MS", "BATCH_SIZE", "MAINTENANCE_S", "SAMPLE_INTERVAL_S", "SAMPLE_RETENTION_S")
    )
    sample_interval, sample_retention = parse_sampling(poller)
    _known_keys(heartbeat, "HEARTBEAT", ("INTERVAL_S", "TTL_S"))
    heartbeat_interval = _seconds(heartbeat, "INTERVAL_S", 2.0, "HEARTBEAT", HOUR_S)
    heartbeat_ttl = _seconds(heartbeat, "TTL_S", 15.0, "HEARTBEAT", DAY_S)
    if heartbeat_ttl <= heartbeat_interval:
        # A worker would be declared dead between two of its own beats.
        raise _fail("HEARTBEAT", f"TTL_S ({heartbeat_ttl}) must be greater than INTERVAL_S ({heartbeat_interval})")
    poller_interval = _number(
        poller, "INTERVAL_MS", 500, "POLLER", minimum=1, maximum=MAX_POLLER_INTERVAL_MS, unit="milliseconds"
    )
    max_payload = _number(raw, "MAX_PAYLOAD_BYTES", 1_000_000, "", minimum=1, maximum=2**30, integer=True, unit="bytes")
    redispatch = _seconds(raw, "REDISPATCH_AFTER_S", 600, "", WEEK_S)

    metrics = raw.get("METRICS", {})
    if not isinstance(metrics, Mapping):
        raise _fail("METRICS", "must be a dict")
    unknown_metrics = sorted(set(metrics) - {"TOKEN", "WINDOW_S"})
    if unknown_metrics:
        raise _fail("METRICS", f"unknown option(s) {', '.join(unknown_metrics)}")
    token = metrics.get("TOKEN")
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise _fail("METRICS", "TOKEN must be a string of at least 16 characters (or None)")

    environment = raw.get("ENVIRONMENT", "default")
    if not isinstance(environment, str) or not environment or len(environment) > 100 or ":" in environment:
        raise _fail(
            "ENVIRONMENT", f"must be a non-empty string of at most 100 characters without ':', got {environment!r}"
        )

    return DurableFlowSettings(
        workflows=tuple(workflows),
        queues=tuple(queues),
        admission=_backend(raw.get("ADMISSION"), "ADMISSION", ADMISSION_BACKENDS, "local"),
        transport=_backend(raw.get("TRANSPORT"), "TRANSPORT", TRANSPORT_BACKENDS, "inline"),
        poller_interval_ms=int(poller_interval),
        poller_batch_size=_number(
            poller, "BATCH_SIZE", 500, "POLLER", minimum=1, maximum=MAX_POLLER_BATCH_SIZE, integer=True
        ),
        poller_maintenance_s=float(_seconds(poller, "MAINTENANCE_S", 5.0, "POLLER", HOUR_S)),
        sample_interval_s=sample_interval,
        sample_retention_s=sample_retention,
        heartbeat_interval_s=heartbeat_interval,
        heartbeat_ttl_s=heartbeat_ttl,
        max_payload_bytes=max_payload,
        redispatch_after_s=float(redispatch),
        metrics_token=token,
        metrics_window_s=_seconds(metrics, "WINDOW_S", 300.0, "METRICS", DAY_S),
        environment=environment,
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
