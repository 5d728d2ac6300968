"""maintd: leader-elected maintenance daemon for a Postgres-backed job queue."""

__version__ = "0.1.0"
