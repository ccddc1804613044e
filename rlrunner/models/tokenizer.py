"""A small character-level tokenizer built in code, for the embedded tiny model (no downloads)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
_CHARACTERS = [chr(code) for code in range(32, 127)] + ["\n"]

# A minimal chat template, so that chat-message prompts (verl's parquet layout) work with the
# embedded model. A lone user message renders as its content unchanged: plain-text prompts wrapped
# as one user message (data.apply_chat_template) tokenize exactly as without a template. Messages
# of any role are joined by a newline, an assistant turn ends with the eos token, and
# add_generation_prompt adds nothing (the vocabulary has no room for role markers).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character plus newline; pad=0, eos=1, unk=2; CHAT_TEMPLATE.

    A real `tokenizers` object, so `save_pretrained` writes a folder (template included) that
    `AutoTokenizer` loads.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([PAD_TOKEN, EOS_TOKEN, UNK_TOKEN] + _CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
