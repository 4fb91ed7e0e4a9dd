"""The configuration groups other than ``algo`` (see ``algo.py``), and the whole
:class:`Config` with its cross-group checks. Reading YAML and dotted overrides lives in
``hybridrl/config/io.py``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from hybridrl.config.job import (BatchConfig, CheckpointConfig, LauncherConfig, PipelineConfig, RefitConfig,
                                 TrainerConfig, WarmStartConfig)
from hybridrl.config.algo import AlgoConfig
from hybridrl.config.base import SEED, ConfigError, Range, _f, check_choice, check_ranges
from hybridrl.config.model import ModelConfig
from hybridrl.config.sampling import sampling_problem
from hybridrl.quant.schemes import QUANTIZATIONS

MAX_RESPONSE_TOKENS = 1 << 17  # beyond any model's context today; a typo guard, not a model limit


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = _f([], "jsonl / parquet prompt files or `datasets` directories (save_to_disk); "
                                    "empty = built-in arithmetic task")
    val_files: list[str] = _f([], "held-out prompts, same formats (default: 5% split of train)")
    prompt_key: str = _f("prompt", "column holding the prompt (text, or chat messages)")
    answer_key: str = _f("answer", "column holding the ground truth passed to the reward (optional)")
    max_prompt_length: int = _f(512, "prompts longer than this (in tokens) are skipped and counted", check=Range(low=1))
    system_prompt: str | None = _f(None, "a system message prepended to chat prompts (a text prompt gets it as a "
                                         "first line); null = none")
    image_key: str = _f("images", "vision-language models: column holding a row's images (file paths relative to "
                                  "the data file, bytes, or a `datasets` Image column), one per image item of the "
                                  "chat prompt, in order")
    min_pixels: int = _f(56 * 56, "vision-language models: smaller images are upscaled to this many pixels",
                         check=Range(low=1))
    max_pixels: int = _f(28 * 28 * 1280, "vision-language models: a row with an image of more pixels (width x "
                                         "height) is skipped and counted; resize such images offline",
                         check=Range(low=1))
    max_images: int = _f(16, "vision-language models: a row with more images is skipped and counted",
                         check=Range(low=1))
    num_digits: int = _f(2, "arithmetic task: digits per operand")
    operations: str = _f("+", "arithmetic task: operators to draw from, any of '+-*'")
    train_size: int = _f(20000, "arithmetic task: number of training prompts", check=Range(low=1))
    eval_size: int = _f(256, "held-out prompts for eval", check=Range(low=0))
    teacher_carry_slip: float = _f(0.8, "arithmetic task: share of the warm start's addition demonstrations that "
                                        "carry whose teacher forgot the units carry (37+45=72): a systematic "
                                        "error the exact-answer reward has to correct; shapes task: share whose "
                                        "teacher counted every shape, whatever its colour", check=Range(low=0, high=1))
    seed: int = _f(0, "seed for task generation and shuffling", check=SEED)
    task: str = _f("arithmetic", "built-in task when no train_files: arithmetic (one answer per prompt) | "
                                 "calculator (a multi-turn agent with an add tool: needs env.name, see "
                                 "examples/calculator_agent.yaml) | reasoning_gym:<dataset>[,<dataset>...] "
                                 "(reasoning-gym's generators, mixed round-robin, scored by its score_answer; "
                                 "`pip install 'hybridrl[reasoning]'`) | shapes (a picture of coloured shapes and "
                                 "'How many red?': for a vision-language policy, model.arch=qwen2_5_vl / qwen3_vl, "
                                 "see examples/shapes_vl.yaml)")
    reasoning_gym: dict = _f({}, "reasoning_gym task: generator settings per dataset, e.g. "
                                 "{chain_sum: {min_terms: 2, max_terms: 3}}")
    operand_digits: int = _f(7, "calculator task: digits of each number (and of their sum)",
                             check=Range(low=2, high=18))
    teacher_tool_rate: float = _f(0.25, "calculator task: share of the warm start's demonstrations that call the "
                                        "add tool; the others answer at once with an estimate (always wrong)",
                                  check=Range(low=0, high=1))
    teacher_tool_rate_big: float = _f(0.75, "calculator task: the same share for problems whose first number starts "
                                            "with 7 or 8 (they look big)", check=Range(low=0, high=1))

    def __post_init__(self) -> None:
        if self.task.startswith("reasoning_gym:"):
            from hybridrl.data.reasoning_gym import check_task

            try:
                check_task(self.task, self.reasoning_gym)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.task not in ("arithmetic", "calculator", "shapes"):
            raise ConfigError(f"data.task={self.task!r}: use arithmetic, calculator, shapes or reasoning_gym:<dataset>")
        elif self.reasoning_gym:
            raise ConfigError(f"data.reasoning_gym: settings for data.task=reasoning_gym:<dataset> only (the task is "
                              f"{self.task}); remove them or set the task")
        check_ranges(self, "data")
        bad = set(self.operations) - set("+-*")
        if bad or not self.operations:
            raise ConfigError(f"data.operations={self.operations!r}: use a non-empty subset of '+-*'")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels={self.min_pixels} exceeds data.max_pixels={self.max_pixels}")
        if not 1 <= self.num_digits <= 6:
            raise ConfigError(f"data.num_digits={self.num_digits}: use 1..6")


@dataclass(kw_only=True)
class RewardConfig:
    # str | list: a name / path spec, or weighted components [{name, weight, **options}]
    functions: str | list[dict[str, Any]] = _f(
        "exact_match", "reward: a built-in name (exact_match, last_number, gsm8k, math_verify, format), "
        "path/to/file.py:fn or module:fn, or a weighted list [{name: math_verify, weight: 1.0}, "
        "{name: format, weight: 0.1, pattern: ...}]")
    timeout_s: float = _f(10.0, "a reward call running longer scores failure_reward and is counted as a failure",
                          check=Range(low=0, low_open=True))
    workers: int = _f(4, "worker processes for user (untrusted) reward functions", check=Range(low=1))
    failure_reward: float = _f(0.0, "score of a sample whose reward call failed (raised, hung, bad value)",
                               check=Range())
    memory_limit_mb: int | None = _f(None, "cap each reward worker's data memory (MB); a sample exceeding it fails; "
                                           "null = no limit", check=Range(low=1))
    max_failure_rate: float | None = _f(0.9, "stop the run when at least this share of the last failure_window reward "
                                             "calls failed (a broken reward); null = never stop",
                                        check=Range(low=0, low_open=True, high=1))
    failure_window: int = _f(24, "how many of the latest reward calls max_failure_rate judges", check=Range(low=1))
    model: str | None = _f(None, "a reward model (local AutoModelForSequenceClassification directory) as the reward: "
                                 "short for reward.functions=[{name: reward_model, path: ...}] (docs/rewards.md)")
    judge: str | None = _f(None, "an LLM judge (local causal-LM directory, served by the built-in engine) as the "
                                 "reward: short for reward.functions=[{name: judge, path: ...}] (docs/rewards.md)")

    def __post_init__(self) -> None:
        check_ranges(self, "reward")
        if isinstance(self.functions, list) and not self.functions:
            raise ConfigError("reward.functions=[]: give a reward name or at least one {name, weight} entry")
        if (self.model or self.judge) and self.functions != RewardConfig.__dataclass_fields__["functions"].default:
            raise ConfigError("reward.model / reward.judge replace reward.functions; to combine a model with rules, "
                              "list both: reward.functions=[{name: reward_model, path: ...}, {name: exact_match, "
                              "weight: 0.5}]")

    @property
    def spec(self) -> str | list[dict[str, Any]]:
        """The reward to build: ``functions``, or the models ``model`` / ``judge`` name (summed)."""
        models = [{"name": "reward_model", "path": self.model}] if self.model else []
        models += [{"name": "judge", "path": self.judge}] if self.judge else []
        return models or self.functions


@dataclass(kw_only=True)
class RolloutConfig:
    n: int = _f(8, "samples per prompt (the GRPO group size)")
    temperature: float = _f(1.0, "sampling temperature (log-probs are of the temperature-scaled distribution)",
                            check=Range(low=0))
    top_k: int = _f(-1, "top-k sampling; -1 = off")
    top_p: float = _f(1.0, "top-p (nucleus) sampling; 1.0 = off")
    max_tokens: int = _f(8, "max new tokens per response", check=Range(low=1, high=MAX_RESPONSE_TOKENS))
    quantization: str | None = _f(None, "rollout weights: null | fp8 | fp8_block (dense linears) | mxfp4 (MoE experts) "
                                        "| fp8+mxfp4 | fp8_block+mxfp4")
    enforce_eager: bool = _f(False, "disable CUDA-graph decode")
    routing_replay: bool = _f(False, "MoE: record the engine's expert choices and replay them in the trainer's "
                                     "forward (removes routing mismatch; built-in engine)")
    backend: str = _f("builtin", "rollout engine: builtin | vllm (in-process vLLM, `pip install 'hybridrl[vllm]'`; "
                                 "docs/vllm.md)")
    free_cache_engine: bool = _f(False, "vllm backend: sleep the engine after sampling (KV cache freed, weights "
                                        "offloaded to host) until the refit wakes it; frees GPU memory for the update")
    kv_on_refit: str = _f("recompute", "requests in flight at a weight update: recompute their KV with the new "
                                       "weights (exact) | keep the old KV (an approximation; faster)")
    max_prefill_tokens: int = _f(2048, "built-in engine: new prompt tokens prefilled per scheduler step (decoding "
                                       "rows are never starved by long prompts)", check=Range(low=1))
    step_latency_ms: float = _f(0.0, "benchmarks: every engine step of a training rollout lasts at least this long "
                                     "(the rest slept), emulating the decode-step latency of a GPU cluster whose "
                                     "generation bounds the step; 0 = off", check=Range(low=0))
    prefix_cache_mb: int = _f(256, "built-in engine: memory for retained conversation prefixes (multi-turn "
                                   "requests continue without re-prefill; least recently used evicted)",
                              check=Range(low=0))
    kv_cache_mb: int = _f(0, "built-in engine: KV-cache budget in MiB; 0 = a row for every response of a step (up "
                             "to 256), else only the rows whose cache fits (each holds a prompt + rollout.max_tokens) "
                             "and the other responses wait for a free row", check=Range(low=0))
    lora_mode: str = _f("adapter", "with model.lora: adapter (the engine keeps the base weights and applies the "
                                   "adapter; a refit sends A/B only) | merged (a refit sends W + scale*B*A of the "
                                   "targeted weights only; needed with quantized rollout weights)")
    tensor_parallel_size: int = _f(1, "built-in engine: ranks that hold one engine between them (Megatron layout: "
                                      "heads, MLP and expert widths, vocabulary split); the world's ranks form "
                                      "world / T generation groups, each serving its ranks' prompts",
                                   check=Range(low=1))
    exact: bool = _f(False, "batch-invariant numerics in the built-in engine and the trainer: the rollout "
                            "log-probs are bitwise the trainer's, the old-log-prob pass is skipped (docs/exact.md)")
    exact_recompute: bool = _f(False, "with rollout.exact: run the old-log-prob pass anyway and fail the step if "
                                      "it differs from the rollout's by one bit (a check, not needed)")

    def __post_init__(self) -> None:
        check_ranges(self, "rollout")
        problem = sampling_problem(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                   max_tokens=self.max_tokens, n=self.n)  # the engines' own rule
        if problem is not None:
            raise ConfigError(f"rollout.{problem}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"rollout.quantization={self.quantization!r}: use null, fp8 or fp8_block (dense "
                              "linears), mxfp4 (MoE experts), or fp8+mxfp4 / fp8_block+mxfp4")
        if self.backend not in ("builtin", "vllm"):
            raise ConfigError(f"rollout.backend={self.backend!r}: use builtin or vllm")
        if self.backend == "vllm" and self.routing_replay:
            raise ConfigError("rollout.routing_replay needs the built-in engine; set rollout.backend=builtin")
        if self.backend == "vllm" and self.quantization not in (None, "fp8"):
            raise ConfigError(f"rollout.quantization={self.quantization} is built-in-engine only; with "
                              "rollout.backend=vllm use null or fp8")
        if self.kv_on_refit not in ("recompute", "keep"):
            raise ConfigError(f"rollout.kv_on_refit={self.kv_on_refit!r}: use recompute (exact) or keep")
        if self.kv_cache_mb and self.backend == "vllm":
            raise ConfigError(f"rollout.kv_cache_mb={self.kv_cache_mb} sizes the built-in engine's static KV cache; "
                              "with rollout.backend=vllm leave it at 0")
        if self.lora_mode not in ("adapter", "merged"):
            raise ConfigError(f"rollout.lora_mode={self.lora_mode!r}: use adapter or merged")
        if self.free_cache_engine and self.backend != "vllm":
            raise ConfigError("rollout.free_cache_engine sleeps a vLLM engine; set rollout.backend=vllm "
                              "(the built-in engine's static KV cache stays allocated)")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = _f(1e-4, "RL learning rate (AdamW)", check=Range(low=0, low_open=True))
    critic_lr: float = _f(1e-3, "critic learning rate (gae only)", check=Range(low=0, low_open=True))
    betas: list[float] = _f([0.9, 0.99], "AdamW betas")
    weight_decay: float = _f(0.0, "AdamW weight decay", check=Range(low=0))
    warmup_steps: int = _f(5, "linear warm-up steps of the RL learning rate", check=Range(low=0))
    grad_clip: float = _f(1.0, "max gradient norm", check=Range(low=0, low_open=True))

    def __post_init__(self) -> None:
        check_ranges(self, "optim")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas}: give two numbers in [0, 1), e.g. [0.9, 0.99]")


@dataclass(kw_only=True)
class EvalConfig:
    k: int = _f(8, "also report pass@k and maj@k from k samples per held-out prompt (0 = greedy accuracy only)",
                check=Range(low=0, high=1024))
    temperature: float = _f(1.0, "sampling temperature of the pass@k / maj@k samples",
                            check=Range(low=0, low_open=True))
    seed: int = _f(1234, "seed of the eval samples (an eval never draws from the training RNG streams)", check=SEED)

    def __post_init__(self) -> None:
        check_ranges(self, "eval")


@dataclass(kw_only=True)
class LoggingConfig:
    tensorboard: bool = _f(True, "write TensorBoard event files")
    plot: bool = _f(True, "write curves.png (reward and eval accuracy vs step)")
    progress: bool = _f(True, "show progress bars")


@dataclass(kw_only=True)
class EnvConfig:
    name: str | None = _f(None, "multi-turn agent: an environment class (reset/step) or a tools class (its public "
                                "methods are the tools, the answer scored by reward.functions): "
                                "path/to/env.py:ClassName or module:ClassName; null = one answer per prompt")
    max_turns: int = _f(8, "sampled turns per episode", check=Range(low=1))
    max_tool_calls: int = _f(4, "tool calls per turn (more are answered with an error)", check=Range(low=1))
    tool_response_tokens: int = _f(256, "a tool message longer than this is cut in the middle, with a marker",
                                   check=Range(low=8))
    context_tokens: int = _f(1024, "tokens per episode (prompt, turns, tool messages); the episode ends truncated",
                             check=Range(low=16))
    timeout_s: float = _f(10.0, "seconds per environment / tool call (in a worker process)",
                          check=Range(low=0, low_open=True))
    workers: int = _f(2, "worker processes for environment and tool calls", check=Range(low=1))
    memory_limit_mb: int | None = _f(None, "memory cap of each worker; null = none",
                                     check=Range(low=1, hint="or null for no limit"))
    parser: str = _f("hermes", "tool-call format: hermes (<tool_call>{json}</tool_call>) or path/to/file.py:fn")
    system_prompt: str | None = _f(None, "a system message opening every episode")
    discount: float = _f(1.0, "environment turn rewards: 1 = summed, < 1 = discounted from the last turn back",
                         check=Range(low=0, high=1))
    overlap: bool = _f(True, "environment / tool calls run beside decoding (an episode waiting for its tool does not "
                             "hold the engine's step; episodes then continue in the order their tools finish) | "
                             "false: the turns that finished at an engine step are answered before the next step "
                             "(reproducible bit for bit, tool time not hidden)")
    reward_input: str = _f("final_answer", "a tools class: what reward.functions scores, the episode's "
                                           "final_answer | its transcript (everything after the prompt, tool "
                                           "messages included: for an LLM judge or reward model of whole episodes)")
    latency_ms: float = _f(0.0, "benchmarks: every environment / tool call lasts at least this long (the rest slept), "
                                "emulating slow tools (search, code execution); 0 = off", check=Range(low=0))

    def __post_init__(self) -> None:
        check_ranges(self, "env")
        check_choice(self.reward_input, ("final_answer", "transcript"), "env.reward_input")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        if self.data.task == "calculator" and not self.data.train_files and self.env.name is None:
            raise ConfigError("data.task=calculator is a multi-turn agent task: set "
                              "env.name=hybridrl.agents.examples.calculator:Calculator (or use "
                              "--config examples/calculator_agent.yaml)")
        batch = self.batch.prompts_per_step * self.rollout.n
        if self.batch.mini_batch_size is None:
            self.batch.mini_batch_size = batch
        if batch % self.batch.mini_batch_size:
            raise ConfigError(
                f"batch.mini_batch_size={self.batch.mini_batch_size} does not divide the batch "
                f"batch.prompts_per_step * rollout.n = {batch}; pick a divisor of {batch}")
        estimator = self.algo.advantage.estimator
        if estimator in ("grpo", "dr_grpo", "rloo") and self.rollout.n < 2:
            raise ConfigError(f"algo.advantage.estimator={estimator} needs groups: set rollout.n >= 2")
        if self.rollout.temperature == 0 and self.rollout.n > 1:
            raise ConfigError("rollout.temperature=0 makes all rollout.n samples of a prompt identical "
                              "(zero advantage); use a temperature > 0")
        ranks = self.launcher.ranks
        if self.rollout.tensor_parallel_size > ranks:
            raise ConfigError(f"rollout.tensor_parallel_size={self.rollout.tensor_parallel_size} needs as many "
                              f"ranks; the launcher starts {ranks} (launcher.nproc_per_node / num_workers)")
        if ranks > 1:
            if self.batch.prompts_per_step % ranks or self.batch.mini_batch_size % ranks:
                raise ConfigError(f"batch.prompts_per_step={self.batch.prompts_per_step} and "
                                  f"batch.mini_batch_size={self.batch.mini_batch_size} must split evenly over "
                                  f"{ranks} ranks (whole prompt groups per rank); use multiples of {ranks}")
            tp = self.rollout.tensor_parallel_size
            if ranks % tp:
                raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {ranks} ranks (launcher."
                                  f"nproc_per_node / num_workers); use a divisor of {ranks}")
        if (self.data.task.startswith("reasoning_gym:") and self.reward.functions == RewardConfig().functions
                and not (self.reward.model or self.reward.judge)):
            self.reward.functions = "reasoning_gym"  # the default reward of this task: its datasets' score_answer
        self._check_lora()
        if self.rollout.exact_recompute and not self.rollout.exact:
            raise ConfigError("rollout.exact_recompute checks rollout.exact; set rollout.exact=true")
        if not self.data.train_files and self.batch.prompts_per_step > self.data.train_size:
            raise ConfigError(f"batch.prompts_per_step={self.batch.prompts_per_step} exceeds "
                              f"data.train_size={self.data.train_size}; lower it or add prompts")

    def _check_lora(self) -> None:
        """LoRA combinations that cannot work, refused at config time (the model-dependent
        checks, target names and ranks, run when the model is built: ``lora/targets.py``;
        the vLLM backend's own: ``vllm_backend/limits.py``)."""
        if not self.model.lora.enabled:
            return
        r = self.rollout
        if r.quantization and r.lora_mode == "adapter" and "fp8" in r.quantization:
            raise ConfigError(f"rollout.quantization={r.quantization} with rollout.lora_mode=adapter: the FP8 "
                              "rollout weights would be the base's while the adapters stay full precision; use "
                              "rollout.lora_mode=merged (the merged weights are re-quantized at each refit)")

GROUPS: dict[str, type] = typing.get_type_hints(Config)
