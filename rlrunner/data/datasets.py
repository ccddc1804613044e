"""Prompt datasets: the synthetic arithmetic task and GSM8K-style prompt files (jsonl / parquet).

Each record is a dict with a `prompt` (text, or a list of chat messages), an `answer` (the ground truth the reward
function compares against, as the file has it), a `data_source` (which source it comes from: the reward function may
score each its own way, and validation metrics are kept per source) and `extra_info` (the record's other fields, for
the reward function). `PromptDataset` tokenizes every prompt once, up front, in one batch (the tokenizer's own
batch encoding: a per-prompt call costs most of a run's start-up on a dataset of thousands).
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


SYNTHETIC_SOURCE = "arithmetic"  # the synthetic task's data_source


def synthetic_arithmetic(
    num_problems: int,
    max_operand: int,
    operations: str,
    seed: int,
    stream: str = "arithmetic",
    min_operand: int = 0,
    num_operands: int = 2,
) -> list[Record]:
    """`num_problems` problems like {"prompt": "7+5=", "answer": "12"}: `num_operands` operands in
    min_operand..max_operand, each operator drawn from `operations` (`*` before `+` and `-`); problem i depends only on
    (seed, stream, i) (the validation problems are another stream)."""
    records = []
    for i in range(num_problems):
        rng = random.Random(derive_seed(seed, stream, i))
        values = [rng.randint(min_operand, max_operand) for _ in range(num_operands)]
        ops = [operations[rng.randrange(len(operations))] for _ in range(num_operands - 1)]
        prompt = "".join(f"{value}{op}" for value, op in zip(values, ops)) + f"{values[-1]}="
        answer = str(evaluate(values, ops))
        records.append(
            {
                "prompt": prompt,
                "answer": answer,
                "data_source": SYNTHETIC_SOURCE,
                "extra_info": {"prompt": prompt, "answer": answer},
            }
        )
    return records


def evaluate(values: Sequence[int], ops: Sequence[str]) -> int:
    """`values[0] ops[0] values[1] ...` with `*` taken before `+` and `-`, left to right."""
    terms, signs = [values[0]], []
    for op, value in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(op)
    result = terms[0]
    for sign, term in zip(signs, terms[1:]):
        result = result + term if sign == "+" else result - term
    return result


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
                        raise ConfigError(
                            f"data file {path}: line {line_number} is not valid JSON ({exc.msg})"
                        ) from None
        return records
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise ConfigError(f"data file {path} is not a readable parquet file ({type(exc).__name__})") from None
    raise ConfigError(f"data file {path} must end in .jsonl or .parquet")


def extra_info(record: Record, data_source_key: str) -> dict[str, Any]:
    """What the reward function gets as `extra_info`: the record's fields but its data source, with the fields of its
    own `extra_info` mapping (verl's layout) on top, so that a verl reward reading `extra_info["split"]` works."""
    top = data_source_key.split(".")[0]
    info = {key: value for key, value in record.items() if key not in (top, "extra_info")}
    if isinstance(record.get("extra_info"), dict):
        info.update(record["extra_info"])
    return info


def load_prompt_files(
    paths: str, prompt_key: str, answer_key: str, data_source_key: str = "data_source"
) -> list[Record]:
    """Read comma-separated jsonl / parquet files into {"prompt", "answer", "data_source", "extra_info"} records (a
    record without a data source gets its file's name, less the suffix); ConfigError on any problem."""
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
            try:
                source = str(_field(record, data_source_key))
            except KeyError:
                source = path.stem
            records.append(
                {
                    "prompt": prompt,
                    "answer": answer,
                    "data_source": source,
                    "extra_info": extra_info(record, data_source_key),
                }
            )
    if not records:
        raise ConfigError(f"no data files named: '{paths}'")
    return records


class PromptDataset:
    """Tokenized prompts. Item i is {"index": i, "prompt_ids": [...], "answer", "data_source", "extra_info"}."""

    def __init__(
        self,
        records: Sequence[Record],
        tokenizer,
        max_prompt_length: int,
        apply_chat_template: bool,
        tools: Sequence[dict] | None = None,
    ):
        self.items: list[Record] = []
        too_long = empty = 0
        texts = [prompt_text(record["prompt"], tokenizer, apply_chat_template, tools) for record in records]
        encoded = []
        if texts:
            options = {"return_attention_mask": False, "return_token_type_ids": False}
            encoded = tokenizer(texts, add_special_tokens=False, **options)["input_ids"]
        for record, ids in zip(records, encoded):
            ids = list(ids)
            if not ids:
                empty += 1
            elif len(ids) > max_prompt_length:
                too_long += 1
            else:
                self.items.append(
                    {
                        "index": len(self.items),
                        "prompt_ids": ids,
                        "answer": record["answer"],
                        "data_source": record.get("data_source", "unknown"),
                        "extra_info": record.get("extra_info", {}),
                    }
                )
        if too_long:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d",
                too_long,
                len(records),
                max_prompt_length,
            )
        if empty:
            logger.warning("dropped %d empty prompts", empty)
        if not self.items:
            raise ConfigError(f"no prompt fits data.max_prompt_length={max_prompt_length}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Record:
        return self.items[index]


def prompt_text(prompt: str | list, tokenizer, apply_chat_template: bool, tools: Sequence[dict] | None = None) -> str:
    """The text a prompt is tokenized from (without special tokens); chat-message lists (and plain text, when asked)
    go through the chat template, which renders `tools` (their JSON schemas: a multi-turn run's) as it does."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, list):
        if not has_template:
            raise ConfigError("the prompts are chat messages but the tokenizer has no chat template")
        messages = prompt
    elif apply_chat_template and has_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return str(prompt)
    options = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)


def build_dataset(data_cfg, tokenizer, seed: int, tools: Sequence[dict] | None = None) -> PromptDataset:
    """The run's dataset from `data.*`: prompt files when `data.train_files` is set, else the synthetic task; `tools`:
    the JSON schemas its prompts are rendered with."""
    if data_cfg.train_files:
        records = load_prompt_files(
            data_cfg.train_files, data_cfg.prompt_key, data_cfg.answer_key, data_cfg.data_source_key
        )
    else:
        synthetic = data_cfg.synthetic
        records = synthetic_arithmetic(
            synthetic.num_problems,
            synthetic.max_operand,
            synthetic.operations,
            seed,
            min_operand=synthetic.min_operand,
            num_operands=synthetic.num_operands,
        )
    dataset = PromptDataset(records, tokenizer, data_cfg.max_prompt_length, data_cfg.apply_chat_template, tools)
    if len(dataset) < data_cfg.batch_size:
        raise ConfigError(f"the dataset has {len(dataset)} prompts, fewer than data.batch_size={data_cfg.batch_size}")
    return dataset


def build_val_dataset(data_cfg, tokenizer, seed: int, tools: Sequence[dict] | None = None) -> PromptDataset | None:
    """The validation set: `data.val_files`; else, on the synthetic task, `data.synthetic.val_size` problems drawn
    apart from the training ones; None when there is none."""
    if data_cfg.val_files:
        records = load_prompt_files(
            data_cfg.val_files, data_cfg.prompt_key, data_cfg.answer_key, data_cfg.data_source_key
        )
    elif not data_cfg.train_files and data_cfg.synthetic.val_size > 0:
        synthetic = data_cfg.synthetic
        records = synthetic_arithmetic(
            synthetic.val_size,
            synthetic.max_operand,
            synthetic.operations,
            seed,
            stream="arithmetic-val",
            min_operand=synthetic.min_operand,
            num_operands=synthetic.num_operands,
        )
    else:
        return None
    return PromptDataset(records, tokenizer, data_cfg.max_prompt_length, data_cfg.apply_chat_template, tools)
