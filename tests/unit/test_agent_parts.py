"""The pure parts of multi-turn rollouts: tool-call parsing, tools files, the chat template's deltas, the call ledger,
the actor batch's masks and the agent metrics (no processes but the ledger's journal file)."""

from __future__ import annotations

import json
import textwrap
import types
from pathlib import Path

import pytest
import torch
from chat_tokenizer import build_chat_tokenizer

from rlrunner.agents.chat import ChatDeltas, encode_text
from rlrunner.agents.ledger import CallLedger, OwnerRetired
from rlrunner.agents.metrics import agent_metrics, model_tokens
from rlrunner.agents.parsers import ToolCall, calls_of, parse_hermes
from rlrunner.agents.settings import check_chat_template
from rlrunner.agents.tools import output_text, tool_functions, tool_schemas
from rlrunner.errors import ConfigError
from rlrunner.models.tokenizer import build_char_tokenizer
from rlrunner.runner.batching import build_actor_batch
from rlrunner.utils.user_code import CodeLoadError

# --- parsing the model's calls ------------------------------------------------------------------------------------


def test_hermes_reads_every_call_of_a_turn_in_order() -> None:
    text = (
        'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_hermes(text) == [
        ToolCall("multiply", {"a": 3, "b": 4}),
        ToolCall("add", {"a": 1}),  # arguments written as a JSON string, as some models do
        ToolCall("now", {}),
    ]
    assert parse_hermes("The answer is 12.") == []


@pytest.mark.parametrize(
    "text, error",
    [
        ("<tool_call>{name: multiply}</tool_call>", "malformed tool call: not JSON (Expecting property name"),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed tool call: no 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "'arguments' is list, not an object"),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "'arguments' is a string but not JSON"),
        ("<tool_call>[1, 2]</tool_call>", "malformed tool call: list, not an object with name and arguments"),
        ('<tool_call>{"name": "f", "arguments": {}}', "<tool_call> without </tool_call>"),
    ],
)
def test_a_malformed_hermes_call_is_kept_with_its_error(text: str, error: str) -> None:
    [call] = parse_hermes(text)
    assert call.error is not None and error in call.error, call


def test_a_users_parser_is_read_the_same_way_and_its_failures_are_tool_errors() -> None:
    assert calls_of(lambda text: [{"name": "f", "arguments": {"x": text}}], "7") == [ToolCall("f", {"x": "7"})]
    assert calls_of(lambda text: None, "7") == []
    [raised] = calls_of(lambda text: 1 / 0, "7")
    assert raised.error == "the tool-call parser raised ZeroDivisionError: division by zero"
    [wrong] = calls_of(lambda text: "f(7)", "7")
    assert wrong.error == "the tool-call parser returned str, not a list of calls"
    [bad] = calls_of(lambda text: [{"arguments": {}}], "7")
    assert bad.error == "malformed tool call: no 'name'"


# --- a tools file -------------------------------------------------------------------------------------------------

TOOLS = '''
from math import sqrt  # imported: not a tool of this file

def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b

def _helper(a: int) -> int:
    """Private."""
    return a

def untyped(a):
    """No type hints."""
    return a

def undocumented(a: int) -> int:
    return a
'''


def module_of(source: str) -> types.ModuleType:
    module = types.ModuleType("tools_under_test")
    exec(compile(textwrap.dedent(source), "tools_under_test.py", "exec"), module.__dict__)
    return module


def test_a_tools_file_s_tools_are_its_public_typed_documented_functions() -> None:
    tools = tool_functions(module_of(TOOLS))
    assert list(tools) == ["multiply"]
    [schema] = tool_schemas(tools)
    assert schema["function"]["name"] == "multiply" and schema["function"]["description"] == "Multiply two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor"}
    with pytest.raises(CodeLoadError, match="rollout.multi_turn.tools: .* has no tools"):
        tool_functions(module_of("def f(a):\n    return a\n"))
    described_badly = module_of('def f(a: int) -> int:\n    """No Args section."""\n    return a\n')
    with pytest.raises(CodeLoadError, match="rollout.multi_turn.tools: tool 'f' cannot be described"):
        tool_schemas(tool_functions(described_badly))


def test_a_tool_s_output_is_text_cut_to_a_bound() -> None:
    assert output_text("12", 100) == ("12", 2)
    assert output_text({"a": [1, 2]}, 100) == ('{"a": [1, 2]}', 13)
    assert output_text(object, 100)[0] == "<class 'object'>"
    assert output_text("x" * 10**6, 64) == ("x" * 64, 10**6)


# --- token in, token out ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [build_char_tokenizer, build_chat_tokenizer], ids=["tiny", "hermes"])
def test_the_deltas_after_the_models_turns_add_up_to_the_templates_conversation(build) -> None:
    """The model's turn (its own tokens, ending with the eos it sampled) and the delta of what answered it decode to
    exactly what the template renders for them after the prompt (the tiny template's generation prompt is empty, so
    the turn follows the prompt without the newline it puts between messages: what the model sees and is trained on)."""
    tokenizer = build()
    schemas = [{"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}]
    chat = ChatDeltas(tokenizer, schemas)
    messages = [{"role": "user", "content": "3*4="}]
    prompt = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    turn = tokenizer("call it", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    results = [{"role": "tool", "name": "multiply", "content": "12"}, {"role": "tool", "name": "m", "content": "x"}]
    after = turn + chat.after_turn(results, turn[-1])
    conversation = messages + [{"role": "assistant", "content": "call it"}, *results]
    expected = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert expected.endswith(tokenizer.decode(after))
    if build is build_chat_tokenizer:
        assert tokenizer.decode(ids + after) == expected
    # an environment's first observation after the prompt
    observed = chat.extend_prompt(tokenizer(prompt, add_special_tokens=False)["input_ids"], [messages[0]])
    doubled = tokenizer.apply_chat_template(messages * 2, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(observed) == doubled
    # the deltas' encoder (a fast tokenizer's own) gives the tokenizer's ids, special tokens and all
    for text in (expected, "<eos>\n336", "x" * 300):
        assert encode_text(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line() -> None:
    tokenizer = build_chat_tokenizer()
    check_chat_template(tokenizer, ())  # the hermes layout appends
    tokenizer.chat_template = "{% for m in messages %}{{ m.content if loop.last else 'X' }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn: the chat template cannot carry the turns: the chat"):
        check_chat_template(tokenizer, ())
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        check_chat_template(tokenizer, ())


# --- the call ledger ----------------------------------------------------------------------------------------------


def key(step: int, position: int = 0, turn: int = 1, call: int | str = 0) -> tuple:
    return ("train", step, position, turn, call)


def record(sig: str, output: str) -> dict:
    return {"signature": sig, "value": [output, len(output)], "error": None, "seconds": 0.1, "timed_out": False}


def test_a_recorded_call_is_replayed_only_to_the_same_trajectory(tmp_path: Path) -> None:
    ledger = CallLedger(str(tmp_path / "calls.jsonl"))
    assert ledger.begin("w1", [(key(1), "s1"), (key(1, call=1), "s2")]) == [None, None]
    assert ledger.in_progress(["w1"]) == 2 and ledger.in_progress(["w2"]) == 0
    ledger.record([(key(1), record("s1", "12"))])
    assert ledger.in_progress(["w1"]) == 1
    assert ledger.begin("w2", [(key(1), "s1")]) == [record("s1", "12")]  # generated again: replayed
    assert ledger.begin("w2", [(key(1), "other")]) == [None]  # another trajectory at that key: called anew
    assert ledger.begin("w2", [(key(1, call=1), "s2")]) == [None]  # w1 died in it: made again
    assert [e["event"] for e in ledger.take_events()] == ["tool_record_mismatch", "tool_call_repeated"]
    assert ledger.take_events() == []
    ledger.retire(["w2"])
    with pytest.raises(OwnerRetired):
        ledger.begin("w2", [(key(2), "s")])


def test_the_journal_brings_back_what_a_relaunched_driver_needs(tmp_path: Path) -> None:
    path = str(tmp_path / "calls.jsonl")
    ledger = CallLedger(path)
    ledger.begin("w", [(key(3), "a"), (key(4), "b"), (key(5), "c")])
    ledger.record([(key(3), record("a", "3")), (key(4), record("b", "4"))])
    ledger.close()
    with open(path, "a") as handle:
        handle.write('{"key": ["train", 6')  # a line cut short by the crash
    again = CallLedger(path, keep=True, after_step=3)  # resumed from the checkpoint of step 3
    assert again.count() == 1 and again.begin("v", [(key(4), "b")]) == [record("b", "4")]
    assert again.begin("v", [(key(5), "c")]) == [None]  # begun by the dead driver, never recorded
    assert [e["event"] for e in again.take_events()] == ["tool_call_repeated"]
    again.drop_through(4)  # a checkpoint of step 4 committed
    assert again.count() == 0
    again.close()
    assert [json.loads(line)["key"] for line in Path(path).read_text().splitlines()] == [list(key(5))]
    fresh = CallLedger(path, keep=False)  # a fresh start begins the journal anew
    assert fresh.count() == 0 and Path(path).read_text() == ""


# --- what the actor trains on -------------------------------------------------------------------------------------


def test_the_loss_mask_covers_exactly_the_models_tokens() -> None:
    samples = [
        {
            "prompt_ids": [5, 6],
            "response_ids": [7, 8, 9, 10],
            "response_mask": [1, 0, 0, 1],
            "logprobs": [-1, 0, 0, -9],
        },
        {"prompt_ids": [5], "response_ids": [7, 8], "response_mask": [1, 1], "logprobs": [-3, -4]},
    ]
    batch = build_actor_batch(samples, torch.zeros(2), pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [5, 7, 8, 0, 0, 0]]
    # position t predicts input_ids[t + 1]
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert batch["rollout_logprobs"].tolist() == [[0, -1, 0, 0, -9], [-3, -4, 0, 0, 0]]
    assert [model_tokens(s) for s in samples] == [2, 2]
    single = [{"prompt_ids": [5, 6], "response_ids": [7, 8], "logprobs": [-1.0, -2.0]}]
    assert build_actor_batch(single, torch.zeros(1), 0)["loss_mask"].tolist() == [[0, 1, 1]]
    assert model_tokens(single[0]) == 2


def test_the_agent_metrics_of_a_step() -> None:
    def run(turns, calls, errors, timeouts, ended, reward=None):
        return {"agent": {"turns": turns, "model_tokens": 3 * turns, "tool_calls": calls, "tool_errors": errors,
                          "tool_timeouts": timeouts, "ended": ended, "tool_s": 0.5, "env_reward": reward}}  # fmt: skip

    samples = [run(2, 1, 0, 0, "done", 1.0), run(4, 3, 1, 1, "max_turns"), run(1, 0, 0, 0, "max_response_tokens")]
    assert agent_metrics(samples) == {
        "agent/turns_mean": 7 / 3,
        "agent/turns_max": 4.0,
        "agent/model_tokens_mean": 7.0,
        "agent/tool_calls_mean": 4 / 3,
        "agent/tool_errors": 1.0,
        "agent/tool_timeouts": 1.0,
        "agent/ended_max_turns": 1 / 3,
        "agent/ended_max_response_tokens": 1 / 3,
        "agent/env_reward_mean": 1.0,
        "time/tools_s": 1.5,
    }
    assert agent_metrics([{"response_ids": [1]}]) == {}


def test_the_calculator_example_loads_and_scores_as_its_page_says(tmp_path, monkeypatch) -> None:
    """configs/calculator_tool.yaml from the repository root: its tools file described, its parser and reward."""
    from rlrunner.config import load_config
    from rlrunner.runner.context import RunContext
    from rlrunner.utils.user_code import load_module, load_object

    from conftest import REPO

    monkeypatch.chdir(REPO)
    cfg = load_config([f"runner.output_dir={tmp_path}"], config_name="calculator_tool")
    ctx = RunContext(cfg)
    assert ctx.multi_turn.tool_names == ("multiply",) and ctx.dataset[0]["answer"].isdigit()
    parse = ctx.multi_turn.load_parser()
    assert calls_of(parse, "678") == [ToolCall("multiply", {"numbers": [6, 7, 8]})] and calls_of(parse, "57") == []
    score = load_object(ctx.reward.spec)
    credits = vars(load_module(ctx.reward.spec))  # its weights, whatever they are tuned to
    answer, length, made, factor, copy = (
        credits[k] for k in ("ANSWER_CREDIT", "LENGTH_CREDIT", "CALL_CREDIT", "FACTOR_CREDIT", "COPY_CREDIT")
    )
    call = {"name": "multiply", "arguments": {"numbers": [6, 7, 8]}, "output": "336", "error": None}
    info = {"prompt": "6*7*8=", "trajectory": {"tool_calls": [call]}}
    assert score("arithmetic", "336", "336", info)["score"] == 1.0
    scored = score("arithmetic", "335", "336", info)  # the right call, the tool's answer nearly repeated
    assert scored["call_credit"] == pytest.approx(made + 3 * factor) and scored["copy_credit"] == pytest.approx(
        copy * 2 / 3
    )
    assert scored["answer_credit"] == pytest.approx(answer * 2 / 3 + length)
    assert 1.0 > scored["score"] == pytest.approx(made + 3 * factor + copy * 2 / 3 + answer * 2 / 3 + length)
    wrong_call = {**call, "arguments": {"numbers": [6, 1, 8]}, "output": "048"}  # a factor out of place
    scored = score("arithmetic", "048", "336", {**info, "trajectory": {"tool_calls": [wrong_call]}})
    assert (scored["call_credit"], scored["copy_credit"], scored["answer_credit"]) == pytest.approx(
        (made + 2 * factor, copy, length)
    )
    assert score("arithmetic", "36", "336", info)["score"] == pytest.approx(
        made + 3 * factor + (copy + answer) / 3
    )  # short
    not_a_number = score("arithmetic", "33x", "336", info)["score"]  # no digit of it counts
    no_tool = score("arithmetic", "335", "336", {"prompt": "6*7*8="})["score"]
    assert not_a_number == pytest.approx(made + 3 * factor) and no_tool == pytest.approx(answer * 2 / 3 + length)
