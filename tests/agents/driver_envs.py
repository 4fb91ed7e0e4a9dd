"""Environments for the episode-driver tests, named by path (worker processes load this file
again: module level stays import-free). Each is deterministic per episode, so episodes
played in any order or batching give the same trajectories."""

from __future__ import annotations

import os
import time


class Turns:
    """Three turns: each step answers with a message built from the turn and the model's text
    (a deterministic function of the episode alone), reward 1 when done; each step takes
    ``row["sleep"]`` seconds (a slow tool). ``row["fault"]``
    makes the first step misbehave: "raise", "hang" (past any test timeout) or "exit" (the
    worker process dies)."""

    def reset(self, row: dict) -> list[dict]:
        self.turns, self.fault, self.sleep = 0, row.get("fault"), float(row.get("sleep", 0.0))
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, assistant_message: str):
        self.turns += 1
        time.sleep(self.sleep)
        if self.turns == 1 and self.fault == "raise":
            raise ValueError("step failed on purpose")
        if self.turns == 1 and self.fault == "hang":
            time.sleep(600)
        if self.turns == 1 and self.fault == "exit":
            os._exit(3)
        done = self.turns == 3
        words = " ".join(w[::-1] for w in assistant_message.split()[:6]) or "nothing"
        return ([] if done else [{"role": "tool", "name": "echo", "content": f"turn {self.turns}: {words}"}],
                1.0 if done else 0.25, done, {})
