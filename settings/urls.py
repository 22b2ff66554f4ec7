"""URLs: the Django admin and the dashboard."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include("durable_flow.urls")),
    path("", include("dashboard.urls")),
]
