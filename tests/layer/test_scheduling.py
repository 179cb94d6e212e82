"""`make test` runs `pytest -n 2 --dist loadgroup` so that tests/sm90/test_sm90_compile.py (one
module fixture compiling every kernel for sm_90, ~5 minutes on a fresh CPU machine) runs on
one worker only. With pytest 9 and pytest-xdist 3.8 the groups can silently fall apart, and
both workers then compile everything; this checks, with the installed pytest and xdist, that
a grouped module's fixture is set up once."""
from __future__ import annotations

import os
import subprocess
import sys

GROUPED = '''
import os, time, pytest
pytestmark = pytest.mark.xdist_group("one_worker")

@pytest.fixture(scope="module")
def expensive():
    with open(os.environ["SETUPS_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.5)

def test_first(expensive):
    pass

@pytest.mark.parametrize("n", range(5))
def test_more(expensive, n):
    pass
'''

OTHERS = '''
import pytest

@pytest.mark.parametrize("i", range(40))
def test_other(i):
    pass
'''


def test_a_grouped_module_sets_its_fixture_up_once(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_others.py").write_text(OTHERS)
    setups = tmp_path / "setups.txt"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
         "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "SETUPS_FILE": str(setups)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "46 passed" in res.stdout, res.stdout[-2000:]
    # one line per setup: two lines (two worker pids) is the split this guards against
    assert len(setups.read_text().split()) == 1, setups.read_text()
