"""Settings shared by every variant of the durable_flow project."""

from __future__ import annotations

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DURABLE_FLOW_VAR_DIR", BASE_DIR / "var"))

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "insecure-dev-key-change-me-in-production")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_rq",
    "channels",
    "durable_flow",
    "durable_flow_dashboard",
    # Django's tasks framework: the `django-tasks` backport is an app on 5.2 (its checks, and
    # `override_settings(TASKS=...)`); Django 6 has it built in.
    *(["django_tasks"] if django.VERSION < (6,) else []),
]

MIDDLEWARE = [
    "durable_flow.contrib.health.HealthCheckMiddleware",  # /healthz, before host checks and HTTPS redirects
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "durable_flow.contrib.http.DurableFlowErrorMiddleware",
]

ROOT_URLCONF = "settings.urls"
ASGI_APPLICATION = "settings.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS: list[dict[str, str]] = []
LOGIN_URL = "admin:login"
# Where a login lands when its `next` is missing or unsafe (another site): the dashboard, not
# Django's default /accounts/profile/, which this project does not serve.
LOGIN_REDIRECT_URL = "dashboard:index"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def sqlite_database(path: Path) -> dict[str, object]:
    """A SQLite database tuned for several processes: WAL, and IMMEDIATE write transactions.

    IMMEDIATE makes every `transaction.atomic()` take SQLite's write lock up front, so two
    processes deciding admission or claiming tasks serialise instead of failing with
    "database is locked" half-way through a read-then-write transaction.
    """
    return {
        # Django's backend, its write transactions queued on a file lock across processes.
        "ENGINE": "durable_flow.backends.sqlite3",
        "NAME": path,
        "CONN_MAX_AGE": 60,  # workers close "old" connections around every task
        "OPTIONS": {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        "TEST": {"NAME": path.with_name(path.stem + "-test.sqlite3")},
    }


LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"durable_flow": {"handlers": ["console"], "level": os.environ.get("DURABLE_FLOW_LOG", "INFO")}},
}

# Django's tasks framework (the `django-tasks` backport; `django.tasks` on Django 6) on durable
# runs. An empty QUEUES allows any `queue_name`; a name registered in DURABLE_FLOW["QUEUES"] is
# flow-controlled, any other is not gated.
TASKS = {"default": {"BACKEND": "durable_flow.contrib.tasks.DurableFlowBackend", "QUEUES": []}}
