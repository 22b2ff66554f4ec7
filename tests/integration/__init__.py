"""This process against real services: the database, Redis, Django's test client, the engine on
the `db` or `redis` backends."""
