#!/usr/bin/env python
"""Django's command-line utility for durable_flow's project."""

import os
import sys


def main() -> None:
    """Run administrative tasks with the embedded settings unless told otherwise."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings.embedded")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
