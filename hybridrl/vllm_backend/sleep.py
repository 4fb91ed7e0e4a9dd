"""GPU colocation: vLLM sleeps through the trainer's update (``free_cache_engine``).

One GPU holds the trainer and the rollout engine. While the trainer computes log-probs and
updates, vLLM's KV cache (most of its memory) is not needed, so the engine sleeps
(``LLM.sleep(level=1)``: weights copied to host memory, KV cache released). The refit then
wakes it in the order the weight update needs:

    sleep(level=1)  ->  [trainer update]  ->  wake_up(["weights"])  ->  reload_weights (refit)
                    ->  wake_up(["kv_cache"])  ->  reset_prefix_cache  ->  generate

Weights wake first: the reload writes into their storage (vLLM's CuMemAllocator maps them
back at the same virtual addresses, so captured CUDA graphs stay valid). The KV cache wakes
last: nothing reads it during the update, and its contents are stale anyway.
Level 1, not 2: level 2 discards the weights, and a parameter vLLM holds that the trainer
does not send would come back as garbage; level 1 costs one host copy of the weights.

vLLM only enables sleep mode on CUDA / ROCm / XPU (``enable_sleep_mode``; ValueError
elsewhere). On CPU the engine still calls ``sleep`` / ``wake_up`` — vLLM's CPU worker logs
and ignores them, but its scheduler pauses on sleep and resumes on the last wake-up, so the
order is exercised for real. A paused scheduler never runs a request (``LLM.generate`` would
wait forever): ``generate`` wakes the engine first and checks vLLM agrees
(:meth:`EngineSleep.ensure_awake`).
"""

from __future__ import annotations

from typing import Any

from hybridrl.vllm_backend.isolation import preserve_torch_state

SLEEP_LEVEL = 1
TAGS = ("weights", "kv_cache")  # vLLM's sleep tags, in wake-up order


class EngineSleep:
    """Which of the engine's memory is asleep; the only caller of ``llm.sleep`` / ``wake_up``."""

    def __init__(self, llm: Any, enabled: bool):
        self.llm, self.enabled = llm, enabled
        self.asleep: set[str] = set()

    def sleep(self) -> None:
        """Release the KV cache and offload the weights (no-op when disabled or asleep)."""
        if not self.enabled or self.asleep:
            return
        with preserve_torch_state():
            self.llm.sleep(level=SLEEP_LEVEL)
        self.asleep = set(TAGS)

    def wake(self, *tags: str) -> None:
        """Wake ``tags`` (default: all) in the order of :data:`TAGS`; awake ones are skipped."""
        for tag in TAGS:
            if tag in self.asleep and (not tags or tag in tags):
                with preserve_torch_state():
                    self.llm.wake_up(tags=[tag])
                self.asleep.discard(tag)

    def ensure_awake(self) -> None:
        """Wake everything, then make sure vLLM's scheduler runs (else a request never would)."""
        self.wake()
        if self.llm.llm_engine.is_sleeping():
            raise RuntimeError("VllmEngine: vLLM still reports sleeping after wake_up of every tag; "
                               "a generate would wait forever")
