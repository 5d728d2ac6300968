"""Run pytest as CI must: green only when tests ran and none was skipped.

``python .ci/strict_pytest.py [pytest arguments]`` runs ``python -m pytest -rs --junitxml=...``
with the arguments, prints how many tests ran, the slowest ten, and how many were skipped (each
skip with its reason), and exits non-zero when pytest failed, when it collected no tests (pytest's exit code 5,
which a plain ``pytest || exit 1`` takes for success), when any test was skipped (under
``CI=true`` a missing tool or server fails its test, tests/tools.py, so a skip in CI means a test
that found a way around that, not a reason to pass), or when any was deselected (``-m``, ``-k``,
``--deselect``: counted by .ci/count_deselected.py). ``--only-with-fixture NAME`` (that plugin's)
leaves out the tests that do not use the fixture NAME: counted apart and printed, not a failure.

What the environment could add is kept out: ``PYTEST_ADDOPTS`` is dropped (``-m 'not slow'``
there would deselect the failover scenarios), and the cache plugin is off (``--lf`` and ``--sw``
would run the last failures only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
HERE = os.path.dirname(os.path.abspath(__file__))  # count_deselected.py, loaded with -p


def summary(junit: str, n: int = 10) -> tuple[int, list[str], list[str]]:
    """From pytest's JUnit XML: tests run, one line per skipped test, and the ``n`` slowest as
    "seconds  file::name", slowest first (to watch CI's time budget)."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    skipped, times = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        times.append((float(case.get("time") or 0), name))
        skipped += [f"{name}: {skip.get('message', '')}" for skip in case.findall("skipped")]
    return tests, skipped, [f"{t:7.1f}s  {name}" for t, name in sorted(times, reverse=True)[:n]]


def environment(deselected: str) -> dict[str, str]:
    env = dict(os.environ)
    if env.pop("PYTEST_ADDOPTS", None):
        print(f"strict_pytest: ignoring PYTEST_ADDOPTS={os.environ['PYTEST_ADDOPTS']!r}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    env["STRICT_PYTEST_DESELECTED_FILE"] = deselected
    return env


def deselected_count(path: str) -> tuple[int, str]:
    """The most any session deselected (xdist workers each collect the whole suite), and what
    ``--only-with-fixture`` left out, as "N tests without FIXTURE" ("" when nothing)."""
    dropped, apart = 0, ""
    with open(path) as counts:
        for line in counts:
            if line.startswith("without "):
                _, name, n = line.split()
                apart = f"{n} tests without {name}"
            elif line.strip():
                dropped = max(dropped, int(line))
    return dropped, apart


def main(args: list[str]) -> int:
    fd, junit = tempfile.mkstemp(prefix="maintd-junit-", suffix=".xml")
    os.close(fd)
    fd, deselected = tempfile.mkstemp(prefix="maintd-deselected-")
    os.close(fd)
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-p", "count_deselected",
                              f"--junitxml={junit}", *args], env=environment(deselected))
        if rc == NO_TESTS:
            print("strict_pytest: pytest collected no tests: failing the run")
            return 1
        try:
            tests, skipped, slow = summary(junit)
        except (OSError, ET.ParseError) as exc:
            print(f"strict_pytest: no test report ({exc}): failing the run")
            return rc or 1
        print(f"strict_pytest: {tests} tests, {len(skipped)} skipped; the slowest:")
        for line in slow:
            print(f"strict_pytest:   {line}")
        for line in skipped:
            print(f"strict_pytest: skipped {line}")
        if rc != 0:
            return rc
        if tests == 0:
            print("strict_pytest: no test ran: failing the run")
            return 1
        if skipped:
            print("strict_pytest: skipped tests fail the CI run (install what they need; tests/tools.py)")
            return 1
        dropped, apart = deselected_count(deselected)
        if apart:
            print(f"strict_pytest: {apart} left out (--only-with-fixture: they do not use it)")
        if dropped:
            print(f"strict_pytest: {dropped} tests deselected (-m, -k or --deselect): CI runs them all")
            return 1
        return 0
    finally:
        os.unlink(junit)
        os.unlink(deselected)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
