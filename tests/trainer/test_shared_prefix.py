"""Shared-prefix log-probs == the plain padded forward (values and gradients)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy
from hybridrl.trainer.shared_prefix import shared_prefix_logprobs_entropy


def _batch(seed: int, n_groups: int = 4, n: int = 3, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    rows, plen, group = [], [], []
    for gi in torch.randperm(n_groups, generator=g).tolist():  # group ids not in row order
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            resp = torch.randint(3, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            rows.append(prompt + resp)
            plen.append(len(prompt))
            group.append(gi)
    perm = torch.randperm(len(rows), generator=g).tolist()  # shuffled like a mini-batch
    rows, plen, group = [rows[i] for i in perm], [plen[i] for i in perm], [group[i] for i in perm]
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    rm = torch.zeros(len(rows), L)
    for i, (r, p) in enumerate(zip(rows, plen)):
        ids[i, :len(r)] = torch.tensor(r)
        am[i, :len(r)] = 1
        rm[i, p:len(r)] = 1
    return ids, am, rm, torch.tensor(plen), torch.tensor(group)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_plain_forward_and_gradients(seed):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).float()
    ids, am, rm, plen, group = _batch(seed)
    w = torch.randn(ids.shape)
    lp_ref, ent_ref = compute_logprobs_entropy(model, ids, am, rm,
                                               options=ForwardOptions(temperature=0.8, packed=False))
    (lp_ref * w).sum().add((ent_ref * w).sum()).backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = shared_prefix_logprobs_entropy(model, ids, am, rm, plen, group, temperature=0.8)
    (lp * w).sum().add((ent * w).sum()).backward()
    torch.testing.assert_close(lp, lp_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_ref[n], rtol=1e-3, atol=1e-5, msg=n)
