"""Alembic revisions for maintd (installed as the ``maintd.migrations`` package)."""
