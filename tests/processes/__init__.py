"""Real child processes: `durable_worker`, `durable_poller`, RQ workers, `manage.py` and other subprocesses."""
