"""The worker pool: per-call accounting inside chunks, persistence, and no orphans."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.rewards import RewardRunner
from hybridrl.rewards.process_pool import MAX_CHUNK

HERE = Path(__file__).resolve().parent
BAD = f"{HERE / 'misbehaving_rewards.py'}:by_response"
if str(HERE) not in sys.path:  # pytest's default import mode puts it there already
    sys.path.insert(0, str(HERE))
from misbehaving_rewards import _pid_alive  # noqa: E402


def _wait_dead(pids, within_s=20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_a_timeout_or_death_inside_a_chunk_costs_one_call():
    # one worker, 40 calls: chunks of 10, so the hang and the exit sit mid-chunk; the
    # rest of each chunk goes back to the queue and is scored normally
    n = 40
    responses = [str(i) for i in range(n)]
    responses[5], responses[25] = "hang", "exit"
    with RewardRunner(BAD, timeout_s=5.0, workers=1) as r:  # ms calls: no spurious timeout on a busy host
        batch = r.score(responses, [str(i) for i in range(n)], [""] * n)
    assert batch.scores == [0.0 if i in (5, 25) else 1.0 for i in range(n)]
    assert batch.failures == {"timeout": 1, "worker died": 1}


def test_large_batches_go_in_chunks_and_keep_order():
    n = 2 * 4 * MAX_CHUNK + 3
    with RewardRunner(BAD, workers=2) as r:
        pids = r._pool.pids()
        batch = r.score([str(i) for i in range(n)], [str(i if i % 3 else -1) for i in range(n)], [""] * n)
        assert batch.scores == [1.0 if i % 3 else 0.0 for i in range(n)]
        r.score(["a"], ["a"], [""])
        assert r._pool.pids() == pids  # persistent: startup is paid once per run
    assert _wait_dead(pids)  # close() stopped them


def test_close_is_idempotent_and_final():
    r = RewardRunner(BAD, workers=1)
    r.close()
    r.close()
    with pytest.raises(RuntimeError, match="pool is closed; create a new RewardRunner"):
        r.score(["a"], ["a"], [""])


def _script(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path[:0] = {sys.path!r}\n{code}"]


def test_exit_without_close_leaves_no_workers():
    # the trainer forgetting close() must neither hang at exit (the old thread runner's
    # hung call) nor leave workers behind, including the one that replaced a timed-out one
    code = (f"from hybridrl.rewards import RewardRunner\n"
            f"r = RewardRunner({BAD!r}, timeout_s=0.5, workers=2)\n"
            f"print(r.score(['hang'], [None], ['']).failures['timeout'])\n"
            f"print(*r._pool.pids(), flush=True)\n")
    out = subprocess.run(_script(code), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, pids = out.stdout.strip().splitlines()
    assert first == "1" and _wait_dead([int(p) for p in pids.split()])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_killed_trainer_leaves_no_orphans(tmp_path):
    # SIGKILL runs no atexit hook: the kernel must take the workers down, even one that
    # is stuck holding the GIL in a regex
    code = (f"from hybridrl.rewards import RewardRunner\n"
            f"r = RewardRunner({BAD!r}, timeout_s=600, workers=2)\n"
            f"print(*r._pool.pids(), flush=True)\n"
            f"r.score(['regex', 'hang'], [None, None], ['', ''])\n")
    proc = subprocess.Popen(_script(code), stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)  # let the calls start
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert _wait_dead(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids if "pids" in locals() else []:
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
