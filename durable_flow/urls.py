"""Include under a prefix: `path("api/", include("durable_flow.urls"))`."""

from django.urls import path, re_path

from durable_flow.contrib import views

app_name = "durable_flow"
urlpatterns = [
    path("runs/", views.start_run, name="start"),
    path("runs/<path:run_id>/cancel/", views.cancel_run, name="cancel"),
    path("runs/<path:run_id>/retry/", views.retry_run, name="retry"),
    path("runs/<path:run_id>/rerun/", views.rerun_run, name="rerun"),
    path("runs/<path:run_id>/signals/", views.send_signal, name="signal"),
    path("runs/<path:run_id>/", views.run_detail, name="detail"),
    # Not under runs/: a run may be named "bulk".
    re_path(r"^bulk/(?P<action>cancel|retry)/$", views.bulk_operation, name="bulk"),
    re_path(r"^queues/(?P<name>[^/]+)/(?P<operation>pause|resume|update)/$", views.steer_queue, name="steer_queue"),
]
