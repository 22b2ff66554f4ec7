"""URLs: the Django admin, the JSON API, Prometheus metrics and the dashboard."""

from django.contrib import admin
from django.urls import include, path

from durable_flow.contrib.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("durable_flow.urls")),
    path("metrics/", metrics_view, name="metrics"),
    path("", include("durable_flow_dashboard.urls")),
]
