"""Vision-language models: rollout throughput, the trainer step's image cost and prefix reuse
of a multimodal conversation, on a small random Qwen2.5-VL (and Qwen3-VL in full mode).

Model: the built-in ``model.arch`` (``job/model_factory.py``) with a language model of hidden
256, 4 layers, 4 heads, 2 KV heads, MLP 768, and the built-in vision tower (hidden 64, depth 2,
patch 14 / 16, merge 2); weights drawn as in the tests (far from uniform logits), float32.
Prompts are rendered by ``VLPromptRenderer`` (the built-in VL chat tokenizer, transformers'
Qwen2-VL image processor): a ``data/shapes.py`` board picture (56, 84 or 112 px, cycled) and
a question. Threads: torch's default for every side.

Rows:
- ``tokens/s``: ``RolloutEngine.generate`` vs transformers ``generate`` at batch 1 and 16, each
  prompt with one image; temperature 1, no stop token, every row generates the full T new
  tokens (HF: ``min_new_tokens = max_new_tokens``, ``eos_token_id=None``), HF on a left-padded
  batch with ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids`` from
  ``hf_vision_kwargs``; interleaved, best of R after a warm-up call. Once, untimed: greedy
  tokens of both sides at batch 1 must agree (a warning is printed if not).
- ``step s``: one forward + backward of ``compute_logprobs_entropy`` (packed, default
  options) over 16 rows of prompt + response, each row with its image (``RowImages``) vs
  the same rows with every vision token replaced by ordinary text tokens and no images
  (same lengths): what the images cost the trainer.
- ``TTFT ms`` (time to first token: ``add_request`` to the step that returns it, max_tokens=1)
  of turn 2 of a conversation whose turn 1 (two pictures) finished with ``retain=True``:
  ``parent=`` turn 1 (its KV and image features reused, only the new text prefilled) vs the
  same ids and images added without a parent (full re-prefill, images encoded again). And
  ``patches encoded`` per turn-2 request, read from the engine's vision-tower counter.

    python benchmarks/vlm.py [--quick] [--json PATH]

``--quick``: Qwen2.5-VL only, T = 16, best of 3 rounds; full: Qwen2.5-VL and Qwen3-VL, T = 64,
best of 5 (TTFT: 5 / 9). Both run in well under a minute on 2 shared cores.
"""

from __future__ import annotations

import random
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_times, parse_args, report, row  # noqa: E402

from hybridrl.config import ModelConfig  # noqa: E402
from hybridrl.data.shapes import COLOURS, draw_board  # noqa: E402
from hybridrl.data.vision import ImageInputs, RowImages, VisionTokens, hf_vision_kwargs  # noqa: E402
from hybridrl.data.vl_prompts import VLPromptRenderer  # noqa: E402
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer  # noqa: E402
from hybridrl.refit.transport import named_trainer_tensors  # noqa: E402
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams  # noqa: E402
from hybridrl.trainer.forward import compute_logprobs_entropy  # noqa: E402

LANGUAGE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=768)
SIZES = (56, 84, 112)  # picture sides in pixels, cycled over the prompts
MAX_PIXELS = 160 * 160  # above the largest resized picture (Qwen3-VL: 112 px -> 128 px)
TEXT = "abcdefghijklmnopqrstuvwxyz ?"  # ordinary text tokens (responses, the text-only rows)


@dataclass
class VL:
    """A model and what renders its prompts."""

    name: str
    hf: torch.nn.Module
    tokenizer: object
    renderer: VLPromptRenderer

    @property
    def tokens(self) -> VisionTokens:
        return self.renderer.tokens

    def text_ids(self) -> list[int]:
        return self.tokenizer.encode(TEXT, add_special_tokens=False)


def make_vl(arch: str, seed: int = 0, **language) -> VL:
    """The built-in ``arch`` at ``LANGUAGE`` sizes (``language`` overrides), weights as the tests draw them."""
    tok = builtin_tokenizer(arch)
    hf = builtin_model(tok, ModelConfig(arch=arch, **{**LANGUAGE, **language}), seed=seed,
                       max_position_embeddings=1024)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 if "embed_tokens" in name else 0.1))
    renderer = VLPromptRenderer.for_model(tok, hf.config, min_pixels=SIZES[0] ** 2, max_pixels=MAX_PIXELS)
    return VL(arch, hf.float().eval(), tok, renderer)


def picture(rng: random.Random, side: int):
    shapes = [rng.choice(list(COLOURS)) for _ in range(rng.randint(1, 6))]
    return draw_board(rng, shapes, cells=4, cell=side // 4)


def vl_prompts(vl: VL, count: int, seed: int = 0, n_images: int = 1) -> list[tuple[list[int], ImageInputs]]:
    """``count`` rendered prompts ``(ids, images)``, each ``n_images`` pictures and a question."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        pics = [picture(rng, SIZES[(i + k) % len(SIZES)]) for k in range(n_images)]
        question = {"type": "text", "text": f"How many {rng.choice(list(COLOURS))}?"}
        content = [{"type": "image"} for _ in pics] + [question]
        out.append(vl.renderer.render([{"role": "user", "content": content}], pics))
    return out


def left_padded(vl: VL, rows: list[tuple[list[int], ImageInputs]]) -> dict[str, torch.Tensor]:
    """transformers' batch: left-padded ids, mask and the rows' vision kwargs."""
    L, pad = max(len(ids) for ids, _ in rows), vl.tokenizer.pad_token_id
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (x, _) in enumerate(rows):
        ids[b, L - len(x):], mask[b, L - len(x):] = torch.tensor(x), 1
    return dict(input_ids=ids, attention_mask=mask, **hf_vision_kwargs(ids, [im for _, im in rows], vl.tokens))


def hf_name(vl: VL) -> str:
    attn = getattr(vl.hf.config, "_attn_implementation", None) or "default"
    return f"transformers {transformers.__version__} generate (dynamic cache, {attn}), same model/images/dtype/threads"


def make_engine(vl: VL, batch: int, max_seq_len: int) -> RolloutEngine:
    engine = RolloutEngine(vl.hf.config, EngineSpec(max_batch_size=batch, max_seq_len=max_seq_len, dtype=torch.float32))
    engine.load_weights(named_trainer_tensors(vl.hf))
    return engine


def check_greedy(vl: VL, engine: RolloutEngine, prompt: tuple[list[int], ImageInputs], new_tokens: int) -> bool:
    """Untimed sanity check: greedy tokens of the engine == transformers' at batch 1."""
    batch = left_padded(vl, [prompt])
    with torch.inference_mode():
        ours = engine.generate([prompt[0]], SamplingParams(temperature=0.0, max_tokens=new_tokens),
                               images=[prompt[1]]).response_token_ids[0]
        theirs = vl.hf.generate(**batch, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                eos_token_id=None, pad_token_id=vl.tokenizer.pad_token_id)
    theirs = theirs[0, batch["input_ids"].shape[1]:].tolist()
    if ours != theirs:
        warnings.warn(f"{vl.name}: greedy tokens differ at batch 1: engine {ours}, transformers {theirs}")
    else:
        print(f"{vl.name}: greedy tokens agree at batch 1 ({len(ours)} tokens)")
    return ours == theirs


def bench_generate(vl: VL, batches: tuple[int, ...], new_tokens: int, repeats: int) -> list[dict]:
    """tokens/s of the engine vs transformers ``generate``, one image per prompt."""
    prompts = vl_prompts(vl, max(batches), seed=1)
    engine = make_engine(vl, max(batches), max(len(ids) for ids, _ in prompts) + new_tokens + 8)
    check_greedy(vl, engine, prompts[0], new_tokens)
    out = []
    for b in batches:
        rows = prompts[:b]
        batch = left_padded(vl, rows)
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
        counts = {}

        def ours():
            got = engine.generate([ids for ids, _ in rows], params, images=[im for _, im in rows])
            counts["ours"] = sum(len(r) for r in got.response_token_ids)

        def theirs():
            got = vl.hf.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                                 pad_token_id=vl.tokenizer.pad_token_id)
            counts["theirs"] = (got.shape[1] - batch["input_ids"].shape[1]) * b

        with torch.inference_mode():
            t_ours, t_theirs = interleaved_times([ours, theirs], repeats)
        assert counts == {"ours": b * new_tokens, "theirs": b * new_tokens}, counts
        out.append(row(case=f"{vl.name} b={b} T={new_tokens} 1 image/prompt", metric="tokens/s",
                       ours=b * new_tokens / min(t_ours), baseline=b * new_tokens / min(t_theirs),
                       baseline_name=hf_name(vl), higher_is_better=True))
    return out


def training_batch(vl: VL, n_rows: int, response: int, seed: int = 2):
    """Right-padded ``(ids, mask, response_mask, RowImages)`` of prompt + random text response,
    and the same rows text-only (every vision token replaced by a text token)."""
    rng, text = random.Random(seed), vl.text_ids()
    rows = vl_prompts(vl, n_rows, seed=seed)
    seqs = [ids + [rng.choice(text) for _ in range(response)] for ids, _ in rows]
    L = max(len(s) for s in seqs)
    ids = torch.full((n_rows, L), vl.tokenizer.pad_token_id, dtype=torch.long)
    mask, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, ((prompt, _), s) in enumerate(zip(rows, seqs)):
        ids[b, :len(s)], mask[b, :len(s)], resp[b, len(prompt):len(s)] = torch.tensor(s), 1, 1
    vision = torch.tensor(vl.tokens.special_ids)
    plain = ids.clone()
    where = torch.isin(plain, vision)
    plain[where] = torch.tensor([rng.choice(text) for _ in range(int(where.sum()))], dtype=torch.long)
    return (ids, mask, resp, RowImages([im for _, im in rows])), (plain, mask, resp, RowImages([None] * n_rows))


def bench_trainer(vl: VL, n_rows: int, response: int, repeats: int) -> list[dict]:
    """One forward + backward of ``compute_logprobs_entropy``: rows with images vs text-only rows."""
    model = vl.hf.train()
    with_images, text_only = training_batch(vl, n_rows, response)

    def step(batch):
        ids, mask, resp, images = batch
        lp, _ = compute_logprobs_entropy(model, ids, mask, resp, images=images if images.any else None)
        (-(lp.sum() / resp.sum())).backward()
        model.zero_grad(set_to_none=True)

    try:
        t_img, t_txt = interleaved_times([lambda: step(with_images), lambda: step(text_only)], repeats)
    finally:
        vl.hf.eval()
    n_image_tokens = int((with_images[0] == vl.tokens.image_token_id).sum())
    return [row(case=f"{vl.name} trainer fwd+bwd {n_rows} rows x {with_images[0].shape[1]} tok "
                     f"({n_image_tokens} image tok)", metric="step s", ours=min(t_img), baseline=min(t_txt),
                baseline_name="same batch, text-only rows (no vision tower)", higher_is_better=False)]


def bench_prefix(vl: VL, reply: int, repeats: int) -> list[dict]:
    """TTFT of turn 2 of a conversation (two pictures in turn 1): over the retained turn 1
    (``parent=``) vs a full re-prefill; and the vision-tower patches each encodes."""
    (ids, images), = vl_prompts(vl, 1, seed=3, n_images=2)
    follow_up = vl.tokenizer.encode("<|end|><|user|>Which colour is most common in the two pictures?<|end|>"
                                    "<|assistant|>", add_special_tokens=False)
    engine = make_engine(vl, 2, len(ids) + reply + len(follow_up) + 8)
    engine.add_request("turn1", ids, SamplingParams(temperature=1.0, max_tokens=reply, seed=5), retain=True,
                       images=images)
    first = engine.run_until_finished(["turn1"])["turn1"]
    turn2 = ids + first.token_ids + follow_up
    placeholders = [True] * len(ids) + [False] * (len(turn2) - len(ids))  # a sampled <|image_pad|> is text
    counter, calls, seen = engine.model.model.vision_counter, iter(range(10**9)), {}

    def ttft(parent: str | None):
        rid = f"turn2-{next(calls)}"
        before = counter.patches
        engine.add_request(rid, turn2, SamplingParams(temperature=1.0, max_tokens=1, seed=7), parent=parent,
                           images=images, placeholders=placeholders)
        out = engine.run_until_finished([rid])[rid]
        seen[parent] = (counter.patches - before, out.cached_tokens)

    with torch.inference_mode():
        t_reuse, t_full = interleaved_times([lambda: ttft("turn1"), lambda: ttft(None)], repeats)
    (p_reuse, cached), (p_full, fresh_cached) = seen["turn1"], seen[None]
    assert cached == len(ids) + len(first.token_ids) - 1 and fresh_cached == 0, (cached, fresh_cached)
    case = (f"{vl.name} turn 2: {len(turn2)} tok, {images.n_images} images "
            f"({int(images.pixel_values.shape[0])} patches), {len(turn2) - cached} tok to prefill")
    name = "re-prefill (no parent): the same ids and images, vision tower run again"
    return [row(case=case, metric="TTFT ms", ours=1e3 * min(t_reuse), baseline=1e3 * min(t_full), baseline_name=name,
                higher_is_better=False),
            row(case=case, metric="patches encoded", ours=p_reuse, baseline=p_full, baseline_name=name,
                higher_is_better=False)]


def main() -> None:
    args = parse_args(__doc__)
    archs, new_tokens, repeats = (("qwen2_5_vl",), 16, 3) if args.quick else (("qwen2_5_vl", "qwen3_vl"), 64, 5)
    rows = []
    for arch in archs:
        vl = make_vl(arch)
        rows += bench_generate(vl, (1, 16), new_tokens, repeats)
        rows += bench_trainer(vl, 16, new_tokens, repeats)
        rows += bench_prefix(vl, new_tokens, 5 if args.quick else 9)
    print(f"threads={torch.get_num_threads()}")
    report(rows, args.json)


if __name__ == "__main__":
    main()
