"""A short version of bench/soak.py: maintd's memory stays flat under a flowing workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_short_soak_memory_is_flat():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--short"], capture_output=True,
                         text=True, timeout=300, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout.strip().splitlines()[-1])
    rss = data["rss_mib"]
    assert len(rss) >= 5
    half = len(rss) // 2
    # Flat: the second half of the soak does not sit above the first by more than a few MiB.
    assert sum(rss[half:]) / len(rss[half:]) - sum(rss[:half]) / half < 8, rss
    assert max(rss) < 200, rss
    assert data["on_rate"] > 0 and data["off_rate"] > 0
