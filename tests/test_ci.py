"""CI cannot go green without running the tests (issue 29).

* Every skip of the suite goes through :func:`tests.tools.unavailable`: a skip locally, a failure
  under ``CI=true``, which ``.ci/run`` exports itself.
* ``.ci/strict_pytest.py`` (how ``.ci/run`` runs pytest) fails when no test was collected, when
  a test was skipped, and when one failed, and prints the counts.
* The tools are looked for at the paths ``.ci/run`` installs them to (``tests/tools.py``, read by
  both), not on ``PATH``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import tools

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SKIPS = {"skip", "skipif", "importorskip", "xfail"}
UNITTEST_SKIPS = {"SkipTest", "skipIf", "skipUnless", "expectedFailure"}


def _skip_calls(path: Path) -> list[str]:
    """``pytest.skip(...)``, ``pytest.mark.skipif``, ``pytest.importorskip`` ... in a module, under
    whatever name pytest is imported as, and unittest's ``SkipTest`` or ``skip*`` decorators."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"pytest"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
                            for a in node.names if a.name == "pytest" and a.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SKIPS:
            base = node.value
            names = []
            while isinstance(base, ast.Attribute):
                names.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{path.name}:{node.lineno}: {base.id}.{'.'.join(reversed(names + [node.attr]))}")
        if isinstance(node, ast.ImportFrom) and node.module in ("pytest", "unittest"):
            found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name in (SKIPS if node.module == "pytest" else UNITTEST_SKIPS)]
        if isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) in UNITTEST_SKIPS:
            found.append(f"{path.name}:{node.lineno}: unittest's {getattr(node, 'id', None) or node.attr}")
    return found


@pytest.mark.parametrize("source,hits", [
    ("import pytest\npytest.skip('x')\n", 1),
    ("import pytest as pt\n\n@pt.mark.skipif(True, reason='x')\ndef test_a():\n    pt.xfail('y')\n", 2),
    ("from pytest import importorskip\n", 1),
    ("import unittest\nraise unittest.SkipTest('x')\n", 1),
    ("from unittest import SkipTest\n", 1),
    ("import pytest\n\ndef test_a():\n    pytest.fail('not a skip')\n", 0),
], ids=["pytest.skip", "an-alias", "from-pytest", "unittest.SkipTest", "from-unittest", "a-failure-is-not"])
def test_the_skip_finder_finds_skips_however_spelled(tmp_path, source, hits):
    (tmp_path / "test_x.py").write_text(source)
    assert len(_skip_calls(tmp_path / "test_x.py")) == hits


def test_every_skip_goes_through_tools_unavailable():
    """A new ``pytest.skip`` would pass CI silently where the tool is missing: it must be
    ``tools.unavailable`` (a failure under CI=true) or ``tools.require``."""
    found = [hit for path in sorted(TESTS.glob("*.py")) if path.name != "tools.py" for hit in _skip_calls(path)]
    assert found == [], "skips outside tests/tools.py:\n" + "\n".join(found)


def _pytest(tmp_path: Path, *args: str, ci: bool | None = None, addopts: str | None = None,
            cache: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    if ci:
        env["CI"] = "true"
    if addopts:
        env["PYTEST_ADDOPTS"] = addopts
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args, *([] if cache else ["-p", "no:cacheprovider"]), "--rootdir",
                           str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_unavailable_skips_locally_and_fails_under_ci(tmp_path):
    (tmp_path / "test_needs_a_tool.py").write_text(
        "from tests.tools import unavailable\n\n"
        "def test_x():\n    unavailable('needs /nowhere/tool')\n")
    local = _pytest(tmp_path, "-m", "pytest", "-rs")
    assert local.returncode == 0 and "SKIPPED" in local.stdout and "needs /nowhere/tool" in local.stdout, local.stdout
    ci = _pytest(tmp_path, "-m", "pytest", "-rs", ci=True)
    assert ci.returncode == 1 and "1 failed" in ci.stdout, ci.stdout
    assert "needs /nowhere/tool (CI=true: a missing tool or server fails the run)" in ci.stdout


TWO = "import pytest\n\ndef test_ok():\n    pass\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n"
# .ci/run's second pass: only the tests that reach the suite's server (a fixture, here through another)
SERVER = ("import pytest\n\n@pytest.fixture\ndef srv():\n    return 1\n\n@pytest.fixture\ndef eng(srv):\n"
          "    return srv\n\ndef test_free():\n    pass\n\ndef test_direct(srv):\n    pass\n\n"
          "@pytest.mark.slow\ndef test_through(eng):\n    pass\n")


@pytest.mark.parametrize("tests,args,addopts,rc,said", [
    ("def test_ok():\n    pass\n", (), None, 0, "strict_pytest: 1 tests, 0 skipped;"),
    ("import pytest\n\ndef test_ok():\n    pass\n\ndef test_s():\n    pytest.skip('no chromium')\n", (), None, 1,
     "strict_pytest: skipped test_t::test_s: no chromium"),
    ("def test_bad():\n    assert False\n", (), None, 1, "strict_pytest: 1 tests, 0 skipped;"),
    (None, (), None, 1, "strict_pytest: pytest collected no tests: failing the run"),
    ("import no_such_module\n\ndef test_ok():\n    pass\n", (), None, 2, "ModuleNotFoundError"),
    (TWO, ("-k", "ok"), None, 1, "strict_pytest: 1 tests deselected (-m, -k or --deselect): CI runs them all"),
    (TWO, ("-m", "not slow", "-p", "xdist", "-n", "2"), None, 1, "strict_pytest: 1 tests deselected"),
    (TWO, (), "-m 'not slow'", 0, "strict_pytest: 2 tests, 0 skipped;"),
    (TWO, ("--lf",), None, 4, "unrecognized arguments: --lf"),
    (SERVER, ("--only-with-fixture", "srv"), None, 0,
     "strict_pytest: 1 tests without srv left out (--only-with-fixture: they do not use it)\n"),
    (SERVER, ("--only-with-fixture", "srv", "-p", "xdist", "-n", "2"), None, 0, "strict_pytest: 2 tests, 0 skipped;"),
    (SERVER, ("--only-with-fixture", "srv", "-m", "not slow"), None, 1, "strict_pytest: 1 tests deselected"),
    (SERVER, ("--only-with-fixture", "nothing_uses_it"), None, 1, "strict_pytest: pytest collected no tests"),
], ids=["passes", "a-skip-fails", "a-failure-fails", "no-tests-fail", "a-collection-error-fails",
        "a-deselection-fails", "a-deselection-under-xdist-fails", "addopts-are-ignored", "no-cache-to-rerun",
        "only-with-a-fixture-leaves-out-the-others", "only-with-a-fixture-under-xdist",
        "only-with-a-fixture-and-a-deselection-fails", "only-with-a-fixture-no-one-uses-fails"])
def test_strict_pytest_fails_on_skips_failures_no_tests_and_deselections(tmp_path, tests, args, addopts, rc, said):
    """.ci/run's gate: green only when every collected test ran and passed; PYTEST_ADDOPTS from
    the environment is ignored (its -m 'not slow' would pass CI on a subset)."""
    if tests is not None:
        (tmp_path / "test_t.py").write_text(tests)
        (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    res = _pytest(tmp_path, str(ROOT / ".ci" / "strict_pytest.py"), *args, addopts=addopts, cache=True)
    assert res.returncode == rc and said in res.stdout + res.stderr, res.stdout + res.stderr
    if addopts:
        assert f"strict_pytest: ignoring PYTEST_ADDOPTS={addopts!r}" in res.stdout


def test_strict_pytest_names_the_slowest_tests(tmp_path):
    """CI's 45-minute budget: the log names where the time goes, slowest first."""
    (tmp_path / "test_t.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                        "def test_slow():\n    time.sleep(0.3)\n")
    res = _pytest(tmp_path, str(ROOT / ".ci" / "strict_pytest.py"), cache=True)
    lines = [line for line in res.stdout.splitlines() if line.startswith("strict_pytest:   ")]
    assert res.returncode == 0 and len(lines) == 2, res.stdout
    assert lines[0].endswith("test_t::test_slow") and float(lines[0].split()[1].rstrip("s")) >= 0.3, lines


def test_ci_run_exports_ci_and_finds_tools_where_the_tests_do():
    run = (ROOT / ".ci" / "run").read_text()
    code = [line for line in run.splitlines() if not line.lstrip().startswith("#")]
    first_pytest = next(i for i, line in enumerate(code) if "run_pytest" in line and "()" not in line)
    assert "export CI=true" in code[:first_pytest]
    assert any("tests/tools.py missing" in line for line in code)  # what to install
    assert any("tests/tools.py check" in line for line in code)  # and that it is there
    assert not any("command -v" in line or "which " in line for line in code), "a tool found on PATH"
    assert any("strict_pytest.py" in line for line in code)


def test_every_tool_is_where_ci_installs_it():
    """Here (and in CI: a failure) each tool the tests start is at its Debian path."""
    for tool in tools.missing():
        tools.unavailable(f"needs {tool.path} (Debian package {tool.package})")
    assert subprocess.run([sys.executable, str(TESTS / "tools.py"), "check"]).returncode == 0


def test_a_thread_that_dies_fails_its_test_under_the_projects_settings(tmp_path):
    """pytest only warns when a test's thread raises; pyproject.toml makes it an error, so a
    test whose surviving threads did all the work fails."""
    (tmp_path / "test_t.py").write_text("import threading\n\ndef test_x():\n"
                                        "    t = threading.Thread(target=lambda: 1 / 0)\n    t.start()\n    t.join()\n")
    res = _pytest(tmp_path, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"))
    assert res.returncode == 1 and "1 failed" in res.stdout and "ZeroDivisionError" in res.stdout, res.stdout


def test_strict_pytest_adds_no_variable_that_maintd_would_refuse(monkeypatch):
    """maintd refuses unknown MAINTD_* variables at start (config.py), and every daemon a test
    starts inherits strict_pytest's environment: a MAINTD_-named variable of the gate's own
    failed 100 tests of a clean-clone CI run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("strict_pytest", ROOT / ".ci" / "strict_pytest.py")
    strict = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(strict)
    monkeypatch.setenv("PYTEST_ADDOPTS", "-x")
    env = strict.environment("/tmp/maintd-count")  # (this test may itself run under the gate)
    [named] = [k for k, v in env.items() if v == "/tmp/maintd-count"]  # the count file's variable
    assert not named.upper().startswith("MAINTD_"), named
    assert [k for k in env if k.upper().startswith("MAINTD_") and k not in os.environ] == []
    assert "PYTEST_ADDOPTS" not in env


def test_the_second_pass_leaves_out_only_tests_that_cannot_reach_the_suite_s_server():
    """.ci/run's PostgreSQL 15 pass runs only the tests that use ``pg_dsn`` (``--only-with-fixture``).
    That is sound while the fixture is the one way to the suite's server: conftest reads
    ``MAINTD_TEST_DATABASE_URL`` once, uses it in ``pg_dsn`` alone, and removes it from every test's
    environment (so a CLI a test starts cannot find it); no test module reads it."""
    run = (ROOT / ".ci" / "run").read_text()
    assert 'run_pytest --only-with-fixture pg_dsn' in run
    conftest = ast.parse((TESTS / "conftest.py").read_text())
    users = {fn.name for fn in ast.walk(conftest) if isinstance(fn, ast.FunctionDef)
             for node in ast.walk(fn) if isinstance(node, ast.Name) and node.id == "TEST_DATABASE_URL"}
    assert users == {"pg_dsn"}, users
    assert 'monkeypatch.delenv("MAINTD_TEST_DATABASE_URL"' in (TESTS / "conftest.py").read_text()
    for path in TESTS.glob("*.py"):
        if path.name == "conftest.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = [node for node in ast.walk(tree)
                 if (isinstance(node, ast.Name) and node.id == "TEST_DATABASE_URL")
                 or (isinstance(node, ast.alias) and node.name == "TEST_DATABASE_URL")
                 or (isinstance(node, ast.Constant) and node.value == "MAINTD_TEST_DATABASE_URL"
                     and path.name not in ("test_config.py", "test_ci.py"))]  # which names, not values
        assert not names, f"{path.name} reaches the suite's server without pg_dsn"


def test_the_second_pass_fails_on_a_server_of_another_major_version(pg_dsn, pg_version):
    """.ci/run's second pass is the PostgreSQL 15 run: it checked only that 127.0.0.1:5432
    answered, so a PostgreSQL 16 (or 18) there ran the pass, and CI said the suite passed on 15.
    .ci/check_server.py fails the run unless the server is of the major version asked for."""
    check = [sys.executable, str(ROOT / ".ci" / "check_server.py")]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    right = subprocess.run([*check, pg_dsn, str(pg_version)], capture_output=True, text=True, env=env, timeout=30)
    assert right.returncode == 0 and f"PostgreSQL {pg_version}" in right.stdout, right.stdout + right.stderr
    wrong = subprocess.run([*check, pg_dsn, str(pg_version - 1)], capture_output=True, text=True, env=env, timeout=30)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert f"is PostgreSQL {pg_version}, not {pg_version - 1}: failing the CI run" in wrong.stdout, wrong.stdout
    gone = subprocess.run([*check, "postgresql://postgres@127.0.0.1:1/test", "15"], capture_output=True, text=True,
                          env=env, timeout=30)
    assert gone.returncode == 1 and "127.0.0.1:1" in gone.stdout and "not reachable" in gone.stdout, gone.stdout
    run = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]
    second = next(line for line in run if "--only-with-fixture pg_dsn" in line)
    url = second.split("MAINTD_TEST_DATABASE_URL=")[1].split()[0].strip("\"'")
    checked = [i for i, line in enumerate(run) if "check_server.py" in line]
    assert checked and f"check_server.py {url} 15" in run[checked[0]] and checked[0] < run.index(second), checked
