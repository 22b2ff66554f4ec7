from django.urls import path

from . import bulk_views, event_views, flow_views, limit_views, run_views, schedule_views, views

app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("dashboard/snapshot.json", views.snapshot_json, name="snapshot"),
    path("dashboard/runs/", run_views.runs, name="runs"),
    path("dashboard/runs/start/", run_views.start, name="start"),
    path("dashboard/runs/bulk/<str:action>/", bulk_views.bulk, name="bulk"),
    path("dashboard/runs/<path:run_id>/cancel/", run_views.cancel, name="cancel"),
    path("dashboard/runs/<path:run_id>/retry/", run_views.retry, name="retry"),
    path("dashboard/runs/<path:run_id>/rerun/", run_views.rerun, name="rerun"),
    path("dashboard/runs/<path:run_id>/signal/", run_views.signal, name="signal"),
    path("dashboard/runs/<path:run_id>/", run_views.run_detail, name="run"),
    path("dashboard/flow/", flow_views.flow, name="flow"),
    path("dashboard/flow.json", flow_views.flow_json, name="flow_json"),
    path("dashboard/flow/burst/", flow_views.burst, name="burst"),
    path("dashboard/session/", views.session_check, name="session"),
    path("dashboard/queues/", views.queues, name="queues"),
    path("dashboard/queues/<path:name>/pause/", views.queue_pause, name="queue-pause"),
    path("dashboard/queues/<path:name>/resume/", views.queue_resume, name="queue-resume"),
    path("dashboard/queues/<path:name>/resize/", views.queue_resize, name="queue-resize"),
    path("dashboard/queues/<path:name>/", views.queue_detail, name="queue"),
    path("dashboard/workers/", views.workers, name="workers"),
    path("dashboard/schedules/", schedule_views.schedules, name="schedules"),
    path("dashboard/schedules/<path:workflow>/pause/", schedule_views.schedule_pause, name="schedule-pause"),
    path("dashboard/schedules/<path:workflow>/resume/", schedule_views.schedule_resume, name="schedule-resume"),
    path("dashboard/events/", event_views.events, name="events"),
    path("dashboard/quotas/", limit_views.quotas, name="quotas"),
    path("dashboard/keys/", limit_views.keys, name="keys"),
]
