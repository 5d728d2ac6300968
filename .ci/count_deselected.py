"""A pytest plugin for .ci/strict_pytest.py: appends how many tests each session deselected
(``-m``, ``-k``, ``--deselect``; under xdist, each worker's session) to the file named by
``STRICT_PYTEST_DESELECTED_FILE``, so that CI cannot go green on a subset of the suite.

``--only-with-fixture NAME`` keeps the tests that use the fixture ``NAME`` (directly or through
another fixture) and leaves out the rest, counted apart (``without NAME N``): .ci/run's second
pass runs the suite again on another PostgreSQL, and a test that never reaches the suite's server
(``pg_dsn``) would only repeat what the first pass ran. strict_pytest allows that count and no
other deselection."""

from __future__ import annotations

import os

import pytest

_APART = pytest.StashKey[set]()


def _record(line: str) -> None:
    path = os.environ.get("STRICT_PYTEST_DESELECTED_FILE")
    if path:
        with open(path, "a") as out:
            out.write(f"{line}\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--only-with-fixture", metavar="NAME", default=None,
                     help="run only the tests that use the fixture NAME; the others are counted apart "
                          "(strict_pytest allows them, not other deselections)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = config.getoption("only_with_fixture")
    if not name:
        return
    apart = [item for item in items if name not in getattr(item, "fixturenames", ())]
    if apart:
        config.stash[_APART] = {item.nodeid for item in apart}
        _record(f"without {name} {len(apart)}")
        items[:] = [item for item in items if name in getattr(item, "fixturenames", ())]
        config.hook.pytest_deselected(items=apart)


def pytest_deselected(items) -> None:
    if not items:
        return
    config = items[0].config
    apart = config.stash.get(_APART, set())
    if counted := sum(1 for item in items if item.nodeid not in apart):
        _record(str(counted))
