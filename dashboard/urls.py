from django.urls import path

from dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("dashboard/snapshot.json", views.snapshot_json, name="snapshot"),
    path("dashboard/session/", views.session_check, name="session"),
    path("dashboard/queues/", views.queues, name="queues"),
    path("dashboard/queues/<path:name>/pause/", views.queue_pause, name="queue-pause"),
    path("dashboard/queues/<path:name>/resume/", views.queue_resume, name="queue-resume"),
    path("dashboard/queues/<path:name>/resize/", views.queue_resize, name="queue-resize"),
    path("dashboard/queues/<path:name>/", views.queue_detail, name="queue"),
    path("dashboard/workers/", views.workers, name="workers"),
]
