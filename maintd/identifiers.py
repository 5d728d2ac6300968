"""SQL identifiers from the config (schema, index names): validated once, always quoted."""

from __future__ import annotations

import re

IDENT_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}\Z")  # \Z: "$" would also match before a final newline


def validate_identifier(value: str, what: str = "identifier", longest: int = 63) -> str:
    """Lower-case SQL identifiers only; they are still always quoted where used. ``longest``: the
    length the error message gives (a schema's is shorter, see :func:`validate_schema`)."""
    if not isinstance(value, str) or not IDENT_RE.match(value):
        raise ValueError(
            f"invalid {what} {value!r}: use 1-{longest} lower-case letters, digits and underscores, "
            "not starting with a digit"
        )
    if value.startswith("pg_"):
        raise ValueError(f"invalid {what} {value!r}: the pg_ prefix is reserved by PostgreSQL")
    return value


# A schema's NOTIFY channels are named after it (``<schema>_maintd_periodic``, the longest: see
# maintd.db), and PostgreSQL cuts no channel name: over 63 bytes, NOTIFY and LISTEN fail.
SCHEMA_MAX = 63 - len("_maintd_periodic")


def validate_schema(value: str) -> str:
    """A schema name: an identifier of at most SCHEMA_MAX (47) characters."""
    validate_identifier(value, "schema name", SCHEMA_MAX)
    if len(value) > SCHEMA_MAX:
        raise ValueError(f"invalid schema name {value!r}: at most {SCHEMA_MAX} characters (its NOTIFY "
                         f"channel {value + '_maintd_periodic'!r} must fit PostgreSQL's 63)")
    return value


def quote_ident(name: str) -> str:
    """Quote an identifier that has already passed :func:`validate_identifier`."""
    if not IDENT_RE.match(name):
        raise ValueError(f"refusing to quote unvalidated identifier {name!r}")
    return '"' + name + '"'


def quote_catalog_name(name: str) -> str:
    """Quote a name read from PostgreSQL's catalog (an index an operator made: ``Jobs_Kind``,
    with spaces or quotes): any name, its double quotes doubled, as the server's ``%I`` does."""
    return '"' + name.replace('"', '""') + '"'


def qualified(schema: str, name: str) -> str:
    """``"schema"."name"`` for two validated identifiers."""
    return f"{quote_ident(schema)}.{quote_ident(name)}"
