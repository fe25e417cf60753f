"""Runnable examples of the client (``python -m examples.NAME`` from the repository root)."""
