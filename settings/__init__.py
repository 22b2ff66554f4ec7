"""Project settings: `embedded` (SQLite + db transport, the default), `production`, `test`."""
