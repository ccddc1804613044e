from fractions import Fraction

import pytest

from rlrunner.rewards import (
    BUILTIN_VERIFIERS,
    answers_match,
    arithmetic_reward,
    extract_answer,
    math_reward,
)
from rlrunner.rewards.math_verifier import (
    ground_truth_answer,
    normalize_answer,
    parse_number,
)
from rlrunner.utils.registry import import_attr

# --- extract_answer ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"So the answer is $\boxed{72}$.", "72"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\left(3, \frac{\pi}{2}\right)}", r"\left(3, \frac{\pi}{2}\right)"),
        (r"first \boxed{1}, then \boxed{2}, finally \boxed{3}", "3"),
        (r"$\boxed 5$", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{ 42 }", "42"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        # A box that never closes (truncated generation) is skipped.
        (r"\boxed{4} and then \boxed{5", "4"),
    ],
)
def test_extract_answer_boxed(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


def test_extract_answer_boxed_wins_over_gsm8k_marker() -> None:
    assert extract_answer("#### 10\nactually \\boxed{11}") == "11"


def test_extract_answer_after_last_gsm8k_marker() -> None:
    text = "Natalia sold 48/2 = 24 clips.\n#### 9\nno wait\n####  72  \ntrailing line"
    assert extract_answer(text) == "72"


@pytest.mark.parametrize("text", ["", "The answer is 72.", r"\boxed{}", "#### ", r"\boxed{7"])
def test_extract_answer_none_found(text: str) -> None:
    assert extract_answer(text) is None


# --- normalize_answer / parse_number ----------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  $1,000$ ", "1000"),
        (r"\text{Yes}.", "yes"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"10\!000", "10000"),
        (r"5\,\text{cm}", "5cm"),
        ("x = 5", "x=5"),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("72", Fraction(72)),
        ("-5", Fraction(-5)),
        ("0.5", Fraction(1, 2)),
        ("-2.25", Fraction(-9, 4)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        (r"\frac{-1}{2}", Fraction(-1, 2)),
        ("1,000", Fraction(1000)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("50%", Fraction(50)),
        (r"50\%", Fraction(50)),
        ("$18$", Fraction(18)),
        ("18.", Fraction(18)),
    ],
)
def test_parse_number(text: str, expected: Fraction) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "x=5", "1/0", r"\frac{1}{0}", "1,00", "(1,2)", r"\sqrt{2}"])
def test_parse_number_rejects_non_numbers(text: str) -> None:
    assert parse_number(text) is None


# --- answers_match / ground_truth_answer ------------------------------------


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        ("72.0", "72"),
        ("1,000", "1000"),
        (r"-\dfrac{1}{2}", "-0.5"),
        (r"\text{Yes}", "yes"),
        (r"\left(1, 2\right)", "(1,2)"),
    ],
)
def test_answers_match_true(predicted: str, truth: str) -> None:
    assert answers_match(predicted, truth) is True


@pytest.mark.parametrize(
    ("predicted", "truth"),
    [
        ("0.5", "0.25"),
        ("72", "-72"),
        ("50%", "0.5"),
        ("x=5", "5"),
        ("yes", "no"),
        (r"\sqrt{2}", r"\sqrt{3}"),
    ],
)
def test_answers_match_false(predicted: str, truth: str) -> None:
    assert answers_match(predicted, truth) is False


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("72", "72"),
        ("  72\n", "72"),
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72", "72"),
        (r"The total is $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}"),
    ],
)
def test_ground_truth_answer(field: str, expected: str) -> None:
    assert ground_truth_answer(field) == expected


# --- math_reward ------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"48 + 24 = 72, so $\boxed{72}$.", "72"),
        (r"\boxed{72.0}", "She sold 72 clips.\n#### 72"),
        (r"\boxed{0.75}", r"$\boxed{\frac{3}{4}}$"),
        ("so the total is 72\n#### 72", "72"),
    ],
)
def test_math_reward_correct(response: str, answer: str) -> None:
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"\boxed{71}", "72"),
        ("The answer is 72.", "72"),  # no final-answer marker
        (r"\boxed{72} then I changed my mind: \boxed{70}", "#### 72"),
        ("", "72"),
    ],
)
def test_math_reward_wrong_or_missing(response: str, answer: str) -> None:
    assert math_reward(response, answer) == 0.0


# --- arithmetic_reward ------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer"),
    [("19", "19"), (" 19\n", "19"), ("-5", "-5"), ("0", "0")],
)
def test_arithmetic_reward_exact(response: str, answer: str) -> None:
    assert arithmetic_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("18", "19", 0.2 + 0.7 * 1 / 2),  # tens digit matches
        ("9", "19", 0.2 + 0.7 * 1 / 2),  # units digit matches, longer length counts
        ("-5", "5", 0.2 + 0.7 * 1 / 2),  # the sign is an extra unmatched character
        ("91", "19", 0.2),  # right format, no aligned match
        ("119", "19", 0.2 + 0.7 * 2 / 3),
        ("-12", "-13", 0.2 + 0.7 * 2 / 3),
        ("019", "19", 0.2 + 0.7 * 2 / 3),  # a leading zero is not exact
    ],
)
def test_arithmetic_reward_partial_credit(response: str, answer: str, expected: float) -> None:
    reward = arithmetic_reward(response, answer)
    assert reward == pytest.approx(expected)
    assert 0.2 <= reward < 0.9


@pytest.mark.parametrize("response", ["", "   ", "abc", "1 9", "19a", "+19", "19.0", "12+7=19", "--19"])
def test_arithmetic_reward_malformed(response: str) -> None:
    assert arithmetic_reward(response, "19") == 0.0


# --- registry ---------------------------------------------------------------


def test_builtin_verifiers_take_verls_signature() -> None:
    """Each built-in is called the way a user's reward function is (keywords, the ground truth as the file has it)."""
    assert sorted(BUILTIN_VERIFIERS) == ["arithmetic", "math"]
    arithmetic, math = (import_attr(BUILTIN_VERIFIERS[name]) for name in ("arithmetic", "math"))
    assert arithmetic(data_source="arithmetic", solution_str="7", ground_truth="7", extra_info={}) == 1.0
    assert arithmetic(data_source="arithmetic", solution_str="17", ground_truth=7, extra_info={}) == arithmetic_reward(
        "17", "7"
    )
    assert math(data_source="gsm8k", solution_str=r"so \boxed{72}", ground_truth=72, extra_info=None) == 1.0
    assert math(data_source="gsm8k", solution_str=r"so \boxed{71}", ground_truth="#### 72", extra_info=None) == 0.0
