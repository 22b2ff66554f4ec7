"""Example workflows for the demo (`make demo`)."""
