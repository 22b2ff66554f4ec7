"""Production: PostgreSQL from DATABASE_URL, Redis from REDIS_URL, RQ transport, Redis admission."""

from __future__ import annotations

import os

import dj_database_url

from settings.base import *  # noqa: F403

DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

DATABASES = {
    "default": dj_database_url.config(
        env="DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/durable_flow", conn_max_age=60
    )
}

CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}}

RQ_QUEUES = {
    "durable": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600},
    "default": {"URL": REDIS_URL},
}

DURABLE_FLOW = {
    "WORKFLOWS": [m for m in os.environ.get("DURABLE_FLOW_WORKFLOWS", "examples.workflows").split(",") if m],
    "QUEUES": [],
    "ADMISSION": {"BACKEND": os.environ.get("DURABLE_FLOW_ADMISSION", "db")},
    "TRANSPORT": {"BACKEND": os.environ.get("DURABLE_FLOW_TRANSPORT", "db"), "QUEUE": "durable", "CONCURRENCY": 8},
}
