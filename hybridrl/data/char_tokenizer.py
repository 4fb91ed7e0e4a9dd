"""A character-level tokenizer built in code (no download), as a transformers tokenizer.

It is a real ``PreTrainedTokenizerFast`` (``tokenizers`` WordLevel model, one token per
character), so it saves with a checkpoint and reloads with ``AutoTokenizer``.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ARITHMETIC_CHARS = "0123456789+-*= "


def build_char_tokenizer(chars: str = ARITHMETIC_CHARS) -> PreTrainedTokenizerFast:
    """Tokenizer with ids ``<pad>=0, <bos>=1, <eos>=2, <unk>=3`` then one id per char."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if len(set(chars)) != len(chars):
        raise ValueError(f"build_char_tokenizer: duplicate characters in {chars!r}; pass each once")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; WordLevel then maps it to an id.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate characters back without separators
    # add_special_tokens=True prepends <bos>, as the built-in task's prompts do
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="right", clean_up_tokenization_spaces=False,
    )
    return tok


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``<bos>`` + the characters of ``text`` (no eos: the model continues it)."""
    return [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
