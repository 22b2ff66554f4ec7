from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "durable_flow dashboard"

    def ready(self) -> None:
        from dashboard import checks  # noqa: F401 - registers the dashboard's system checks
