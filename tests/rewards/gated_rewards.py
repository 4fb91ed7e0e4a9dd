"""A reward that runs until the test lets it finish (named by path, like misbehaving_rewards.py).

``"gate DIR NAME"`` writes its pid to ``DIR/NAME.pid``, then waits until ``DIR/NAME.go``
exists and scores 1.0. A test that never creates the file has a call that cannot finish on
its own: if it ends, the runner ended it. (After ``GIVE_UP_S`` it returns ``SENTINEL``, a
score no test accepts: a runner that waited for it fails instead of hanging the suite.)
Anything else scores an exact match.
"""

import os
import time
from pathlib import Path

GIVE_UP_S = 600.0
SENTINEL = 0.5


def gated(response, answer, prompt):
    if not response.startswith("gate "):
        return float(response == answer)
    folder, name = Path(response.split()[1]), response.split()[2]
    (folder / f"{name}.pid.tmp").write_text(str(os.getpid()))
    os.replace(folder / f"{name}.pid.tmp", folder / f"{name}.pid")  # the reader never sees a half-written pid
    deadline = time.monotonic() + GIVE_UP_S
    while not (folder / f"{name}.go").exists():
        if time.monotonic() > deadline:
            return SENTINEL
        time.sleep(0.005)
    return 1.0
