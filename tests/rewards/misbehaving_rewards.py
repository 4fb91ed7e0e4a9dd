"""Reward functions that misbehave on purpose. The runner tests name them by path
(``tests/rewards/misbehaving_rewards.py:fn``), so worker processes load this file again;
module level stays import-free and cheap for that reason."""

import ctypes
import os
import re
import sys
import time
from pathlib import Path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed process not yet reaped is a zombie: dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def by_response(response, answer, prompt):
    """Misbehaves as the response says; otherwise 1.0 on an exact match."""
    if response == "regex":  # catastrophic backtracking: hours inside re, GIL held
        return float(re.match(r"(a+)+$", "a" * 40 + "b") is not None)
    if response == "exit":
        os._exit(3)
    if response == "segfault":
        ctypes.string_at(0)
    if response == "sys.exit":
        sys.exit(1)
    if response == "hang":
        time.sleep(600)
    if response == "raise":
        raise RuntimeError("boom")
    if response == "alloc":  # 1 GiB, touched: over any test's memory limit
        return float(len(bytearray(1 << 30)))
    if response == "print":  # a chatty reward: thousands of lines per batch on the console
        for _ in range(100):
            print("reward-debug-output")
            print("reward-debug-stderr", file=sys.stderr)
        return 1.0
    if response.startswith("sleep "):
        time.sleep(float(response.split()[1]))
        return 1.0
    if response.startswith("slow-then-flag "):  # record our pid, sleep, then leave a flag
        folder, seconds = response.split()[1:]
        (Path(folder) / "pid").write_text(str(os.getpid()))
        time.sleep(float(seconds))
        (Path(folder) / "finished").write_text("1")
        return 1.0
    if response.startswith("await "):  # return just after that slow call finished or its worker died
        folder = Path(response.split()[1])
        for _ in range(3000):
            pid = (folder / "pid").read_text() if (folder / "pid").exists() else ""
            if (folder / "finished").exists() or (pid and not _pid_alive(int(pid))):
                time.sleep(0.2)
                return 1.0
            time.sleep(0.01)
        return 0.0
    return float(response == answer)


def typed(response, answer, prompt):
    """Returns a value of the kind the response names."""
    import numpy as np

    values = {
        "bool": True, "false": False, "np.float32": np.float32(0.5), "np.int64": np.int64(2),
        "np.bool_": np.bool_(True), "ndarray0d": np.array(0.25), "ndarray1d": np.array([1.0]),
        "str": "1", "none": None, "nan": float("nan"), "inf": float("inf"), "complex": 1j,
        "dict": {"score": 1, "length": np.int64(3), "ok": True},
        "dict-no-score": {"length": 3}, "dict-bad-extra": {"score": 1.0, "note": "a"},
    }
    return values[response]


def tensor_score(response, answer, prompt):
    import torch

    return torch.tensor(0.75)  # 0-d


def batched_length(responses, answers, prompts):
    return [float(len(r)) for r in responses]


batched_length.hybridrl_batched = True


def batched_by_first(responses, answers, prompts):
    """Fails the whole batch as its first response says; else 1.0 per exact match and a
    per-sample RewardFailure for the others."""
    from hybridrl.rewards import RewardFailure

    if responses[0] == "raise":
        raise ValueError("bad batch")
    if responses[0] == "hang":
        time.sleep(600)
    if responses[0] == "short":
        return [1.0]
    return [1.0 if r == a else RewardFailure("mismatch") for r, a in zip(responses, answers)]


batched_by_first.hybridrl_batched = True
