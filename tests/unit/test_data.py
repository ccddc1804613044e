"""Prompt datasets: the synthetic task, jsonl / parquet files, the chat template (the loader: test_loader.py)."""

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlrunner.data.datasets import PromptDataset, build_dataset, load_prompt_files, synthetic_arithmetic
from rlrunner.errors import ConfigError
from rlrunner.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


# --- synthetic_arithmetic ----------------------------------------------------------------

PROBLEM = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def test_synthetic_is_deterministic_per_seed() -> None:
    a = synthetic_arithmetic(50, 9, "+-*", seed=3)
    b = synthetic_arithmetic(50, 9, "+-*", seed=3)
    c = synthetic_arithmetic(50, 9, "+-*", seed=4)
    assert a == b
    assert a != c
    assert len(a) == 50
    # problem i depends only on (seed, i): a longer list starts with the shorter one
    assert synthetic_arithmetic(80, 9, "+-*", seed=3)[:50] == a


def test_synthetic_answers_are_correct_and_operands_in_range() -> None:
    records = synthetic_arithmetic(300, 12, "+-*", seed=0)
    ops_seen = set()
    operands = set()
    for record in records:
        assert set(record) == {"prompt", "answer", "data_source", "extra_info"}
        assert record["data_source"] == "arithmetic"
        assert record["extra_info"] == {"prompt": record["prompt"], "answer": record["answer"]}
        match = PROBLEM.match(record["prompt"])
        assert match, record
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        assert 0 <= a <= 12 and 0 <= b <= 12
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert record["answer"] == str(expected)
        ops_seen.add(op)
        operands.update((a, b))
    assert ops_seen == {"+", "-", "*"}
    assert max(operands) == 12 and min(operands) == 0  # both ends of [0, max_operand] are reachable
    two_digit = {int(n) for r in synthetic_arithmetic(300, 99, "*", seed=0, min_operand=10) for n in PROBLEM.match(
        r["prompt"]).group(1, 3)}  # fmt: skip
    assert min(two_digit) >= 10 and max(two_digit) <= 99
    for record in synthetic_arithmetic(200, 9, "+-*", seed=1, num_operands=3):  # `*` first, then left to right
        assert int(record["answer"]) == eval(record["prompt"][:-1]), record  # noqa: S307 - our own digits and + - *


def test_synthetic_single_operation() -> None:
    for record in synthetic_arithmetic(40, 5, "*", seed=1):
        a, op, b = PROBLEM.match(record["prompt"]).groups()
        assert op == "*"
        assert record["answer"] == str(int(a) * int(b))


# --- load_prompt_files ------------------------------------------------------------------------


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_load_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+3=", "answer": "5"}])
    # blank lines are skipped
    path.write_text(path.read_text() + "\n  \n")
    # the answer as the file has it (the reward function's ground truth); the file's name as the data source
    assert load_prompt_files(str(path), "prompt", "answer") == [
        {"prompt": "1+1=", "answer": 2, "data_source": "train", "extra_info": {"prompt": "1+1=", "answer": 2}},
        {"prompt": "2+3=", "answer": "5", "data_source": "train", "extra_info": {"prompt": "2+3=", "answer": "5"}},
    ]


def test_load_parquet_with_dotted_answer_key(tmp_path: Path) -> None:
    records = [
        {"question": "What is 6*7?", "reward_model": {"ground_truth": "42", "style": "rule"}},
        {"question": "What is 1+2?", "reward_model": {"ground_truth": "3", "style": "rule"}},
    ]
    path = write_parquet(tmp_path / "train.parquet", records)
    assert [
        {k: r[k] for k in ("prompt", "answer")}
        for r in load_prompt_files(str(path), "question", "reward_model.ground_truth")
    ] == [
        {"prompt": "What is 6*7?", "answer": "42"},
        {"prompt": "What is 1+2?", "answer": "3"},
    ]


def test_load_jsonl_dotted_keys_and_chat_prompts(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "2*2?"}]
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"extra": {"messages": chat}, "reward_model": {"ground_truth": 4}}],
    )
    assert load_prompt_files(str(path), "extra.messages", "reward_model.ground_truth") == [
        {
            "prompt": chat,
            "answer": 4,
            "data_source": "chat",
            "extra_info": {"extra": {"messages": chat}, "reward_model": {"ground_truth": 4}},
        }
    ]


def test_verl_records_give_their_data_source_and_extra_info(tmp_path: Path) -> None:
    """verl's parquet layout: `data_source` picks the scorer, `extra_info`'s own fields are on top of the others."""
    record = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "1+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 7},
    }
    second = {**record, "data_source": None, "extra_info": None}  # parquet's null: no source, no extra fields
    path = write_parquet(tmp_path / "mixed.parquet", [record, second])
    first, other = load_prompt_files(str(path), "prompt", "reward_model.ground_truth")
    assert first["data_source"] == "openai/gsm8k" and first["answer"] == "2"
    assert first["extra_info"] == {
        "prompt": record["prompt"],
        "ability": "math",
        "reward_model": record["reward_model"],
        "split": "train",
        "index": 7,
    }
    assert other["data_source"] == "mixed"  # the file's name
    assert "split" not in other["extra_info"] and other["extra_info"]["ability"] == "math"
    source_key = load_prompt_files(str(path), "prompt", "reward_model.ground_truth", data_source_key="ability")
    assert [r["data_source"] for r in source_key] == ["math", "math"]


def test_load_comma_separated_files_in_order(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "answer": 1}])
    second = write_parquet(tmp_path / "b.parquet", [{"prompt": "b", "answer": "2"}, {"prompt": "c", "answer": "3"}])
    records = load_prompt_files(f"{first}, {second},", "prompt", "answer")
    assert [r["prompt"] for r in records] == ["a", "b", "c"]
    assert [r["answer"] for r in records] == [1, "2", "3"]
    assert [r["data_source"] for r in records] == ["a", "b", "b"]


def test_load_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match="nope.jsonl"):
        load_prompt_files(str(missing), "prompt", "answer")
    # a missing second file is reported even when the first exists
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "answer": 1}])
    with pytest.raises(ConfigError, match="not found: .*nope.jsonl"):
        load_prompt_files(f"{good},{missing}", "prompt", "answer")


def test_load_record_without_prompt_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 1}, {"question": "b", "answer": 2}])
    with pytest.raises(ConfigError) as info:
        load_prompt_files(str(path), "prompt", "answer")
    message = str(info.value)
    assert "'prompt'" in message
    assert "record 1" in message  # 0-based index of the second record
    assert "answer, question" in message  # the fields it does have
    assert "d.jsonl" in message


def test_load_record_without_nested_answer_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "reward_model": {"style": "rule"}}])
    with pytest.raises(ConfigError, match=r"record 0 has no 'reward_model.ground_truth' field"):
        load_prompt_files(str(path), "prompt", "reward_model.ground_truth")


def test_load_missing_answer_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match="'answer'"):
        load_prompt_files(str(path), "prompt", "answer")


def test_load_parquet_row_without_answer_raises(tmp_path: Path) -> None:
    # In parquet a row that lacks a field holds null there (the schema is shared by all rows). Like a
    # jsonl record without the field, it must be a ConfigError, not the ground-truth answer "None".
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(ConfigError, match="record 1"):
        load_prompt_files(str(path), "prompt", "answer")


def test_load_record_that_is_not_an_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [[1, 2]])
    with pytest.raises(ConfigError, match="record 0 has no 'prompt' field.*list"):
        load_prompt_files(str(path), "prompt", "answer")


def test_load_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("prompt,answer\na,1\n")
    with pytest.raises(ConfigError, match=r"\.jsonl or \.parquet"):
        load_prompt_files(str(path), "prompt", "answer")


def test_load_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", \n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_prompt_files(str(path), "prompt", "answer")


def test_load_unreadable_parquet_and_empty_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="not a readable parquet"):
        load_prompt_files(str(bad), "prompt", "answer")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="no records"):
        load_prompt_files(str(empty), "prompt", "answer")
    with pytest.raises(ConfigError, match="no data files named"):
        load_prompt_files(" , ", "prompt", "answer")


# --- PromptDataset / build_dataset -----------------------------------------------------------------


def test_prompt_dataset_drops_long_prompts(tokenizer) -> None:
    records = [
        {"prompt": "1+2=", "answer": "3"},  # 4 chars
        {"prompt": "10+20=", "answer": "30"},  # 6 chars: dropped
        {"prompt": "9*9=", "answer": "81"},
    ]
    dataset = PromptDataset(records, tokenizer, max_prompt_length=4, apply_chat_template=True)
    assert len(dataset) == 2
    assert dataset[0] == {
        "index": 0,
        "prompt_ids": tokenizer("1+2=")["input_ids"],
        "answer": "3",
        "data_source": "unknown",
        "extra_info": {},
    }
    assert dataset[1]["index"] == 1
    assert dataset[1]["answer"] == "81"
    assert tokenizer.decode(dataset[1]["prompt_ids"]) == "9*9="
    assert len(dataset[1]["prompt_ids"]) == 4


def test_prompt_dataset_none_fit(tokenizer) -> None:
    with pytest.raises(ConfigError, match="max_prompt_length=3"):
        PromptDataset([{"prompt": "1+2=", "answer": "3"}], tokenizer, max_prompt_length=3, apply_chat_template=False)


def test_prompt_dataset_chat_messages_need_a_template() -> None:
    templateless = build_char_tokenizer()
    templateless.chat_template = None  # as a tokenizer of a base model without one
    with pytest.raises(ConfigError, match="chat template"):
        PromptDataset([{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}], templateless, 100, True)


# --- the embedded tokenizer's chat template ----------------------------------------------------

MULTI_TURN = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+3="},
]
MULTI_TURN_TEXT = "Answer with a number.\n1+1=\n2<eos>\n2+3="


def plain_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_verl_chat_prompt_files_build_a_dataset_with_the_embedded_tokenizer(
    tmp_path: Path, tokenizer, suffix: str
) -> None:
    records = [
        {
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"ground_truth": str(i + 1), "style": "rule"},
        }
        for i in range(4)
    ]
    write = write_jsonl if suffix == "jsonl" else write_parquet
    path = write(tmp_path / f"train.{suffix}", records)
    cfg = data_cfg(train_files=str(path), prompt_key="prompt", answer_key="reward_model.ground_truth")
    dataset = build_dataset(cfg, tokenizer, seed=0)
    assert [dataset[i]["prompt_ids"] for i in range(4)] == [plain_ids(tokenizer, f"{i}+1=") for i in range(4)]
    assert [dataset[i]["answer"] for i in range(4)] == ["1", "2", "3", "4"]


def test_the_template_leaves_synthetic_prompt_ids_unchanged(tokenizer) -> None:
    templated = build_dataset(data_cfg(apply_chat_template=True, synthetic={"operations": "+-*"}), tokenizer, seed=3)
    records = synthetic_arithmetic(10, 9, "+-*", seed=3)
    assert tokenizer.chat_template is not None  # so the dataset above went through the template
    assert [templated[i]["prompt_ids"] for i in range(10)] == [plain_ids(tokenizer, r["prompt"]) for r in records]
    plain = PromptDataset(records, tokenizer, max_prompt_length=32, apply_chat_template=False)
    assert [item["prompt_ids"] for item in templated.items] == [item["prompt_ids"] for item in plain.items]


def test_a_multi_turn_prompt_renders_joined_by_newlines_with_eos_after_assistant_turns(tokenizer) -> None:
    text = tokenizer.apply_chat_template(MULTI_TURN, tokenize=False, add_generation_prompt=True)
    assert text == MULTI_TURN_TEXT
    assert tokenizer.apply_chat_template(MULTI_TURN, tokenize=False, add_generation_prompt=False) == text
    dataset = PromptDataset(
        [{"prompt": MULTI_TURN, "answer": "5"}], tokenizer, max_prompt_length=64, apply_chat_template=True
    )
    ids = dataset[0]["prompt_ids"]
    assert ids.count(tokenizer.eos_token_id) == 1 and tokenizer.unk_token_id not in ids
    assert ids == plain_ids(tokenizer, "Answer with a number.\n1+1=\n2") + [tokenizer.eos_token_id] + plain_ids(
        tokenizer, "\n2+3="
    )


def test_the_chat_template_survives_save_and_load(tmp_path: Path, tokenizer) -> None:
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.apply_chat_template(MULTI_TURN, tokenize=False, add_generation_prompt=True) == MULTI_TURN_TEXT
    dataset = PromptDataset(
        [{"prompt": MULTI_TURN, "answer": "5"}], loaded, max_prompt_length=64, apply_chat_template=True
    )
    assert dataset[0]["prompt_ids"] == plain_ids(tokenizer, "Answer with a number.\n1+1=\n2") + [1] + plain_ids(
        tokenizer, "\n2+3="
    )


def data_cfg(**changes):
    cfg = {
        "train_files": None,
        "val_files": None,
        "prompt_key": "prompt",
        "answer_key": "answer",
        "data_source_key": "data_source",
        "batch_size": 4,
        "max_prompt_length": 32,
        "shuffle": True,
        "apply_chat_template": True,
        "synthetic": {
            "num_problems": 10,
            "min_operand": 0,
            "max_operand": 9,
            "operations": "+",
            "num_operands": 2,
            "val_size": 0,
        },
    }
    synthetic = changes.pop("synthetic", {})
    cfg.update(changes)
    cfg["synthetic"].update(synthetic)
    return OmegaConf.create(cfg)


def test_build_dataset_synthetic(tokenizer) -> None:
    dataset = build_dataset(data_cfg(), tokenizer, seed=7)
    assert len(dataset) == 10
    expected = synthetic_arithmetic(10, 9, "+", seed=7)
    assert [tokenizer.decode(dataset[i]["prompt_ids"]) for i in range(10)] == [r["prompt"] for r in expected]
    assert [dataset[i]["answer"] for i in range(10)] == [r["answer"] for r in expected]


def test_build_dataset_from_files(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": f"{i}+1=", "a": {"v": i + 1}} for i in range(5)])
    dataset = build_dataset(data_cfg(train_files=str(path), prompt_key="q", answer_key="a.v"), tokenizer, seed=0)
    assert len(dataset) == 5
    assert dataset[4]["answer"] == 5


def test_build_dataset_smaller_than_batch_raises(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(ConfigError, match=r"3 prompts, fewer than data.batch_size=4"):
        build_dataset(data_cfg(synthetic={"num_problems": 3}), tokenizer, seed=0)
    # too few left after dropping long prompts
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x" * n, "answer": 1} for n in (1, 2, 50, 60, 3)])
    with pytest.raises(ConfigError, match="3 prompts"):
        build_dataset(data_cfg(train_files=str(path)), tokenizer, seed=0)


def test_prompt_dataset_drops_empty_prompts() -> None:
    from rlrunner.models.tokenizer import build_char_tokenizer

    records = [{"prompt": "", "answer": "1"}, {"prompt": "1+1=", "answer": "2"}]
    dataset = PromptDataset(records, build_char_tokenizer(), max_prompt_length=16, apply_chat_template=False)
    assert len(dataset) == 1 and dataset[0]["answer"] == "2" and dataset[0]["index"] == 0


def test_null_answer_in_jsonl_is_a_missing_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": None}])
    with pytest.raises(ConfigError, match="record 0 has no 'answer' field"):
        load_prompt_files(str(path), "prompt", "answer")


def test_the_validation_set(tmp_path: Path, tokenizer) -> None:
    """data.val_files when set; else the synthetic task's own validation problems (another stream than training's)."""
    from rlrunner.data.datasets import build_val_dataset

    assert build_val_dataset(data_cfg(), tokenizer, seed=7) is None
    synthetic = build_val_dataset(data_cfg(synthetic={"val_size": 6}), tokenizer, seed=7)
    expected = synthetic_arithmetic(6, 9, "+", seed=7, stream="arithmetic-val")
    assert expected != synthetic_arithmetic(6, 9, "+", seed=7)
    assert [tokenizer.decode(item["prompt_ids"]) for item in synthetic.items] == [r["prompt"] for r in expected]
    path = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "1+1=", "answer": 2, "data_source": "add"}])
    from_file = build_val_dataset(data_cfg(val_files=str(path), synthetic={"val_size": 6}), tokenizer, seed=7)
    assert len(from_file) == 1 and from_file[0]["data_source"] == "add" and from_file[0]["answer"] == 2
