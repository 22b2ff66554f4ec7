from django.urls import path

from dashboard.consumers import FlowConsumer, LiveConsumer

websocket_urlpatterns = [path("ws/live/", LiveConsumer.as_asgi()), path("ws/flow/", FlowConsumer.as_asgi())]
