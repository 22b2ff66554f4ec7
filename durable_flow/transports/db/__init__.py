"""The embedded `db` transport: task rows in the project's database (`transport`), with
`LISTEN`/`NOTIFY` wake-ups on PostgreSQL (`notify`)."""
