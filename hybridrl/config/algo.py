"""The ``algo`` group: one nested dataclass per concern, each handed to the component
that uses it (``advantage`` → the advantage phase, ``policy_loss`` and ``kl`` → the Actor,
``value`` → the Critic, ``correction`` and ``dapo`` → the step's correction phases).

``loss_agg_mode`` is the one aggregation every loss of the step uses (policy, KL,
entropy, value): a single key, read by the Actor and the Critic alike.
Published recipes live in ``presets.py`` (``algo.preset=gspo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.base import ConfigError, Range, _f, check_choice, check_ranges


@dataclass(kw_only=True)
class AdvantageConfig:
    estimator: str = _f("grpo", "grpo | dr_grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | gae")
    norm_by_std: bool = _f(True, "grpo: divide by the group std")
    gamma: float = _f(1.0, "discount (gae, reinforce_plus_plus)", check=Range(low=0, high=1))
    lam: float = _f(1.0, "GAE lambda", check=Range(low=0, high=1))

    def __post_init__(self) -> None:
        from hybridrl.algos import ADV_ESTIMATORS

        check_choice(self.estimator, ADV_ESTIMATORS, "algo.advantage.estimator")
        check_ranges(self, "algo.advantage")


@dataclass(kw_only=True)
class PolicyLossConfig:
    name: str = _f("vanilla", "vanilla (PPO clip; dual clip via clip_ratio_c, DAPO clip-higher via clip_ratio_high) | gspo | cispo | reinforce")
    clip_ratio_low: float = _f(0.2, "clip epsilon (lower side)", check=Range(low=0))
    clip_ratio_high: float = _f(0.2, "clip epsilon (upper side; > low = DAPO clip-higher)", check=Range(low=0))
    clip_ratio_c: float | None = _f(3.0, "dual-clip constant c (> 1); null = dual clip off (vanilla only)",
                                    check=Range(low=1, low_open=True, hint="dual clip needs c > 1, or null for off"))
    entropy_coeff: float = _f(0.0, "entropy bonus coefficient", check=Range())

    def __post_init__(self) -> None:
        from hybridrl.algos import POLICY_LOSSES

        check_choice(self.name, POLICY_LOSSES, "algo.policy_loss.name")
        check_ranges(self, "algo.policy_loss")


@dataclass(kw_only=True)
class KLConfig:
    coef: float = _f(0.0, "KL coefficient (0 = no reference model)", check=Range(low=0))
    estimator: str = _f("k3", "k1 | k2 | k3 | abs | low_var_kl | mse")
    use_loss: bool = _f(True, "KL as a loss term (true) or a reward penalty (false)")
    adaptive_target: float | None = _f(None, "reward-penalty KL: target KL for the adaptive controller; null = fixed",
                                       check=Range(low=0, low_open=True))
    horizon: int = _f(10000, "adaptive KL controller horizon (samples)", check=Range(low=1))

    def __post_init__(self) -> None:
        from hybridrl.algos import KL_ESTIMATORS

        check_choice(self.estimator, KL_ESTIMATORS, "algo.kl.estimator")
        check_ranges(self, "algo.kl")
        if self.adaptive_target is not None and (self.use_loss or self.coef == 0):
            raise ConfigError("algo.kl.adaptive_target applies to the KL reward penalty: set algo.kl.use_loss=false "
                              "and algo.kl.coef > 0, or remove it")


@dataclass(kw_only=True)
class CorrectionConfig:
    """Off-policy correction for the rollout/trainer mismatch."""

    tis_cap: float | None = _f(None, "truncated importance sampling cap C; null = off",
                               check=Range(low=0, low_open=True, hint="typical 2.0, or null"))
    mismatch_seq_upper: float | None = _f(None, "mask sequences whose trainer/rollout geometric-mean ratio exceeds this; null = off",
                                          check=Range(low=0, low_open=True))
    mismatch_seq_lower: float | None = _f(None, "lower bound of that ratio (default 1/upper)",
                                          check=Range(low=0, low_open=True))
    decoupled: bool = _f(True, "trainer.mode one_step_off/async, a batch with tokens of older versions: decoupled "
                               "PPO (clip around the proximal policy = the weights at the start of the update, "
                               "recomputed; each token weighted by min(pi_prox / pi_behaviour, decoupled_cap)); "
                               "false = no correction, stale tokens treated as on-policy (for comparison)")
    decoupled_cap: float = _f(2.0, "cap of the behaviour -> proximal importance weight (tis_cap, when set, is the "
                                   "same weight and wins)", check=Range(low=0, low_open=True))

    def __post_init__(self) -> None:
        check_ranges(self, "algo.correction")
        if self.mismatch_seq_lower is not None and self.mismatch_seq_upper is None:
            raise ConfigError("algo.correction.mismatch_seq_lower needs algo.correction.mismatch_seq_upper "
                              "(the masking is off without it)")


@dataclass(kw_only=True)
class DapoConfig:
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal")
    refill_rounds: int = _f(0, "extra sampling rounds to refill the batch with informative groups (0 = no refill)",
                            check=Range(low=0))
    overlong_filter: bool = _f(False, "mask truncated responses out of the loss")
    overlong_buffer_len: int = _f(0, "overlong reward shaping buffer (tokens); 0 = off", check=Range(low=0))
    overlong_penalty_factor: float = _f(1.0, "overlong penalty at the max length", check=Range(low=0))

    def __post_init__(self) -> None:
        check_ranges(self, "algo.dapo")
        if self.refill_rounds and not self.dynamic_sampling:
            raise ConfigError("algo.dapo.refill_rounds needs algo.dapo.dynamic_sampling=true")


@dataclass(kw_only=True)
class DistillConfig:
    """On-policy distillation (docs/rewards.md): a teacher scores every sampled token."""

    teacher: str | None = _f(None, "local checkpoint directory of the teacher (same tokenizer as the policy); "
                                   "null = no distillation")
    mode: str = _f("advantage", "advantage: log pi_teacher - log pi_student per token as the advantage (Thinking "
                                "Machines / slime) | loss: TRL's generalized JSD over the vocabulary as a loss term")
    coef: float = _f(1.0, "weight of the distillation advantage (or loss term)", check=Range(low=0, low_open=True))
    reward_coef: float = _f(0.0, "weight of the reward's advantages next to it (0 = distillation alone; rewards "
                                 "are still scored and logged)", check=Range(low=0))
    beta: float = _f(0.5, "mode=loss: generalized JSD interpolation, 0 = KL(teacher||student), 1 = "
                          "KL(student||teacher)", check=Range(low=0, high=1))
    dtype: str = _f("float32", "the teacher engine's dtype: float32 | bfloat16")
    quantization: str | None = _f(None, "the teacher engine's weights: null | fp8 | fp8_block (a larger teacher)")

    def __post_init__(self) -> None:
        check_choice(self.mode, ("advantage", "loss"), "algo.distill.mode")
        check_choice(self.dtype, ("float32", "bfloat16"), "algo.distill.dtype")
        check_ranges(self, "algo.distill")

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype`` (torch imported on first use: configs stay light)."""
        import torch

        return getattr(torch, self.dtype)


@dataclass(kw_only=True)
class ValueConfig:
    """The critic's value loss (``advantage.estimator=gae``)."""

    cliprange: float = _f(0.2, "PPO value clip", check=Range(low=0, low_open=True))

    def __post_init__(self) -> None:
        check_ranges(self, "algo.value")


@dataclass(kw_only=True)
class AlgoConfig:
    preset: str | None = _f(None, "published recipe setting the paper's defaults: grpo | dr_grpo | dapo | gspo | rlhf_ppo "
                                  "(keys given explicitly still win)")
    loss_agg_mode: str = _f("token-mean", "token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | "
                                          "seq-mean-token-sum-norm (every loss: policy, KL, entropy, value)")
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    dapo: DapoConfig = field(default_factory=DapoConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    router_aux_loss_coef: float = _f(0.0, "MoE: weight of the router load-balancing loss (0 = off)", check=Range(low=0))

    def __post_init__(self) -> None:
        from hybridrl.algos import LOSS_AGG_MODES
        from hybridrl.config.presets import PRESETS

        check_choice(self.loss_agg_mode, LOSS_AGG_MODES, "algo.loss_agg_mode")
        check_ranges(self, "algo")
        if self.preset is not None:
            check_choice(self.preset, PRESETS, "algo.preset")
