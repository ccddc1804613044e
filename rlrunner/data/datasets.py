"""Prompt datasets: the synthetic arithmetic task and GSM8K-style prompt files (jsonl / parquet).

Each record is a dict with a `prompt` (text, or a list of chat messages) and an `answer` (the text
the reward verifier compares against). `PromptDataset` tokenizes every prompt once, up front.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Sequence

from rlrunner.errors import ConfigError
from rlrunner.utils.seeding import derive_seed

logger = logging.getLogger(__name__)

Record = dict[str, Any]


def synthetic_arithmetic(num_problems: int, max_operand: int, operations: str, seed: int) -> list[Record]:
    """`num_problems` problems like {"prompt": "7+5=", "answer": "12"}; problem i depends only on (seed, i)."""
    records = []
    for i in range(num_problems):
        rng = random.Random(derive_seed(seed, "arithmetic", i))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = operations[rng.randrange(len(operations))]
        result = a + b if op == "+" else a - b if op == "-" else a * b
        records.append({"prompt": f"{a}{op}{b}=", "answer": str(result)})
    return records


def _field(record: Record, dotted_key: str) -> Any:
    """record["a"]["b"] for "a.b"; KeyError when any part is missing or null (parquet's missing value)."""
    value: Any = record
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            raise KeyError(dotted_key)
        value = value[part]
    return value


def _read_records(path: Path) -> list[Record]:
    if path.suffix == ".jsonl":
        records = []
        with path.open() as handle:
            for line_number, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"data file {path}: line {line_number} is not valid JSON ({exc.msg})") from None
        return records
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise ConfigError(f"data file {path} is not a readable parquet file ({type(exc).__name__})") from None
    raise ConfigError(f"data file {path} must end in .jsonl or .parquet")


def load_prompt_files(paths: str, prompt_key: str, answer_key: str) -> list[Record]:
    """Read comma-separated jsonl / parquet files into {"prompt", "answer"} records; ConfigError on any problem."""
    records: list[Record] = []
    for name in [p.strip() for p in paths.split(",") if p.strip()]:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"data file not found: {name}")
        raw = _read_records(path)
        if not raw:
            raise ConfigError(f"data file {name} has no records")
        for row, record in enumerate(raw):
            try:
                prompt = _field(record, prompt_key)
            except KeyError:
                fields = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"data file {name}: record {row} has no '{prompt_key}' field (data.prompt_key; it has: {fields})"
                ) from None
            try:
                answer = _field(record, answer_key)
            except KeyError:
                fields = ", ".join(sorted(record))
                raise ConfigError(
                    f"data file {name}: record {row} has no '{answer_key}' field (data.answer_key; it has: {fields})"
                ) from None
            records.append({"prompt": prompt, "answer": str(answer)})
    if not records:
        raise ConfigError(f"data.train_files names no files: '{paths}'")
    return records


class PromptDataset:
    """Tokenized prompts. Item i is {"index": i, "prompt_ids": [...], "answer": str}."""

    def __init__(self, records: Sequence[Record], tokenizer, max_prompt_length: int, apply_chat_template: bool):
        self.items: list[Record] = []
        too_long = empty = 0
        for record in records:
            ids = encode_prompt(record["prompt"], tokenizer, apply_chat_template)
            if not ids:
                empty += 1
            elif len(ids) > max_prompt_length:
                too_long += 1
            else:
                self.items.append({"index": len(self.items), "prompt_ids": ids, "answer": record["answer"]})
        if too_long:
            logger.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d", too_long, len(records), max_prompt_length)
        if empty:
            logger.warning("dropped %d empty prompts", empty)
        if not self.items:
            raise ConfigError(f"no prompt fits data.max_prompt_length={max_prompt_length}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Record:
        return self.items[index]


def encode_prompt(prompt: str | list, tokenizer, apply_chat_template: bool) -> list[int]:
    """Token ids of a prompt; chat-message lists (and plain text, when asked) go through the chat template."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, list):
        if not has_template:
            raise ConfigError("the prompts are chat messages but the tokenizer has no chat template")
        messages = prompt
    elif apply_chat_template and has_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return list(tokenizer(str(prompt), add_special_tokens=False)["input_ids"])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_dataset(data_cfg, tokenizer, seed: int) -> PromptDataset:
    """The run's dataset from `data.*`: prompt files when `data.train_files` is set, else the synthetic task."""
    if data_cfg.train_files:
        records = load_prompt_files(data_cfg.train_files, data_cfg.prompt_key, data_cfg.answer_key)
    else:
        synthetic = data_cfg.synthetic
        records = synthetic_arithmetic(synthetic.num_problems, synthetic.max_operand, synthetic.operations, seed)
    dataset = PromptDataset(records, tokenizer, data_cfg.max_prompt_length, data_cfg.apply_chat_template)
    if len(dataset) < data_cfg.batch_size:
        raise ConfigError(f"the dataset has {len(dataset)} prompts, fewer than data.batch_size={data_cfg.batch_size}")
    return dataset
