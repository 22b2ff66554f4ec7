"""The `db` admission backend: exact across every process that shares the database.
`backend` holds the class; `heads`, `keyed`, `read` and `resources` state the rules over rows."""
