"""Exact on-policy rollouts (``rollout.exact``): batch-invariant numerics shared by the
trainer and the rollout, so the engine's log-probs are bitwise the trainer's.

- ``ops.py``: the batch-invariant torch function mode (row-padded GEMMs, SIMD-path
  transcendentals, pieced vocabulary reductions) and its probe;
- ``attention.py``: block-ordered causal attention, registered with transformers for the
  trainer and called by the built-in engine's exact layers (``EngineSpec.exact``).
"""

from hybridrl.exact.ops import BatchInvarianceError, batch_invariant, check_batch_invariance

__all__ = ["BatchInvarianceError", "batch_invariant", "check_batch_invariance"]
