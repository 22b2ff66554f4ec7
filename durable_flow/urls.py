"""Include under a prefix: `path("api/", include("durable_flow.urls"))`.

Every route is an `Endpoint` (`durable_flow.contrib.api_access`): one handler per method, the
API's authentication and JSON errors around them. The OpenAPI document
(`durable_flow.contrib.openapi`) describes each route and method here, and a test holds them
equal.
"""

from django.urls import path, re_path

from durable_flow.contrib import views
from durable_flow.contrib.api_access import endpoint, not_found
from durable_flow.contrib.openapi import openapi_view

app_name = "durable_flow"
urlpatterns = [
    path("openapi.json", endpoint(GET=openapi_view, public=True), name="openapi"),
    path("runs/", endpoint(GET=views.list_runs, POST=views.start_run), name="runs"),
    path("runs/<path:run_id>/cancel/", endpoint(POST=views.cancel_run), name="cancel"),
    path("runs/<path:run_id>/retry/", endpoint(POST=views.retry_run), name="retry"),
    path("runs/<path:run_id>/rerun/", endpoint(POST=views.rerun_run), name="rerun"),
    path("runs/<path:run_id>/signals/", endpoint(POST=views.send_signal), name="signal"),
    path("runs/<path:run_id>/", endpoint(GET=views.run_detail), name="detail"),
    # Not under runs/: a run may be named "bulk".
    re_path(r"^bulk/(?P<action>cancel|retry)/$", endpoint(POST=views.bulk_operation), name="bulk"),
    path("events/", endpoint(POST=views.send_event), name="events"),
    re_path(
        r"^queues/(?P<name>[^/]+)/(?P<operation>pause|resume|update)/$",
        endpoint(POST=views.steer_queue),
        name="steer_queue",
    ),
    path("schedules/", endpoint(GET=views.list_schedules), name="schedules"),
    re_path(
        r"^schedules/(?P<workflow>.+)/(?P<operation>pause|resume)/$",
        endpoint(POST=views.steer_schedule),
        name="steer_schedule",
    ),
    # Last: any other path under the prefix is a JSON 404, not Django's HTML page.
    re_path(r"^(?P<path>.*)$", not_found, name="not_found"),
]
