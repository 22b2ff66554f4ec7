"""System checks for the dashboard's wiring, which lives in the host project's settings.

- `durable_flow_dashboard.E001`: no `default` channel layer (`CHANNEL_LAYERS`): the pages'
  live updates are never sent;
- `durable_flow_dashboard.E002`: `ASGI_APPLICATION` does not route WebSockets through Channels,
  so the pages' live socket is refused;
- `durable_flow_dashboard.E003`: the dashboard's templates are not found (HTTP 500 on every page);
- `durable_flow_dashboard.E004`: the dashboard's URLs are not included in `ROOT_URLCONF`;
- `durable_flow_dashboard.E005`: `DASHBOARD_BURST` is malformed (not a dict, an unknown key, a
  name the database cannot store, a `SIZE` that is no whole number from 1 to `MAX_BURST`, an
  `INPUT` that is no dict): the flow view's burst button would answer 400.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from durable_flow.checks import missing_templates

from .flow import MAX_BURST, burst_problem

HINTS = {
    "E001": 'Set CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}: each web '
    "process feeds its own tabs, so the in-memory layer serves one or many (docs/add-to-your-project.md).",
    "E002": 'Set ASGI_APPLICATION to a channels ProtocolTypeRouter with a "websocket" route to '
    "durable_flow_dashboard.routing.websocket_urlpatterns (the asgi.py of docs/add-to-your-project.md).",
    "E003": 'Set "APP_DIRS": True on the DjangoTemplates backend in TEMPLATES (or list the app directories loader).',
    "E004": 'Add path("", include("durable_flow_dashboard.urls")) to the project URLs (docs/add-to-your-project.md).',
    "E005": f'DASHBOARD_BURST is {{"WORKFLOW": <workflow name>, "QUEUE": <queue name>, "SIZE": 1 to {MAX_BURST}, '
    '"INPUT": {...}}, each key optional (see docs/dashboard-and-admin.md, the flow view); NaN, infinities and '
    "True/False are refused.",
}

# The page every other dashboard page extends.
BASE_TEMPLATE = "dashboard/base.html"


def _error(message: str, check_id: str) -> checks.Error:
    return checks.Error(message, hint=HINTS[check_id], id=f"durable_flow_dashboard.{check_id}")


def check_channel_layer(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    from django.conf import settings

    layers = getattr(settings, "CHANNEL_LAYERS", None)
    if isinstance(layers, dict) and isinstance(layers.get("default"), dict) and layers["default"].get("BACKEND"):
        return []
    return [_error("CHANNEL_LAYERS has no 'default' layer: the dashboard's live updates are never sent", "E001")]


def check_websocket_routing(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Imports `ASGI_APPLICATION` (as daphne and `runserver` do) and looks for a WebSocket route."""
    from channels.routing import ProtocolTypeRouter
    from django.conf import settings
    from django.utils.module_loading import import_string

    path = getattr(settings, "ASGI_APPLICATION", None)
    if not path:
        return [_error("ASGI_APPLICATION is not set: the dashboard's live socket needs Channels' routing", "E002")]
    try:
        application = import_string(path)
    except ImportError as exc:
        return [_error(f"ASGI_APPLICATION {path!r} cannot be imported: {exc}", "E002")]
    if isinstance(application, ProtocolTypeRouter) and "websocket" in application.application_mapping:
        return []
    return [_error(f"ASGI_APPLICATION {path!r} does not route WebSockets through Channels", "E002")]


def check_templates(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:

    return [_error(message, "E003") for message in missing_templates([BASE_TEMPLATE])]


def check_urls(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    from django.urls import NoReverseMatch, reverse

    try:
        reverse("dashboard:index")
    except NoReverseMatch:
        return [_error("the dashboard's URLs are not included: no URL named 'dashboard:index'", "E004")]
    return []


def check_burst(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check `DASHBOARD_BURST`, which the flow view's burst button reads."""
    from django.conf import settings

    problem = burst_problem(getattr(settings, "DASHBOARD_BURST", {}))
    return [_error(problem, "E005")] if problem else []


def register() -> None:
    """Called from `DashboardConfig.ready`."""
    checks.register(check_channel_layer, "durable_flow_dashboard")
    checks.register(check_websocket_routing, "durable_flow_dashboard")
    checks.register(check_templates, checks.Tags.templates)
    checks.register(check_urls, checks.Tags.urls)
    checks.register(check_burst, "durable_flow_dashboard")
