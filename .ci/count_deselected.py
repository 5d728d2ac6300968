"""A pytest plugin for .ci/strict_pytest.py: appends how many tests each session deselected
(``-m``, ``-k``, ``--deselect``; under xdist, each worker's session) to the file named by
``STRICT_PYTEST_DESELECTED_FILE``, so that CI cannot go green on a subset of the suite."""

from __future__ import annotations

import os


def pytest_deselected(items) -> None:
    path = os.environ.get("STRICT_PYTEST_DESELECTED_FILE")
    if path and items:
        with open(path, "a") as out:
            out.write(f"{len(items)}\n")
