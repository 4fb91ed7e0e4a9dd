"""`hybridrl generate` on a local checkpoint: same greedy text as transformers."""

import torch

from hybridrl.cli import main
from hybridrl.data.char_tokenizer import build_char_tokenizer
from hybridrl.checkpoint.atomic import save_checkpoint_atomic
from hybridrl.job.model_factory import builtin_model
from hybridrl.config import ModelConfig


def test_generate_matches_transformers_greedy(tmp_path, capsys):
    tok = build_char_tokenizer()
    model = builtin_model(tok, ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=False), seed=3)
    ckpt = save_checkpoint_atomic(model, tok, tmp_path / "ckpt")
    assert main(["generate", "--model", str(ckpt), "--max-tokens", "6", "12+34=", "7*8="]) == 0
    lines = capsys.readouterr().out.splitlines()
    for prompt, line in zip(["12+34=", "7*8="], lines):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=True)])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        assert line == prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, hybridrl; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
