"""``launcher.nproc_per_node=N``: start N data-parallel ranks on this host with torch's
elastic launcher (the machinery behind ``torchrun``), no shell scripts.

Failure handling: each rank catches its own error and records it as one line; when a
rank fails the launcher stops the others (``max_restarts=0``) and :func:`launch_local`
raises one ``ValueError`` naming that rank and its error. A rank that dies without a
word (killed) is reported by its exit code.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path

ERROR_DIR_ENV = "HYBRIDRL_RANK_ERROR_DIR"


def rank_main(config_yaml: str, error_dir: str) -> None:
    """One rank: rebuild the config, train; any error → one line in ``error_dir``, exit 1."""
    import yaml

    from hybridrl.config.io import build_config
    from hybridrl.job.loop import train

    rank = os.environ.get("RANK", "?")
    try:
        train(build_config(yaml.safe_load(config_yaml), source="launcher"))
    except BaseException as e:  # noqa: BLE001 - report any failure as one line, then fail the rank
        line = " ".join(str(e).split()) or type(e).__name__
        Path(error_dir, f"rank{rank}").write_text(f"{type(e).__name__}: {line}")
        print(f"hybridrl: rank {rank}: {type(e).__name__}: {line}", file=sys.stderr)
        if os.environ.get("HYBRIDRL_DEBUG"):  # the agent's own log of it is silenced below
            import traceback

            traceback.print_exc()
            raise
        sys.exit(1)


def launch_local(cfg, *, nproc: int) -> None:
    """Run ``cfg`` on ``nproc`` ranks of this host; returns when all finished."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hybridrl.config.io import config_to_yaml

    import logging

    # the agent logs every failed rank's traceback; the user gets the one line below instead
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    error_dir = tempfile.mkdtemp(prefix="hybridrl-ranks-")
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"hybridrl-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.5,
                          start_method="spawn")
    try:
        elastic_launch(launch, rank_main)(config_to_yaml(cfg), error_dir)
    except ChildFailedError as e:
        raise ValueError(first_rank_error(error_dir, e)) from None
    finally:
        import shutil

        shutil.rmtree(error_dir, ignore_errors=True)


def first_rank_error(error_dir: str, err: Exception) -> str:
    """The first recorded one-line error (the root cause: the others are ranks that lost
    their peer), else the launcher's exit-code summary."""
    recorded = sorted(Path(error_dir).glob("rank*"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    if recorded:
        return f"{recorded[0].name.replace('rank', 'rank ')} failed: {recorded[0].read_text()}"
    failures = getattr(err, "failures", {}) or {}
    if failures:
        rank, failure = min(failures.items())
        return f"rank {rank} died (exit code {failure.exitcode}) without reporting an error; see its output above"
    return f"a rank failed: {' '.join(str(err).split())[:300]}"
