from django.apps import AppConfig


class DashboardConfig(AppConfig):
    # Its folder is `dashboard/`; its import name and label are `durable_flow_dashboard`, so a
    # host project's own `dashboard` app never clashes with it. The app has no models.
    name = "durable_flow_dashboard"
    label = "durable_flow_dashboard"
    verbose_name = "durable_flow dashboard"

    def ready(self) -> None:
        from . import checks  # its checks read the models, which load after this module

        checks.register()
