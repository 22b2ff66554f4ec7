"""App configuration: validate settings, import workflow modules, register queues."""

from __future__ import annotations

import importlib

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import request_finished
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate

from durable_flow import checks  # noqa: F401  (registers the system checks)
from durable_flow.config.settings import get_settings


class DurableFlowConfig(AppConfig):
    name = "durable_flow"
    verbose_name = "Durable flow"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Fail at startup, naming the setting, rather than at the first run. Every new database
        connection gets dumpers for the app's choices (`durable_flow.store.pg_adapters`); every
        request's end writes the metric counts it made (`durable_flow.contrib.metrics`)."""
        # These import the models, which this module (loaded before them) may not.
        from durable_flow.contrib import metrics, task_runner  # noqa: F401  (task_runner: the tasks backend's workflow)
        from durable_flow.store.pg_adapters import register_choice_dumpers
        from durable_flow.store.queues import persist_configured_queues

        connection_created.connect(register_choice_dumpers, dispatch_uid="durable_flow.store.pg_adapters")
        # A web process writes the metric counts its requests made at each request's end.
        request_finished.connect(metrics.flush_after_request, dispatch_uid="durable_flow.contrib.metrics")
        try:
            config = get_settings()
        except ImproperlyConfigured:
            # Reported as durable_flow.E001 by the system checks, which Django runs before every
            # management command (worker, poller, runserver, migrate) and `manage.py check`;
            # the engine raises the same error again on first use.
            return
        for module in config.workflows:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ImproperlyConfigured(f'DURABLE_FLOW["WORKFLOWS"]: cannot import {module!r}: {exc}') from exc

        post_migrate.connect(persist_configured_queues, sender=self)
