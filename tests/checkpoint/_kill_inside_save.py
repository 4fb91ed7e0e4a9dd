"""A tiny training job that SIGKILLs itself inside ``save_step_dir`` (for test_crash_mid_save.py).

``python _kill_inside_save.py KILL_AT POINT RECORD_DIR override...``: the job runs with the
given config overrides; its saves are counted, and the ``KILL_AT``-th one dies at ``POINT``:

- ``weights_written``: the Hugging Face files (``model.safetensors``, tokenizer, config) are
  in the save's temporary directory, the training state is not;
- ``before_rename``: the temporary directory is complete and fsynced, not yet renamed into
  ``checkpoints/step-N``.

Each save (the dying one included) first leaves ``RECORD_DIR/save-<k>.pt``: its step and
the policy weights it saves, cloned from the live model (not read back from any file).
"""

import os
import signal
import sys
from pathlib import Path

import torch


def main() -> None:
    kill_at, point, record = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    assert point in ("weights_written", "before_rename"), point
    from hybridrl.checkpoint import atomic, train_state
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    saves = [0]
    real_state, real_fsync_tree = train_state.write_training_state, atomic._fsync_tree

    def write_training_state(directory, run, loop, rng, **kw):  # called after write_hf, once per save
        saves[0] += 1
        weights = {name: t.detach().clone() for name, t in run.policy.state_dict().items()}
        torch.save({"step": loop.step, "weights": weights}, record / f"save-{saves[0]}.pt")
        if saves[0] == kill_at and point == "weights_written":
            os.kill(os.getpid(), signal.SIGKILL)
        real_state(directory, run, loop, rng, **kw)

    def fsync_tree(directory):  # the last thing save_step_dir does before the rename
        real_fsync_tree(directory)
        if saves[0] == kill_at and point == "before_rename":
            os.kill(os.getpid(), signal.SIGKILL)

    train_state.write_training_state = write_training_state  # loop.save imports it at call time
    atomic._fsync_tree = fsync_tree
    train(load_config(None, sys.argv[4:]))
    sys.exit(f"the run ended after {saves[0]} saves without being killed at save {kill_at}")


if __name__ == "__main__":
    main()
