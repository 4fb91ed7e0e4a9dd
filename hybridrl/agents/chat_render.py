"""Token-in/token-out rendering: the episode's ids are the opening prompt's ids, then each
turn's *sampled* ids, then each new environment / tool message rendered on its own and
appended. The history is never re-rendered or re-tokenized, so the trainer sees exactly
the tokens the engine sampled (a re-tokenized history can merge or split tokens
differently, and the trained log-probs then belong to text the policy never produced).

A new message is rendered on its own by rendering it after a fixed stand-in history
(``_STAND_IN``: one user and one assistant turn) and keeping what follows that history's
end-of-turn token: the template's separator after the end-of-turn (ChatML: ``"\\n"``),
the message, and the next assistant header (``add_generation_prompt``).

That is only right for templates that render a conversation as the concatenation of its
turns. :func:`check_template` renders a probe conversation both ways and fails with one
line naming what the template does instead (Qwen3's strips ``<think>`` blocks of earlier
assistant turns; some drop the separator after the end-of-turn token).
"""

from __future__ import annotations

from typing import Any, Callable

from hybridrl.data.vision import ImageInputs

_STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class TemplateError(ValueError):
    """A chat template that does not render a conversation as its turns appended."""


class ChatRenderer:
    """``tokenizer``'s chat template, incrementally. ``tools``: OpenAI function schemas
    passed to the template (``tools=``); ``end_of_turn_id``: the token that ends an
    assistant turn (default: the one the template puts after an assistant message)."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, end_of_turn_id: int | None = None,
                 vision: Callable[[list[int], list], tuple[list[int], ImageInputs | None]] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(f"the tokenizer {type(tokenizer).__name__} has no chat template; agents render "
                                "messages with it: set tokenizer.chat_template (or use a chat model's tokenizer)")
        self.tokenizer, self.tools = tokenizer, tools
        # a VL policy's image step: (ids with one <|image_pad|> per image, the images) -> (ids with
        # each image's feature count of pads, ImageInputs); None: a text policy
        self.vision = vision
        self.end_of_turn_id = end_of_turn_id if end_of_turn_id is not None else self._find_end_of_turn()
        before = self._ids(_STAND_IN, generation_prompt=False)
        self._cut = _last_index(before, self.end_of_turn_id) + 1  # the stand-in history ends here
        self._stand_in = before[:self._cut]

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                                 tokenize=True, return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def _find_end_of_turn(self) -> int:
        """The token right after the stand-in assistant's content: the template's end of turn."""
        text = self.tokenizer.apply_chat_template(_STAND_IN, tools=self.tools, tokenize=False)
        head = self.tokenizer.apply_chat_template(_STAND_IN[:1], tools=self.tools, tokenize=False,
                                                  add_generation_prompt=True)
        rest = text[len(head):] if text.startswith(head) else text
        after = rest[rest.index(_STAND_IN[1]["content"]) + len(_STAND_IN[1]["content"]):]
        ids = self.tokenizer.encode(after, add_special_tokens=False)
        if not ids:
            raise TemplateError("the chat template puts nothing after an assistant message; agents need an "
                                "end-of-turn token: pass end_of_turn_id=")
        return ids[0]

    def opening(self, messages: list[dict]) -> list[int]:
        """The prompt of the first turn: ``messages`` + the assistant header."""
        return self._ids(messages, generation_prompt=True)

    def continuation(self, messages: list[dict]) -> list[int]:
        """Ids to append after an assistant turn that ended with the end-of-turn token: the
        separator, ``messages`` and the next assistant header."""
        after = self._ids(_STAND_IN + list(messages), generation_prompt=True)
        if after[:self._cut] != self._stand_in:
            raise TemplateError("the chat template renders an earlier turn differently once messages follow it; "
                                "it cannot be used token-in/token-out (check_template says how)")
        return after[self._cut:]

    def opening_images(self, messages: list[dict]) -> tuple[list[int], ImageInputs | None]:
        """:meth:`opening` of messages whose content may hold images (``{"type": "image",
        "image": <PIL image | bytes | path>}`` items): the ids and the images they hold."""
        return self._with_images(self.opening, messages)

    def continuation_images(self, messages: list[dict]) -> tuple[list[int], ImageInputs | None]:
        """:meth:`continuation` of messages that may hold images (an environment's or a tool's
        picture): the ids to append and the images they hold, in order."""
        return self._with_images(self.continuation, messages)

    def _with_images(self, render: Callable[[list[dict]], list[int]],
                     messages: list[dict]) -> tuple[list[int], ImageInputs | None]:
        pictures = [item.get("image") for m in messages if isinstance(m.get("content"), list)
                    for item in m["content"] if isinstance(item, dict) and item.get("type") == "image"]
        if pictures and self.vision is None:  # before rendering: a text template may not take content lists
            raise TemplateError(f"a message holds {len(pictures)} image(s) but the policy is a text model; "
                                "use a vision-language model (model.arch=qwen2_5_vl / qwen3_vl) or send text")
        ids = render(messages)
        return (ids, None) if not pictures else self.vision(ids, pictures)

    def text(self, sampled: list[int]) -> str:
        """A turn's text for the environment: its sampled ids without the end-of-turn token."""
        if sampled and sampled[-1] == self.end_of_turn_id:
            sampled = sampled[:-1]
        return self.tokenizer.decode(sampled, skip_special_tokens=False)


def check_template(renderer: ChatRenderer, name: str = "the tokenizer's") -> None:
    """Render a probe episode (user, assistant with a ``<think>`` block and a tool call, tool
    message, final assistant) both token-in/token-out and as a whole; raise
    :class:`TemplateError` (one line: what the template does, the options) if they differ."""
    tok = renderer.tokenizer
    user = {"role": "user", "content": "What is 2 + 3? Use the tool."}
    first = '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    tool = {"role": "tool", "name": "add", "content": "5"}
    final = "The answer is 5."

    def said(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + [renderer.end_of_turn_id]

    incremental = renderer.opening([user]) + said(first)
    try:
        incremental += renderer.continuation([tool])
    except TemplateError:
        pass  # reported below through the whole-conversation comparison
    incremental += said(final)
    whole = renderer._ids([user, {"role": "assistant", "content": first}, tool,
                           {"role": "assistant", "content": final}], generation_prompt=False)
    if whole[:len(incremental)] == incremental:
        return
    at = next((i for i, (a, b) in enumerate(zip(incremental, whole)) if a != b), min(len(incremental), len(whole)))
    what = _diagnose(tok, incremental, whole, at, renderer.end_of_turn_id, first)
    raise TemplateError(
        f"{name} chat template rewrites the history, so it cannot be trained token-in/token-out: it {what} "
        f"(first difference at token {at}: appended {tok.decode(incremental[at:at + 8])!r} vs re-rendered "
        f"{tok.decode(whole[at:at + 8])!r}); use a prefix-preserving template (set tokenizer.chat_template, e.g. "
        "the same template without the history rewrite) or start a new sample at each break")


def _diagnose(tok: Any, incremental: list[int], whole: list[int], at: int, end_of_turn: int, said: str) -> str:
    mine, theirs = tok.decode(incremental[at:]), tok.decode(whole[at:])
    whole_text = tok.decode(whole)
    if "<think>" in tok.decode(incremental) and "<think>" not in whole_text:
        return "strips the <think> blocks of earlier assistant turns (as Qwen3's template does)"
    if said not in whole_text and said.strip() in whole_text:
        return "trims the whitespace around assistant messages (a sampled turn ending in a newline changes)"
    if at > 0 and incremental[at - 1] == end_of_turn:
        return (f"renders what follows an end-of-turn token differently ({mine[:6]!r} appended vs {theirs[:6]!r} "
                "re-rendered: e.g. it drops the newline after it)")
    return "renders an earlier turn differently once later turns follow"


def _last_index(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    raise TemplateError(f"the end-of-turn token {token} does not occur in a rendered assistant turn; pass the "
                        "template's end-of-turn token as end_of_turn_id=")


class ImageStep:
    """The ``vision=`` of a VL policy's :class:`ChatRenderer`: ids with one ``<|image_pad|>``
    per image (what a chat template renders for an image item) and the pictures (PIL images,
    bytes, paths, data URLs) -> the ids with each image's feature count of pads, and the
    processed images (``data/vl_prompts.py``: the same image processor as the data set's).
    A picture that cannot be used raises ``ValueError`` (its episode fails, nothing else)."""

    def __init__(self, prompts: Any):
        """``prompts``: the policy's ``VLPromptRenderer``."""
        self.prompts = prompts

    def __call__(self, ids: list[int], pictures: list) -> tuple[list[int], ImageInputs | None]:
        from pathlib import Path

        from hybridrl.data.vl_prompts import load_image

        tokens = self.prompts.tokens
        pads = [i for i, t in enumerate(ids) if t == tokens.image_token_id]
        if len(pads) != len(pictures):
            raise ValueError(f"{len(pictures)} image item(s) rendered as {len(pads)} <|image_pad|> token(s); the chat "
                             "template must render each image item as one")
        images = self.prompts.process([load_image(p, Path.cwd()) for p in pictures])
        counts = images.features_per_image(tokens.spatial_merge_size)
        out, last = [], 0
        for at, n in zip(pads, counts):
            out += ids[last:at] + [tokens.image_token_id] * n
            last = at + 1
        return out + ids[last:], images
