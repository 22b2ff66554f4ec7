"""Production: PostgreSQL from DATABASE_URL, Redis from REDIS_URL, RQ transport, Redis admission."""

from __future__ import annotations

import os

import dj_database_url

from settings.base import *  # noqa: F403

DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

DATABASES = {
    "default": dj_database_url.config(
        env="DATABASE_URL",
        default="postgres://postgres@127.0.0.1:5432/durable_flow",
        conn_max_age=60,
        conn_health_checks=True,
    )
}

CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}}

# The durable queue and its priority tiers (listed so django-rq's dashboard shows them).
RQ_QUEUES = {
    "durable": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600},
    "durable:high": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600},
    "durable:low": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600},
    "default": {"URL": REDIS_URL},
}

TRANSPORT = os.environ.get("DURABLE_FLOW_TRANSPORT", "rq")
_concurrency = os.environ.get("DURABLE_FLOW_CONCURRENCY", "adaptive")
CONCURRENCY: int | str = int(_concurrency) if _concurrency.isdigit() else _concurrency
ADMISSION = os.environ.get("DURABLE_FLOW_ADMISSION", "redis")

DURABLE_FLOW = {
    "WORKFLOWS": [m for m in os.environ.get("DURABLE_FLOW_WORKFLOWS", "examples.workflows").split(",") if m],
    "QUEUES": [],
    "ADMISSION": {"BACKEND": ADMISSION, "CONNECTION": "durable"} if ADMISSION == "redis" else {"BACKEND": ADMISSION},
    "TRANSPORT": (
        {"BACKEND": "rq", "QUEUE": "durable", "CONCURRENCY": CONCURRENCY}
        if TRANSPORT == "rq"
        else {"BACKEND": TRANSPORT, "CONCURRENCY": CONCURRENCY}
    ),
    # Prometheus scrapes /metrics/ with this bearer token; unset, only staff sessions may read it.
    "METRICS": {"TOKEN": os.environ.get("DURABLE_FLOW_METRICS_TOKEN") or None},
}
