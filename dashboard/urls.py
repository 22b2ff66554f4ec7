from django.urls import path

from dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("dashboard/snapshot.json", views.snapshot_json, name="snapshot"),
]
