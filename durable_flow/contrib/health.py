"""Health of a deployment's three kinds of process, for load balancers and container probes.

- web: `HealthCheckMiddleware` answers `GET /healthz` with 200 when the database answers, 503
  when it does not; it runs before host validation and the HTTPS redirect, so a probe may use
  the container's address over plain HTTP;
- worker: a worker on this host wrote a live heartbeat (`WorkerHeartbeat`, every
  `HEARTBEAT["INTERVAL_S"]`, dead after `HEARTBEAT["TTL_S"]`; `observe.workers.live_workers_on`);
- poller: a poller wrote the dashboard's samples recently: a looping poller writes a
  `QueueSample` row with `queue=""` every `POLLER["SAMPLE_INTERVAL_S"]`, whatever the queues.

`manage.py durable_health [--worker] [--poller]` runs these checks from a shell (exit status 1
when one fails).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from durable_flow.config.settings import get_settings
from durable_flow.observe.history import last_poller_sample

HEALTH_PATH = "/healthz"


def database_error() -> str | None:
    """None when the database answers a query; otherwise why not."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        return f"database unavailable: {exc}".strip()
    return None


def poller_max_age_s() -> float:
    """How old the newest sample may be while a poller runs: the samples' `at` is the last
    interval boundary, so a live poller's newest is under two intervals old; a third allows
    for a slow tick."""
    return 3 * get_settings().sample_interval_s


def poller_error(max_age_s: float | None = None) -> str | None:
    """None when a poller sampled within `max_age_s`; otherwise why it is taken for stopped."""
    max_age = poller_max_age_s() if max_age_s is None else max_age_s
    last = last_poller_sample()
    if last is None:
        return "no poller has run: no sample written (manage.py durable_poller)"
    age = timezone.now() - last
    if age > timedelta(seconds=max_age):
        return f"no poller running: the last sample is {age.total_seconds():.0f} s old (limit {max_age:.0f} s)"
    return None


class HealthCheckMiddleware:
    """Answers `/healthz` first, before any middleware validates the host or redirects to HTTPS."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path_info != HEALTH_PATH or request.method not in ("GET", "HEAD"):
            return self.get_response(request)
        # The reason stays in the logs of whoever runs the check: the probe may be public.
        if database_error() is not None:
            return JsonResponse({"status": "unavailable", "database": "unavailable"}, status=503)
        return JsonResponse({"status": "ok", "database": "ok"})
