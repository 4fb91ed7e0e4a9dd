"""The on-policy distillation teacher (``algo.distill.teacher``): a checkpoint served by the
built-in engine, scoring the student's sampled tokens with a prefill (no sampling, no KV
cache kept) at the rollout temperature.

Built whole from ``algo.distill`` and the policy's tokenizer. The teacher's weights are
loaded once and never refit (it does not train). Its vocabulary must be the student's:
distillation scores the student's token ids, so a teacher that reads them as other text
would teach nonsense; a tokenizer mismatch is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridrl.algos.distill import next_token_log_probs
from hybridrl.attention.packing import make_microbatches


class Teacher:
    """Teacher log-probs ``[B, L]`` (and full logits, for the divergence loss) on the student's rows."""

    def __init__(self, engine: Any, *, temperature: float, max_tokens_per_microbatch: int):
        """``engine``: a built-in ``RolloutEngine`` holding the teacher (its ``logits`` pass)."""
        self.engine, self.temperature = engine, temperature
        self.max_tokens = max_tokens_per_microbatch

    @classmethod
    def from_config(cls, distill, tokenizer, *, temperature: float, max_seq_len: int, device,
                    max_tokens_per_microbatch: int) -> "Teacher":
        """From ``cfg.algo.distill`` (teacher path, dtype, quantization); ``tokenizer`` is the
        policy's; ``max_seq_len`` the longest row the student's engine produces."""
        from hybridrl.rollout.backend import EngineSpec
        from hybridrl.rollout.engine import RolloutEngine

        where = f"algo.distill.teacher={distill.teacher}"
        path = Path(distill.teacher)
        if not (path / "config.json").is_file():
            raise ValueError(f"{where}: no Hugging Face checkpoint there (no config.json); give a local model "
                             "directory (e.g. a run's checkpoint/)")
        check_same_tokenizer(path, tokenizer, where)
        spec = EngineSpec(max_batch_size=1, max_seq_len=max_seq_len, dtype=distill.torch_dtype, device=device,
                          quantization=distill.quantization)
        engine = RolloutEngine.from_pretrained(str(path), spec)
        vocab = engine.hf_config.vocab_size
        if vocab < len(tokenizer):
            raise ValueError(f"{where}: the teacher's vocab_size {vocab} is smaller than the policy tokenizer's "
                             f"{len(tokenizer)} tokens; distill from a teacher with the student's vocabulary")
        return cls(engine, temperature=temperature, max_tokens_per_microbatch=max_tokens_per_microbatch)

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` float32 teacher log-probs of each response token at the rollout
        temperature (aligned like ``Rollouts.logprobs``; 0 where ``response_mask`` is 0), in
        token-budgeted micro-batches of right-padded rows."""
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        for rows in make_microbatches(attention_mask.sum(-1).tolist(), self.max_tokens):
            width = int(attention_mask[rows].sum(-1).max())
            ids, mask = input_ids[rows, :width], attention_mask[rows, :width]
            lp = next_token_log_probs(self.engine.logits(ids, mask), ids.to(self.engine.device), self.temperature)
            out[rows, :width] = lp.to(out.device)
        return out * response_mask

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, S, V_student]`` float32 teacher logits (the columns past the student's
        vocabulary, padding of the teacher's embedding, dropped)."""
        return self.engine.logits(input_ids, attention_mask).to(input_ids.device)


def check_same_tokenizer(path: Path, tokenizer, where: str) -> None:
    """Refuse a teacher whose saved tokenizer maps any token to another id than the student's."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: cannot load the teacher's tokenizer ({type(e).__name__}); on-policy distillation "
                         "needs the teacher saved with its tokenizer (the student's)") from None
    ours, other = tokenizer.get_vocab(), theirs.get_vocab()
    differ = sum(other.get(tok) != i for tok, i in ours.items()) + len(set(other) - set(ours))
    if differ:
        raise ValueError(f"{where}: the teacher's tokenizer differs from the policy's ({differ} of {len(ours)} "
                         "tokens map elsewhere); the teacher scores the student's token ids, so both need the same "
                         "tokenizer")


class Distiller:
    """``algo.distill`` over a :class:`Teacher`: the step asks it for the distillation
    advantages (``mode=advantage``; the batch source's groups carry the teacher's log-probs,
    scored as each group finished), the actor for the divergence loss (``mode=loss``: the
    teacher's full distributions, per micro-batch of the update)."""

    def __init__(self, teacher: Teacher, distill):
        self.teacher, self.cfg = teacher, distill

    @property
    def as_loss(self) -> bool:
        return self.cfg.mode == "loss"

    def advantages(self, advantages: torch.Tensor, rollouts, teacher_log_prob: torch.Tensor | None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
        """``reward_coef * advantages`` (the reward's), plus in ``mode=advantage`` ``coef *
        (log pi_teacher - log pi_student)`` per response token, the student's log-probs being
        the sampling ones (the behaviour policy's, at the rollout temperature).
        ``teacher_log_prob`` ``[B, L]``: the batch source's (each group scored as it finished);
        None: scored here."""
        from hybridrl.algos import masked_mean
        from hybridrl.algos.distill import reverse_kl_advantages

        out = self.cfg.reward_coef * advantages
        if self.as_loss:
            return out, {}
        mask = rollouts.response_mask
        teacher = teacher_log_prob if teacher_log_prob is not None else self.teacher.log_probs(
            rollouts.input_ids, rollouts.attention_mask, mask)
        signal = reverse_kl_advantages(rollouts.logprobs, teacher, mask)
        return out + self.cfg.coef * signal, {"distill/reverse_kl": float(masked_mean(-signal, mask)),
                                              "distill/teacher_log_prob": float(masked_mean(teacher, mask))}

    def loss(self, model: torch.nn.Module, micro: dict[str, torch.Tensor], aggregate) -> torch.Tensor:
        """``coef`` x the generalized JSD between the student's and the teacher's next-token
        distributions on the micro-batch's response tokens, aggregated by ``aggregate(values,
        mask)`` (the run's ``loss_agg_mode``). One more student forward (full logits)."""
        from hybridrl.algos.distill import shifted_jsd

        ids, mask = micro["input_ids"], micro["attention_mask"]
        student = model(input_ids=ids, attention_mask=mask).logits
        teacher = self.teacher.logits(ids, mask)[..., :student.shape[-1]]
        jsd = shifted_jsd(student, teacher, beta=self.cfg.beta, temperature=self.teacher.temperature)
        return self.cfg.coef * aggregate(jsd, micro["response_mask"])
