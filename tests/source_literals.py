"""The string literals of a module's source, for the tests that look for SQL written outside
``maintd/queries`` (test_fencing's inventory of writes, test_sql_home)."""

from __future__ import annotations

import ast
from typing import Iterator


def string_literals(tree: ast.Module, roots: list[ast.AST] | None = None) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal under ``roots`` (default: the whole module), an
    f-string whole with each expression as ``{}``; docstrings (prose) and the pieces of f-strings
    are left out."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)}
    nodes = [n for root in ([tree] if roots is None else roots) for n in ast.walk(root)]
    inner = {id(v) for n in nodes if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in nodes:
        if id(node) in docs or id(node) in inner:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
