"""Token in, token out: what goes into a trajectory between the model's turns is the chat template's delta.

    chat = ChatDeltas(tokenizer, tools=schemas)
    ids = chat.after_turn([{"role": "tool", "name": "multiply", "content": "12"}], last_token)
    prompt = chat.extend_prompt(prompt_ids, [{"role": "user", "content": "first observation"}])

The model's sampled tokens are never decoded and encoded again: only the messages that follow a turn (tool results, an
environment's observation) are tokenized, as the text the chat template adds for them, the generation prompt of the
next turn included. That text is the difference between the template rendering a fixed conversation with and without
the new messages; the model's turn itself ends with the eos token it sampled, so only what the template writes after
that token (Qwen's newline after `<|im_end|>`) is added before them. A template that renders the earlier turns
differently once later ones follow cannot be extended this way: refused in one line.
"""

from __future__ import annotations

from typing import Any, Sequence

_USER = {"role": "user", "content": "U"}
_ASSISTANT = {"role": "assistant", "content": "A"}


class ChatDeltas:
    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.after_assistant = self._render([_USER, _ASSISTANT], generation_prompt=False)
        # what the template writes after an assistant turn's content: the eos the model samples, and what follows it
        self.turn_end = self.after_assistant[self.after_assistant.rindex(_ASSISTANT["content"]) + 1 :]
        self.after_user = self._render([_USER], generation_prompt=False)
        self.generation_prompt = self._encode(self._render([_USER], generation_prompt=True)[len(self.after_user) :])

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def _delta(self, base: list[dict], messages: list[dict], base_text: str) -> str:
        full = self._render(base + messages, generation_prompt=True)
        if not full.startswith(base_text):
            raise ValueError(
                "the chat template renders the earlier turns differently once later messages follow, so the turns "
                "cannot be extended token by token (rollout.multi_turn needs a template that only appends)"
            )
        return full[len(base_text) :]

    def check(self) -> None:
        """ValueError (one line) unless the template can be extended token by token: the driver's check at start."""
        self.after_turn([{"role": "tool", "name": "check", "content": "X"}], None)
        self.extend_prompt([], [{"role": "user", "content": "X"}])

    def after_turn(self, messages: list[dict], last_token: int | None) -> list[int]:
        """The tokens that follow a model turn ending with `last_token` (None: it was cut, no eos): the rest of the
        turn's end as the template writes it, `messages`, and the next turn's generation prompt."""
        ending = self.turn_end
        if last_token is not None:
            sampled = self.tokenizer.decode([last_token])
            if sampled and ending.startswith(sampled):
                ending = ending[len(sampled) :]
        return self._encode(ending + self._delta([_USER, _ASSISTANT], messages, self.after_assistant))

    def extend_prompt(self, prompt_ids: Sequence[int], messages: list[dict]) -> list[int]:
        """`prompt_ids` (rendered with its generation prompt) followed by `messages` and the generation prompt again:
        an environment's first observation."""
        ids = list(prompt_ids)
        gen = self.generation_prompt
        if gen and ids[-len(gen) :] == gen:
            ids = ids[: -len(gen)]
        return ids + self._encode(self._delta([_USER], messages, self.after_user))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """`text`'s token ids, no special tokens added: a fast tokenizer's own encoder straight (a quarter of the time of
    the tokenizer's call, which a turn's ends and tool outputs pay per trajectory), the same ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
