"""The embedded default: SQLite, the `db` transport and `db` admission; no Redis needed."""

from __future__ import annotations

from settings.base import *  # noqa: F403
from settings.base import VAR_DIR, sqlite_database

VAR_DIR.mkdir(parents=True, exist_ok=True)

DATABASES = {"default": sqlite_database(VAR_DIR / "durable_flow.sqlite3")}

CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# django-rq is installed so the admin and `rqworker` are there when you switch to RQ;
# the embedded default never connects to it.
RQ_QUEUES = {"default": {"URL": "redis://127.0.0.1:6379/0"}}
RQ_SHOW_ADMIN_LINK = False  # the db transport uses no RQ queue, so the admin lists none

DURABLE_FLOW = {
    "WORKFLOWS": ["examples.workflows", "examples.exports"],  # exports: step concurrency (db admission)
    "QUEUES": [
        {"name": "shipping-api", "rate_limit": {"limit": 100, "period_ms": 60_000}},
        {"name": "pdf-render", "concurrency": 5, "retry_ms": 500},
        {"name": "emails", "concurrency": 10, "rate_limit": {"limit": 1000, "period_ms": 3_600_000}},
        {"name": "openai", "rate_limit": {"limit": 100, "period_ms": 60_000, "algorithm": "sliding"}},
        {
            "name": "demo-throttled",
            "concurrency": 2,
            "rate_limit": {"limit": 20, "period_ms": 10_000},
            "fairness": "key",
        },
    ],
    "ADMISSION": {"BACKEND": "db"},
    "TRANSPORT": {"BACKEND": "db", "CONCURRENCY": 4},
}
