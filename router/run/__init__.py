"""Wiring: the app, --workers, the command line, logging."""
