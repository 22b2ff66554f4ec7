"""An installed app (only in tests/processes/test_task_declarations.py) whose `tasks` module declares a task."""
