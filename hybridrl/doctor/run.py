"""Build a job's components for the doctor (in a scratch run folder, removed after), run its
warm start, diagnose one batch, write the report."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

from hybridrl.config import Config


def doctor_mismatch(cfg: Config, out: str | None, *, seed: int = 0, engine_temperature: float | None = None,
                    warm_start: bool = True, console=print):
    """The job of ``cfg`` as a training run builds it (model, engine, data), after its warm
    start, diagnosed on one batch. Returns (Diagnosis, the output folder)."""
    from hybridrl.doctor.mismatch import diagnose
    from hybridrl.doctor.report import format_table, write
    from hybridrl.job.build import build_run
    from hybridrl.job.loop import warm_start as run_warm_start

    target = Path(out) if out else Path(cfg.trainer.output_dir) / f"{cfg.trainer.run_name or 'run'}-doctor"
    if target.exists():
        raise ValueError(f"doctor mismatch: {target} already exists; choose a new --out")
    scratch = Path(tempfile.mkdtemp(prefix="hybridrl-doctor-"))
    job = copy.deepcopy(cfg)
    job.trainer.output_dir, job.trainer.run_name = str(scratch), "job"
    job.logging.tensorboard = job.logging.plot = job.logging.progress = False
    try:
        run = build_run(job, console=console)
        try:
            if warm_start:
                run_warm_start(run, job)
            d = diagnose(job, run.step, seed=seed, engine_temperature=engine_temperature)
        finally:
            run.step.close()
            run.directory.close()
            run.step.scorer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    console(format_table(d))
    return d, write(d, target)
