# One image for every process of a deployment (docs/deployment.md): the web server (the
# default command), `manage.py durable_worker` and `manage.py durable_poller`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DJANGO_SETTINGS_MODULE=settings.production \
    DJANGO_STATIC_ROOT=/app/staticfiles

WORKDIR /app

# The runtime dependencies and the extras a server deployment uses, at the locked versions; the
# dev tools (pytest, Playwright, matplotlib, ruff) stay out of the image.
COPY pyproject.toml requirements.lock README.md ./
COPY durable_flow ./durable_flow
COPY dashboard ./dashboard
RUN pip install -c requirements.lock ".[rq,redis,channels-redis,postgresql,server]"

# The project around the apps: settings, manage.py and the example workflows.
COPY manage.py ./
COPY settings ./settings
COPY examples ./examples
# Collecting static files imports the settings only: a throwaway key, no database.
RUN DJANGO_SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput \
    && useradd --system --uid 10001 --home-dir /app durable \
    && mkdir -p /app/var && chown durable /app/var
USER durable

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
CMD ["daphne", "--bind", "0.0.0.0", "--port", "8000", "--proxy-headers", "settings.asgi:application"]
