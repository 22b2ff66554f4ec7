"""Database backends durable_flow ships: `sqlite3`, Django's with its write transactions queued
across processes (`durable_flow.backends.sqlite3`)."""
