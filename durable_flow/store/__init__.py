"""The one gateway for SQL and the queries several layers share: hand-written statements
(`statements`, `admission_statements`), shared queries, step attempts, queue rows, pause flags,
counters, the PostgreSQL adapters, and what an outage of the database or Redis looks like."""
