"""Every statement maintd runs sits in ``maintd/queries/`` (one module per table, ``:name``
parameters), apart from the schema's DDL and the utility commands built from a quoted identifier
(see the ``maintd.queries`` docstring). This walks the source: a query written inline elsewhere
fails it, naming the file and line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .source_literals import string_literals

PACKAGE = Path(__file__).resolve().parent.parent / "maintd"
# Statements that read or write rows, or change a session: these belong in maintd/queries/.
STATEMENT = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|SET|RESET|BEGIN|COMMIT|LOCK|NOTIFY)\s", re.I)
# The partitioned layout's DDL (the partitions and their functions), and the
# demo, which plays the part of a worker's long transaction.
DDL_MODULES = {"partitions.py", "demo.py"}


def inline_statements(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    found = []
    for line, text in string_literals(ast.parse(path.read_text())):
        if STATEMENT.match(text) and text.strip().isascii() and \
                re.match(r"\s*[A-Z]+\s+[a-z(*'{:\d]|\s*(SET|RESET) [a-z_]+", text):  # SQL, not a sentence
            found.append(f"{path.relative_to(root)}:{line}: {text.strip()[:60]!r}")
    return found


def test_statements_live_in_maintd_queries():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("queries", "migrations") or rel.name in DDL_MODULES:
            continue
        offenders += inline_statements(path)
    assert offenders == []


def test_the_check_finds_an_inline_statement(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(conn, n):\n    """Select the rows."""\n'
                      '    conn.exec_driver_sql("SELECT now()")\n'
                      '    conn.exec_driver_sql(f"SET lock_timeout = {n}")\n'
                      '    return "Select a target first"\n')
    found = inline_statements(sample, tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == ["'SELECT now()'", "'SET lock_timeout = {}'"]
