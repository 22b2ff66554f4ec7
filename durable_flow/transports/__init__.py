"""Transports carry turns and steps to whoever runs them: `inline` (in-process, for unit
tests), `db` (task rows, the embedded default) and `rq` (RQ jobs on Redis via django-rq)."""
