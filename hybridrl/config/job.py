"""The job's groups: the step's batch, the supervised warm start, the run itself,
checkpoints and resume, the launcher (elastic or Ray), and refit.

These were one 28-field ``trainer`` group; the old keys fail with the new name
(``config/io.py: RENAMED``): ``trainer.sft_steps`` -> ``warm_start.steps``, ...
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.base import SEED, ConfigError, Range, _f, check_ranges


@dataclass(kw_only=True)
class BatchConfig:
    prompts_per_step: int = _f(32, "prompts per step; the batch is prompts_per_step * rollout.n responses",
                               check=Range(low=1))
    mini_batch_size: int | None = _f(None, "responses per optimizer step (must divide the batch); null = the whole "
                                           "batch: on-policy, no old-log-prob pass")
    ppo_epochs: int = _f(1, "passes over each rollout batch", check=Range(low=1))
    max_tokens_per_microbatch: int = _f(8192, "token budget of one forward/backward micro-batch", check=Range(low=1))
    shared_prefix: bool = _f(True, "run each group's prompt once in the trainer forward (when a mini-batch is one "
                                   "micro-batch)")

    def __post_init__(self) -> None:
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ConfigError(f"batch.mini_batch_size={self.mini_batch_size}: must be >= 1 (or null = whole batch)")
        check_ranges(self, "batch")


@dataclass(kw_only=True)
class WarmStartConfig:
    steps: int = _f(3000, "supervised warm-start steps before RL (0 = none)", check=Range(low=0))
    batch_size: int = _f(64, "warm-start batch size", check=Range(low=1))
    lr: float = _f(1e-3, "warm-start (supervised) learning rate", check=Range(low=0, low_open=True))

    def __post_init__(self) -> None:
        check_ranges(self, "warm_start")


@dataclass(kw_only=True)
class TrainerConfig:
    total_steps: int = _f(300, "RL steps (one rollout batch each)", check=Range(low=0))
    eval_every: int = _f(25, "evaluate held-out accuracy every k RL steps", check=Range(low=1))
    mismatch_report_every: int = _f(0, "log the rollout/trainer log-prob gap (mismatch/kl, max_abs, "
                                       "frac_over_1e-3) every k RL steps, recomputing the trainer's log-probs when "
                                       "the step has none; 0 = off (full causes: hybridrl doctor mismatch)",
                                    check=Range(low=0))
    seed: int = _f(0, "seed for model init, sampling and shuffling", check=SEED)
    device: str = _f("cpu", "cpu | cuda | cuda:N")
    threads: int = _f(0, "torch CPU threads; 0 = all cores", check=Range(low=0))
    output_dir: str = _f("runs", "parent of the run directory")
    run_name: str = _f("default", "run directory name under output_dir")
    max_nonfinite_steps: int = _f(5, "stop after this many consecutive steps skipped for a non-finite loss/gradient",
                                  check=Range(low=1))
    mode: str = _f("sync", "sync: sample, train, refit in turn | one_step_off: the batch of step k+1 is generated "
                           "with the weights of step k-1 while step k trains (refit between batches) | async: "
                           "rollout workers generate continuously, in-flight requests continue with each new "
                           "version (staleness bounded by pipeline.max_staleness)")

    def __post_init__(self) -> None:
        check_ranges(self, "trainer")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"trainer.device={self.device!r}: use cpu, cuda or cuda:N")
        if self.mode not in MODES:
            raise ConfigError(f"trainer.mode={self.mode!r}: use {' | '.join(MODES)}")
        name = self.run_name
        if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("~"):
            raise ConfigError(f"trainer.run_name={name!r}: must be a plain directory name inside "
                              "trainer.output_dir (no '/', '..' or absolute paths)")


MODES = ("sync", "one_step_off", "async")


@dataclass(kw_only=True)
class PipelineConfig:
    """How generation and training overlap when ``trainer.mode`` is one_step_off or async."""

    max_staleness: int = _f(1, "async: a sample whose generation started more than this many weight versions before "
                               "the update that trains it is never trained (generation is throttled, nothing is "
                               "discarded); 0 = synchronous. one_step_off is 1 by definition", check=Range(low=0))
    placement: str = _f("disaggregated", "disaggregated: each rollout worker is its own process with its own engine "
                                         "(weights by shared memory) | colocated: one worker thread in the trainer "
                                         "process, time-sharing its device")
    workers: int = _f(1, "disaggregated: rollout worker processes (whole prompt groups are spread over them)",
                      check=Range(low=1))
    worker_threads: int = _f(0, "disaggregated: torch CPU threads of each worker process; 0 = the cores this process "
                                "may run on split evenly between the trainer and the workers (the trainer then uses its "
                                "share, unless trainer.threads is set)", check=Range(low=0))
    worker_restarts: int = _f(1, "a rollout worker that dies is replaced this many times in a run (its groups are "
                                 "regenerated); then the job ends with the worker's exit", check=Range(low=0))
    timeout_s: float = _f(300.0, "every exchange with a rollout worker (requests, results, one refit bucket) "
                                 "fails within this many seconds instead of hanging", check=Range(low=0, low_open=True))

    def __post_init__(self) -> None:
        check_ranges(self, "pipeline")
        if self.placement not in ("disaggregated", "colocated"):
            raise ConfigError(f"pipeline.placement={self.placement!r}: use disaggregated or colocated")
        if self.placement == "colocated" and self.workers != 1:
            raise ConfigError(f"pipeline.workers={self.workers} with pipeline.placement=colocated: a colocated "
                              "worker is one thread of the trainer process; use workers=1 or disaggregated")


@dataclass(kw_only=True)
class CheckpointConfig:
    save: bool = _f(True, "write an HF-format checkpoint at the end")
    every: int = _f(100, "also checkpoint every k RL steps, bounding lost work (0 = only at the end)",
                    check=Range(low=0))
    keep_last: int = _f(2, "checkpoints kept in run_dir/checkpoints (older ones are pruned)", check=Range(low=1))
    resume: str = _f("auto", "auto: continue the run in run_dir from its latest checkpoint (a new run when the "
                             "directory is new) | off: refuse an existing run directory | PATH: a checkpoint dir")

    def __post_init__(self) -> None:
        check_ranges(self, "checkpoint")
        if not self.resume:
            raise ConfigError("checkpoint.resume='': use auto, off, or a checkpoint directory")


PLACEMENTS = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


@dataclass(kw_only=True)
class LauncherConfig:
    name: str = _f("local", "local (torch's elastic launcher / torchrun) | ray (Ray actors in a placement group)")
    nnodes: int = _f(1, "hosts of a multi-host job (torchrun --nnodes; used by `hybridrl plan`)", check=Range(low=1))
    nproc_per_node: int = _f(1, "data-parallel ranks to start on this host (FSDP2; gloo on CPU, NCCL on CUDA); "
                                "also set by torchrun", check=Range(low=1))
    num_workers: int = _f(1, "name=ray: data-parallel ranks (one Ray actor each)", check=Range(low=1))
    ray_address: str | None = _f(None, "name=ray: cluster address (auto = a running `ray start` cluster); "
                                       "null starts a local Ray instance")
    ray_placement: str = _f("PACK", "name=ray: placement strategy of the ranks' bundles (PACK | SPREAD | "
                                    "STRICT_SPREAD)")
    timeout_s: float = _f(300.0, "collective timeout: a failed rank takes the job down within it",
                          check=Range(low=0, low_open=True))

    @property
    def ranks(self) -> int:
        """Data-parallel ranks this launcher starts."""
        return self.num_workers if self.name == "ray" else self.nproc_per_node

    def __post_init__(self) -> None:
        if self.name not in ("local", "ray"):
            raise ConfigError(f"launcher.name={self.name!r}: use local or ray")
        check_ranges(self, "launcher")
        if self.ray_placement not in PLACEMENTS:
            raise ConfigError(f"launcher.ray_placement={self.ray_placement!r}: use {', '.join(PLACEMENTS)}")


@dataclass(kw_only=True)
class RefitConfig:
    bucket_mb: int = _f(64, "refit bucket size (MiB)", check=Range(low=1))
    verify: bool = _f(False, "check engine addresses and checksums after every refit")

    def __post_init__(self) -> None:
        check_ranges(self, "refit")
