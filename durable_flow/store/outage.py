"""Riding out a Redis or database outage: which errors mean "the service is down, try again",
and a capped backoff that logs once when an outage starts and once when it ends.

A worker or poller must outlive an outage of any length (there may be no supervisor to
restart it), yet must not log a traceback every 100 ms while Redis is gone: an `Outage` is the
small state machine between those two needs. It is pure (no sleeping, no clock), so the loop
that owns it decides how to wait (usually `stop_event.wait(delay)`, so SIGTERM still works).
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, InterfaceError, OperationalError


def service_unreachable_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a network service raises when it cannot be reached: Python's own and
    redis-py's (the admission backend, a broker); not the database's (`transient_errors`)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import redis.exceptions

        errors += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError]
    except ImportError:  # redis is optional for the db transport
        pass
    return tuple(errors)


def cluster_failover_errors() -> tuple[type[BaseException], ...]:
    """What redis-py's `RedisCluster` raises while a master fails over (the slot has no master
    yet, or is moving): a service out of reach for a while, like `service_unreachable_errors`."""
    try:
        import redis.exceptions
    except ImportError:
        return ()
    return (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.MasterDownError)


def transient_errors() -> tuple[type[BaseException], ...]:
    """Exceptions raised when Redis or the database is unreachable (not when a query is wrong),
    a Redis Cluster failover included: every loop that rides out an outage rides out that one.

    `DatabaseError` covers what psycopg raises when the server went away mid-statement; a
    genuine bug surfaces again on every retry and stays visible in the log, once per outage.
    """
    return (DatabaseError, OperationalError, InterfaceError, *service_unreachable_errors(), *cluster_failover_errors())


class Outage:
    """Backoff for one loop: 0.1 s doubling to `cap_s`, reset when a call succeeds."""

    def __init__(self, what: str, logger: logging.Logger, first_s: float = 0.1, cap_s: float = 5.0) -> None:
        self.what = what
        self.logger = logger
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0

    @property
    def ongoing(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> float:
        """Record a failure; return how long to wait before the next try. Logs the first only."""
        if self.failures == 0:
            self.logger.warning(
                "%s: service unavailable (%s: %s); retrying with backoff", self.what, type(exc).__name__, exc
            )
        delay = min(self.cap_s, self.first_s * 2 ** min(self.failures, 32))
        self.failures += 1
        return delay

    def recovered(self) -> None:
        """Record a success; logs once if it ends an outage."""
        if self.failures:
            self.logger.warning("%s: service back after %d failed attempt(s)", self.what, self.failures)
            self.failures = 0
