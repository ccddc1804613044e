"""A Hugging Face tokenizer built locally with a tool-aware chat template in the hermes layout that Qwen2.5 and many
others use (turns between `<|im_start|>` and `<|im_end|>`, the tools' schemas in a system turn, tool results in a user
turn as `<tool_response>` blocks), for the tests of multi-turn rollouts: no model hub is reachable here."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Written for these tests, in the layout of the hermes format: the system turn lists the tools when there are any,
# consecutive tool results share one user turn, and the generation prompt opens an assistant turn.
TOOL_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\nYou may call these tools:' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\nCall one as <tool_call>{\\"name\\": ..., \\"arguments\\": {...}}</tool_call>.<|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """Characters as tokens, the hermes markers as tokens of their own, `<|im_end|>` as eos; TOOL_TEMPLATE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    characters = [chr(code) for code in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIAL + MARKERS + ["<unk>"] + characters)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL])
    backend.add_tokens([AddedToken(token, special=False) for token in MARKERS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        chat_template=TOOL_TEMPLATE,
    )
