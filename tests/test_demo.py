"""The main job (`make demo`, demo/run.py) end to end on loopback: the controller, the software aggregator and
2 servers x 2 ranks training on backend "passing", then on gloo and in flat mode; it must end with OK (the ranks'
parameters identical at every check, the accuracy gloo's) and say what it measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # three trainings of four ranks
@pytest.mark.timeout(900)
def test_the_demo_runs_and_ends_ok():
    run = subprocess.run([sys.executable, "demo/run.py", "--on", "loopback"], cwd=REPO, capture_output=True,
                         text=True, timeout=840)
    assert run.returncode == 0, f"demo failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    lines = run.stdout.splitlines()
    assert lines[-1] == "OK", run.stdout[-3000:]
    assert any(ln.startswith("demo: on the software aggregator, ranks on loopback") for ln in lines), run.stdout
    assert sum(ln.startswith("demo: server ") and "MB to the aggregator in PASSING mode" in ln for ln in lines) == 2


def test_the_demo_refuses_what_it_cannot_run():
    run = subprocess.run([sys.executable, "demo/run.py", "--tree", "--on", "loopback"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "demo:" in run.stderr, (run.returncode, run.stderr)
