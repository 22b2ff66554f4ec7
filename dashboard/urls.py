from django.urls import path

from dashboard import flow_views, run_views, views

app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("dashboard/snapshot.json", views.snapshot_json, name="snapshot"),
    path("dashboard/runs/", run_views.runs, name="runs"),
    path("dashboard/runs/start/", run_views.start, name="start"),
    path("dashboard/runs/bulk/<str:action>/", run_views.bulk, name="bulk"),
    path("dashboard/runs/<path:run_id>/cancel/", run_views.cancel, name="cancel"),
    path("dashboard/runs/<path:run_id>/retry/", run_views.retry, name="retry"),
    path("dashboard/runs/<path:run_id>/rerun/", run_views.rerun, name="rerun"),
    path("dashboard/runs/<path:run_id>/signal/", run_views.signal, name="signal"),
    path("dashboard/runs/<path:run_id>/", run_views.run_detail, name="run"),
    path("dashboard/flow/", flow_views.flow, name="flow"),
    path("dashboard/flow.json", flow_views.flow_json, name="flow_json"),
    path("dashboard/flow/burst/", flow_views.burst, name="burst"),
]
