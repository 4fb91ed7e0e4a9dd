"""A character-level tokenizer built in code (no download), as a transformers tokenizer.

It is a real ``PreTrainedTokenizerFast`` (``tokenizers`` WordLevel model, one token per
character), so it saves with a checkpoint and reloads with ``AutoTokenizer``.

``specials`` adds whole-string tokens (chat markers such as ``<|im_start|>``) that are
matched before the text is split into characters, so a marker is always one token.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ARITHMETIC_CHARS = "0123456789+-*= "


def build_char_tokenizer(chars: str = ARITHMETIC_CHARS, *, specials: tuple[str, ...] = (),
                         chat_template: str | None = None, eos_token: str = EOS) -> PreTrainedTokenizerFast:
    """Tokenizer with ids ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``, then ``specials`` in
    order, then one id per char. With no ``specials`` the ids are those of earlier releases.
    ``eos_token``: the token generation stops at (a chat tokenizer's end of turn, one of ``specials``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if len(set(chars)) != len(chars):
        raise ValueError(f"build_char_tokenizer: duplicate characters in {chars!r}; pass each once")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for tok in specials:
        if tok in vocab or len(tok) < 2:
            raise ValueError(f"build_char_tokenizer: special token {tok!r} is a duplicate or a single character")
        vocab[tok] = len(vocab)
    for ch in chars:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (newlines included) is its own pre-token; WordLevel then maps it to an id.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate characters back without separators
    # add_special_tokens=True prepends <bos>, as the built-in task's prompts do
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    if eos_token not in vocab:
        raise ValueError(f"build_char_tokenizer: eos_token {eos_token!r} is not one of the special tokens")
    if specials:  # matched in the raw text before the split: a marker never becomes characters
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=eos_token, unk_token=UNK,
        padding_side="right", clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``<bos>`` + the characters of ``text`` (no eos: the model continues it)."""
    return [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
