"""Episodes on the vLLM backend (its request API: continued turns, retained requests): the
trained ids are vLLM's sampled ids turn by turn, the mask is 0 exactly on environment spans,
and transformers' log-probs of the sampled tokens equal vLLM's."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from _vllm_helpers import SKIP_NO_VLLM

from hybridrl.agents.chat_render import ChatRenderer, check_template
from hybridrl.agents.env_pool import EnvPool
from hybridrl.agents.episodes import EpisodeLimits, EpisodeRunner
from hybridrl.refit import refit_from_model
from hybridrl.rollout import SamplingParams

pytestmark = SKIP_NO_VLLM
# roles as the alphabet allows: user "=", tool "-", assistant "*"; <eos> ends every turn
TEMPLATE = ("{%- for m in messages %}{{ {'user': '=', 'tool': '-', 'assistant': '*'}[m.role] + m.content + '<eos>' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{ '*' }}{%- endif %}")


def test_episodes_on_vllm_are_token_in_token_out(engine, tiny_checkpoint):
    _, tok, model = tiny_checkpoint
    tok = __import__("copy").deepcopy(tok)
    tok.chat_template = TEMPLATE
    refit_from_model(engine, model)
    renderer = ChatRenderer(tok)
    check_template(renderer)
    assert renderer.end_of_turn_id == tok.eos_token_id

    outputs = {}
    step = engine.step

    class Recording:  # vLLM's outputs as they come, to compare with the trajectories
        def __getattr__(self, name):
            return getattr(engine, name)

        def step(self):
            out = step()
            outputs.update({o.request_id: o for o in out.finished})
            return out

    with EnvPool(str(Path(__file__).parent / "countdown_env.py") + ":Countdown", workers=1, timeout_s=10) as pool:
        runner = EpisodeRunner(Recording(), pool, renderer, tok,
                               SamplingParams(temperature=1.0, max_tokens=4, stop_token_ids=(tok.eos_token_id,)),
                               EpisodeLimits(max_turns=3))
        rows = [{"prompt": p} for p in ("12+3", "7*8")]
        trajs = runner.run(rows, n=2, seeds=[random.randrange(1 << 30) for _ in rows])
    assert len(trajs) == 4
    for t in trajs:
        mask = [0] * len(t.ids)
        for k, (a, b) in enumerate(t.turns):
            out = outputs[f"{t.episode_id}/t{k}"]
            assert t.ids[a:b] == out.token_ids and t.versions[a:b] == out.token_versions
            mask[a:b] = [1] * (b - a)
        assert t.loss_mask == mask
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([t.ids])).logits.double(), dim=-1)[0]
        sel = torch.tensor(t.loss_mask, dtype=torch.bool)
        ours = logp[:-1].gather(-1, torch.tensor(t.ids[1:])[:, None])[:, 0][sel[1:]]
        torch.testing.assert_close(ours, torch.tensor(t.logprobs, dtype=torch.float64)[sel], rtol=0, atol=1e-4)
    assert not engine.has_unfinished_requests()
