"""A user's reward function: how it is named, loaded and read, and the scoring processes that call it (real processes,
no Ray)."""

from __future__ import annotations

import math
import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rlrunner.errors import ConfigError
from rlrunner.rewards.function import parse_spec, read_result
from rlrunner.rewards.scorer import RewardScorer, RewardSettings, ScoreRequest, check_reward_function
from rlrunner.utils.user_code import CodeLoadError, load_object

REWARD = """
import os, time
CALLS = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if solution_str == "raise":
        raise ValueError("no answer found\\nsecond line")
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "exit":
        os._exit(7)
    if solution_str == "text":
        return "1.0"
    if data_source == "dict":
        return {"score": float(solution_str == str(ground_truth)), "acc": solution_str == str(ground_truth),
                "pred": solution_str, "index": extra_info["index"]}
    return float(solution_str == str(ground_truth)) + bonus

not_a_function = 3
"""


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD))
    return path


# --- naming and loading -------------------------------------------------------------------------


def test_a_relative_file_is_made_absolute_and_the_name_defaults_to_compute_score(tmp_path: Path) -> None:
    spec = parse_spec("rewards/my_reward.py", str(tmp_path))
    assert spec.path == str(tmp_path / "rewards" / "my_reward.py") and spec.name == "compute_score"
    assert parse_spec("/abs/r.py:score", "/elsewhere").path == "/abs/r.py"
    module = parse_spec("my_pkg.rewards:gsm8k", str(tmp_path))
    assert (module.module, module.name, module.search_path) == ("my_pkg.rewards", "gsm8k", str(tmp_path))


@pytest.mark.parametrize("text", ["my_reward.py:", "my reward:score", "pkg..mod:f", ":score", "r.py:not-a-name"])
def test_a_malformed_spec_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="reward.function must be 'path/to/file.py:name' or 'package.module:name'"):
        parse_spec(text, "/tmp")


def test_load_errors_name_the_file_and_the_problem(tmp_path: Path, reward_file: Path) -> None:
    def error(text: str) -> str:
        with pytest.raises(CodeLoadError) as info:
            load_object(parse_spec(text, str(tmp_path)))
        return str(info.value)

    assert error("missing.py") == f"reward.function: file not found: {tmp_path / 'missing.py'}"
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    assert error("broken.py") == (
        f"reward.function: {tmp_path / 'broken.py'} does not import: "
        "ModuleNotFoundError: No module named 'not_a_module_anywhere'"
    )
    assert error("my_reward.py:compute_scor") == f"reward.function: {reward_file} has no 'compute_scor'"
    assert error("my_reward.py:not_a_function") == f"reward.function: 'not_a_function' in {reward_file} is not callable"
    assert error("no_such_package.rewards:f") == (
        "reward.function: module no_such_package.rewards does not import: "
        "ModuleNotFoundError: No module named 'no_such_package'"
    )


def test_a_file_imports_its_own_helpers_beside_it(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("def exact(a, b):\n    return float(a == b)\n")
    (tmp_path / "score.py").write_text(
        "from helpers import exact\n\ndef f(data_source, solution_str, ground_truth, "
        "extra_info):\n    return exact(solution_str, ground_truth)\n"
    )
    function = load_object(parse_spec(str(tmp_path / "score.py:f"), "/"))
    assert function("s", "4", "4", {}) == 1.0


def test_what_a_reward_function_returns() -> None:
    assert read_result(1) == (1.0, {}) and read_result(True) == (1.0, {}) and read_result(np.float32(0.5)) == (0.5, {})
    assert read_result({"score": 0.25, "acc": True, "pred": "7", "n": np.int64(3)}) == (0.25, {"acc": 1.0, "n": 3.0})
    for bad, message in [
        ({"acc": 1.0}, "returned a dict without 'score' (keys: acc)"),
        ("1.0", "returned str '1.0', not a number or a dict with 'score'"),
        (None, "returned NoneType None, not a number or a dict with 'score'"),
        (math.nan, "returned a score of nan"),
        (np.ones(2), "not a number"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_result(bad)


# --- the scoring processes ------------------------------------------------------------------------


def requests(*answers: str, source: str = "plain") -> list[ScoreRequest]:
    return [ScoreRequest(source, answer, "4", {"index": i}) for i, answer in enumerate(answers)]


def test_scores_are_the_same_for_any_number_of_processes(reward_file: Path) -> None:
    batch = requests(*[str(i % 6) for i in range(40)]) + requests("4", "5", source="dict")
    results = []
    for workers in (1, 3):
        scorer = RewardScorer(parse_spec(str(reward_file), "/"), {"bonus": 0.5}, workers, timeout_s=30)
        try:
            results.append(scorer.score(batch))
        finally:
            scorer.close()
    assert results[0] == results[1]
    assert [s.value for s in results[0][:6]] == [0.5, 0.5, 0.5, 0.5, 1.5, 0.5]  # function_kwargs reach every call
    assert results[0][-2].value == 1.0 and results[0][-2].extras == {"acc": 1.0, "index": 0.0}  # extra_info too
    assert results[0][-1].extras == {"acc": 0.0, "index": 1.0}


def test_a_call_that_raises_hangs_or_kills_its_process_is_an_error_and_the_rest_is_scored(reward_file: Path) -> None:
    scorer = RewardScorer(parse_spec(str(reward_file), "/"), {}, 2, timeout_s=1.0)
    try:
        started = time.monotonic()
        scores = scorer.score(requests("4", "raise", "4", "hang", "1", "exit", "text", "4"))
        assert time.monotonic() - started < 20  # the hung call cost its timeout, not an hour
        assert [s.value for s in scores] == [1.0, None, 1.0, None, 0.0, None, None, 1.0]
        assert scores[1].error == "ValueError: no answer found"
        assert scores[3].error == "timed out after 1 s (reward.timeout_s)"
        assert scores[5].error == "the scoring process died (exit code 7)"
        assert scores[6].error == "ValueError: returned str '1.0', not a number or a dict with 'score'"
        assert [s.value for s in scorer.score(requests("4", "3"))] == [1.0, 0.0]  # the replaced processes go on
    finally:
        scorer.close()


def test_a_caller_that_fails_on_an_error_gets_the_scores_up_to_the_first_one_without_the_rest(
    reward_file: Path,
) -> None:
    """reward.on_error=raise: the first error in order ends the wait. Every call hangs after the first two: waiting for
    all of them would cost one timeout each (here 6; at 256 samples and 60 s, hours before the run could fail)."""
    scorer = RewardScorer(parse_spec(str(reward_file), "/"), {}, 1, timeout_s=1.0)
    try:
        first, second = scorer.submit(requests("4", "1", "hang", "4")), scorer.submit(requests(*["hang"] * 4))
        scores = scorer.wait(first, until_error=True)
        assert [s.value for s in scores] == [1.0, 0.0, None] and scores[2].error.startswith("timed out after 1 s")
        assert not first.done.is_set()  # the fourth request was not waited for
        scorer.discard([first, second])
        assert not scorer._queue  # nothing of either batch is left to score
        assert [s.value for s in scorer.score(requests("4", "3"))] == [1.0, 0.0]  # the next batch is scored at once
        raising = scorer.submit(requests("raise", "4"))
        assert [s.error for s in scorer.wait(raising, until_error=True)] == ["ValueError: no answer found"]
        assert [s.value for s in scorer.wait(raising)] == [None, 1.0]  # waiting for all of them still can
    finally:
        scorer.close()


def test_slow_calls_run_in_parallel(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        "import time\n\ndef compute_score(data_source, solution_str, ground_truth, "
        "extra_info):\n    time.sleep(0.1)\n    return 1.0\n"
    )
    scorer = RewardScorer(parse_spec(str(tmp_path / "slow.py"), "/"), {}, 4, timeout_s=30)
    try:
        scorer.ready()
        started = time.monotonic()
        assert all(s.value == 1.0 for s in scorer.score(requests(*["x"] * 40)))
        # 4 s of sleeps in one process; about 1 s in four (bounded loosely: this is not a timing test)
        assert time.monotonic() - started < 3.0
    finally:
        scorer.close()


def test_a_function_that_cannot_load_is_refused_in_one_line(tmp_path: Path, reward_file: Path) -> None:
    with pytest.raises(CodeLoadError, match=r"^reward.function: .*missing.py$"):
        check_reward_function(RewardSettings(parse_spec("missing.py", str(tmp_path))))
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(CodeLoadError, match=r"exits.py does not import: SystemExit: 3$"):
        check_reward_function(RewardSettings(parse_spec("exits.py", str(tmp_path))))
    check_reward_function(RewardSettings(parse_spec(str(reward_file), "/")))  # loads: no error
    scorer = RewardScorer(parse_spec("missing.py", str(tmp_path)), {}, 2, timeout_s=5)
    try:
        with pytest.raises(CodeLoadError, match="file not found"):
            scorer.score(requests("4"))  # a waiting caller is told too, not left waiting
    finally:
        scorer.close()


def test_scoring_processes_end_with_their_scorer(reward_file: Path) -> None:
    scorer = RewardScorer(parse_spec(str(reward_file), "/"), {}, 2, timeout_s=5)
    scorer.ready()
    pids = [process.popen.pid for process in scorer._processes]
    scorer.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
