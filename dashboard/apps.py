from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    # Not "dashboard": a host project's own app of that name would clash. The app has no models,
    # so the label names no table, content type or permission.
    label = "durable_flow_dashboard"
    verbose_name = "durable_flow dashboard"

    def ready(self) -> None:
        from . import checks  # its checks read the models, which load after this module

        checks.register()
