"""The suite's seed rule (``tests/_seeds.py``): a failing test prints its seed, and
``pytest --seed N`` replays exactly what it drew."""
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

FAILING = '''
import random
import _seeds
import torch

def test_draws_then_fails():
    drawn = (torch.rand(3).tolist(), random.random(), _seeds.fresh_seed(), _seeds.fresh_seed())
    print("DRAWN", drawn)
    assert False
'''


def _run(tmp_path, *args) -> str:
    test = tmp_path / "test_fails.py"
    test.write_text(FAILING)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-p", "conftest",
           "--rootdir", str(tmp_path), str(test), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(TESTS),
                         "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr  # the test failed (and nothing else went wrong)
    return out.stdout


def test_a_failure_prints_its_seed_and_the_seed_replays_it(tmp_path):
    first = _run(tmp_path)
    seed = re.search(r"seed (\d+): replay with `pytest --seed \1", first)
    assert seed, first
    drawn = re.search(r"DRAWN (.*)", first).group(1)
    again = _run(tmp_path, "--seed", seed.group(1))
    assert re.search(r"DRAWN (.*)", again).group(1) == drawn  # (an ignored --seed would draw anew: fails)
