"""Production: every value from the environment (docs/deployment.md lists them).

PostgreSQL from DATABASE_URL, Redis from REDIS_URL, the RQ transport and Redis admission by
default. DJANGO_SECRET_KEY is required. HTTPS is assumed: secure cookies, HSTS and the redirect
to HTTPS are on unless turned off (behind a proxy that terminates TLS, set
DJANGO_SECURE_PROXY_SSL_HEADER=1 so Django sees the original scheme). Static files are served
by WhiteNoise from STATIC_ROOT, filled by `manage.py collectstatic`.
"""

from __future__ import annotations

import os

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from settings.base import *  # noqa: F403
from settings.base import BASE_DIR, MIDDLEWARE


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case); anything else is an error."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be 1 or 0 (true/false), got {raw!r}")


def env_list(name: str, default: str = "") -> list[str]:
    """A comma-separated variable, blanks dropped."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
if not SECRET_KEY:
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY is not set: settings.production needs a long random secret, e.g. from "
        'python -c "from django.core.management.utils import get_random_secret_key as k; print(k())"'
    )
DEBUG = env_flag("DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS")

SECURE_SSL_REDIRECT = env_flag("DJANGO_SECURE_SSL_REDIRECT", True)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_flag("DJANGO_SECURE_COOKIES", True)
SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_SECURE_HSTS_SECONDS", "31536000"))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_flag("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_flag("DJANGO_SECURE_HSTS_PRELOAD", True)
if env_flag("DJANGO_SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# WhiteNoise serves the admin's and the dashboard's files (live.js) under ASGI, DEBUG or not.
STATIC_ROOT = os.environ.get("DJANGO_STATIC_ROOT", str(BASE_DIR / "staticfiles"))
MIDDLEWARE = [
    *MIDDLEWARE[: MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1],
    "whitenoise.middleware.WhiteNoiseMiddleware",
    *MIDDLEWARE[MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1 :],
]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

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
    "WORKFLOWS": env_list("DURABLE_FLOW_WORKFLOWS", "examples.workflows"),
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
