"""The embedded PostgreSQL's binaries, copied where an unprivileged user can run them (running as
root, initdb runs as ``postgres``/``nobody``, who cannot reach a virtualenv under a 0700 directory)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import signal, subprocess
    import maintd.embedded as e
    e._traversable_by_others = lambda path: False  # the wheel as under a 0700 virtualenv
    user = e._service_user()
    bin_dir = e._install_for(user)
    out = subprocess.run([str(bin_dir / "initdb"), "--version"], capture_output=True, text=True,
                         preexec_fn=e._drop_privileges(user, signal.SIGKILL), cwd="/")
    print(out.returncode, out.stdout.strip() or out.stderr.strip())
""")


def test_processes_starting_together_share_one_whole_copy_of_the_binaries():
    """Six processes copy at once into a fresh temporary directory (as two pytest-xdist workers
    do on a new machine): each runs initdb from the copy it is given, as the unprivileged user
    when root, and one copy is left. Unlocked, one process's clean-up removed another's copy under
    its initdb ("error while loading shared libraries": 339 errors in one CI run)."""
    tmp = Path(tempfile.mkdtemp(prefix="maintd-t-", dir="/tmp"))
    os.chmod(tmp, 0o755)  # as /tmp is: the unprivileged user must reach the copy
    try:
        env = {**os.environ, "TMPDIR": str(tmp)}
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(6)]
        outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
        assert all(o.startswith("0 initdb (PostgreSQL) ") for o in outputs), outputs
        copies = [p.name for p in tmp.iterdir() if not p.name.endswith(".lock")]
        assert len(copies) == 1 and copies[0].startswith("maintd-pginstall-"), copies
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
