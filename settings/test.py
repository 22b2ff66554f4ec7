"""Test settings: SQLite by default; PostgreSQL when DATABASE_URL is set (`make test` runs both)."""

from __future__ import annotations

import os

import dj_database_url
import django

from settings.base import *  # noqa: F403
from settings.base import VAR_DIR, sqlite_database

VAR_DIR.mkdir(parents=True, exist_ok=True)

# DURABLE_FLOW_TEST_ID keeps concurrent test sessions on one machine apart (own database).
TEST_ID = os.environ.get("DURABLE_FLOW_TEST_ID", "main")

if os.environ.get("DATABASE_URL"):
    # Persistent connections, as in production: a worker closes "old" connections around every
    # task, and with CONN_MAX_AGE=0 that would mean a new PostgreSQL backend per task.
    DATABASES = {"default": dj_database_url.config(env="DATABASE_URL", conn_max_age=60, conn_health_checks=True)}
    DATABASES["default"]["TEST"] = {"NAME": f"durable_flow_test_{TEST_ID}"}
else:
    DATABASES = {"default": sqlite_database(VAR_DIR / f"test-{TEST_ID}.sqlite3")}

CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
RQ_QUEUES = {"default": {"URL": REDIS_URL}, "durable": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 600}}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

ADMISSION_BACKEND = os.environ.get("DURABLE_FLOW_ADMISSION", "local")
ADMISSION: dict[str, object] = {"BACKEND": ADMISSION_BACKEND}
if ADMISSION_BACKEND == "redis":
    # A short instance TTL so tests that SIGKILL a process see its slots come back quickly.
    ADMISSION.update(CONNECTION="default", INSTANCE_TTL_MS=3000, KEY_PREFIX=f"df:test:{TEST_ID}")
    if cluster_url := os.environ.get("DURABLE_FLOW_ADMISSION_CLUSTER_URL"):
        # Admission on the test session's Redis Cluster (tests/support/redis_cluster.py), RQ on the
        # plain Redis: the host-loss soak kills a master of the cluster while admissions run.
        del ADMISSION["CONNECTION"]
        ADMISSION.update(URL=cluster_url, CLUSTER=True)
if os.environ.get("DURABLE_FLOW_RECORD_STARTS") == "1" and ADMISSION_BACKEND in ("db", "redis"):
    # Worker processes write every start mark their backend counts to the test's marker file
    # (tests/engine_support.py), so a rate limit is judged by the backend's own instants.
    ADMISSION["BACKEND"] = (
        f"tests.engine_support.Recording{'Database' if ADMISSION_BACKEND == 'db' else 'Redis'}Admission"
    )

TRANSPORT: dict[str, object] = {"BACKEND": os.environ.get("DURABLE_FLOW_TRANSPORT", "inline")}
if TRANSPORT["BACKEND"] == "rq" and os.environ.get("DURABLE_FLOW_EAGER_STEPS") == "0":
    TRANSPORT["EAGER_STEPS"] = False  # every step an RQ job (tests of RQ's registries, bench/transport.py)
if TRANSPORT["BACKEND"] in ("rq", "db") and os.environ.get("DURABLE_FLOW_OPTIMISTIC_FIRST_STEP") in ("0", "1"):
    # On by default (on `rq`, with EAGER_STEPS); "0": a first step written as running before it
    # runs (the locked path: tests of it, bench/transport.py's rq-locked column).
    TRANSPORT["OPTIMISTIC_FIRST_STEP"] = os.environ["DURABLE_FLOW_OPTIMISTIC_FIRST_STEP"] == "1"

if TRANSPORT["BACKEND"] == "db" and os.environ.get("DURABLE_FLOW_POLL_INTERVAL_S"):
    # A long idle poll: only a push (a notification, SQLite's doorbell) wakes an idle claimer in time.
    TRANSPORT["POLL_INTERVAL_S"] = float(os.environ["DURABLE_FLOW_POLL_INTERVAL_S"])

DURABLE_FLOW = {
    "WORKFLOWS": ["tests.workflows", "tests.sc_workflows", "tests.task_functions", "tests.contract_tasks"],
    "QUEUES": [],
    "ADMISSION": ADMISSION,
    "TRANSPORT": TRANSPORT,
    # TTL_S: 10 s, as the soak's: on a loaded machine a starved live worker must not be taken for
    # dead (its steps would re-run with no kill to explain it). Tests that SIGKILL a worker wait
    # for its death to be seen with a timeout well past the TTL instead.
    "HEARTBEAT": {"INTERVAL_S": 0.5, "TTL_S": float(os.environ.get("DURABLE_FLOW_HEARTBEAT_TTL_S", "10"))},
    # The chaos soak (tests/reliability/) shortens the recovery timings to settle sooner; browser
    # tests sample every second to see the charts move (the default is 10 s).
    "REDISPATCH_AFTER_S": float(os.environ.get("DURABLE_FLOW_REDISPATCH_AFTER_S", "600")),
    "POLLER": {
        # A long interval in tests of the poller's timers (only a wake time, or a ring, wakes it early).
        "INTERVAL_MS": int(os.environ.get("DURABLE_FLOW_POLLER_INTERVAL_MS", "100")),
        "MAINTENANCE_S": float(os.environ.get("DURABLE_FLOW_MAINTENANCE_S", "5")),
        "SAMPLE_INTERVAL_S": float(os.environ.get("DURABLE_FLOW_SAMPLE_INTERVAL_S", "10")),
    },
    # The events tests send, trigger on and wait for (tests/integration/test_events.py).
    "EVENTS": [
        "tests/orders.created",
        "tests/orders.paid",
        "tests/orders.cancelled",
        "tests/fanout",
        "tests/http.ping",
    ],
}

# A process test's own workflows, which no other test's poller may see (a schedule's), named by
# the processes it starts.
DURABLE_FLOW["WORKFLOWS"] += [m for m in os.environ.get("DURABLE_FLOW_EXTRA_WORKFLOWS", "").split(",") if m]

# The poller's vacuum of the hot tables: "off" turns it off (bench/sustained.py's baseline arm),
# a number sets its threshold of dead rows; unset, the project's default.
if vacuum_dead_rows := os.environ.get("DURABLE_FLOW_VACUUM_DEAD_ROWS"):
    DURABLE_FLOW["POLLER"]["VACUUM_DEAD_ROWS"] = None if vacuum_dead_rows == "off" else int(vacuum_dead_rows)  # type: ignore[index]

# Retention in the poller: bench/retention.py's arm with a purge beside the workload.
if run_retention_s := os.environ.get("DURABLE_FLOW_RUN_RETENTION_S"):
    DURABLE_FLOW["POLLER"]["RUN_RETENTION_S"] = float(run_retention_s)  # type: ignore[index]

# Worker, poller and server processes started by tests must use the database the test
# runner created, not the one named above. They leave out the `daphne` app: it only makes
# `runserver` serve ASGI (the tests start daphne itself), and importing it (Twisted, TLS) is
# about a quarter of a process's start-up CPU, paid at every worker the soak kills and restarts.
if os.environ.get("DURABLE_FLOW_SUBPROCESS") == "1":
    DATABASES["default"]["NAME"] = DATABASES["default"]["TEST"]["NAME"]
    INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "daphne"]  # noqa: F405

# Django's tasks framework (the `django-tasks` backport) on durable_flow (tests/processes/test_tasks.py).
TASKS = {
    "default": {"BACKEND": "durable_flow.contrib.tasks.DurableFlowBackend", "QUEUES": ["default", "capped", "later"]},
    "other": {"BACKEND": "durable_flow.contrib.tasks.DurableFlowBackend"},
    "any_queue": {"BACKEND": "durable_flow.contrib.tasks.DurableFlowBackend", "QUEUES": []},  # every name allowed
    "immediate": {
        "BACKEND": f"{'django.tasks' if django.VERSION >= (6,) else 'django_tasks'}.backends.immediate.ImmediateBackend"
    },
}

# The flow view's burst button in the browser tests: short steps through a throttled queue.
DASHBOARD_BURST = {
    "WORKFLOW": "tests.queued",
    "QUEUE": "browser-flow",
    "SIZE": 12,
    "INPUT": {"queue": "browser-flow", "seconds": 0.4},
}

# inline transport is what most tests run on (W002 warns about it outside DEBUG).
SILENCED_SYSTEM_CHECKS = ["durable_flow.W002"]

if TRANSPORT["BACKEND"] == "rq" and (FAR_REDIS_URL := os.environ.get("DURABLE_FLOW_RQ_FAR_URL")):
    # A second Redis (tests/processes/test_rq_lanes.py): the steps of flow-control queue "far"
    # go on lane "durable-far" there; the queue is not declared (W041), as the tests' queues are not.
    RQ_QUEUES["durable-far"] = {"URL": FAR_REDIS_URL}
    TRANSPORT["ROUTES"] = {"far": "durable-far"}
    SILENCED_SYSTEM_CHECKS.append("durable_flow.W041")
