"""Rule-based verifier for math answers (GSM8K / MATH style).

A response is graded by pulling its final answer out of the last ``\\boxed{...}``
(or, failing that, the text after a GSM8K ``####`` marker) and comparing it with
the dataset's answer: exactly as rationals when both sides are numbers, else as
normalized strings.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_GSM8K_MARKER = "####"

_TEXT_WRAPPER = re.compile(r"\\text\{([^{}]*)\}")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_WHITESPACE = re.compile(r"\s+")

_UNSIGNED = r"(?:\d+(?:\.\d*)?|\.\d+)"
_DECIMAL = re.compile(rf"[+-]?{_UNSIGNED}")
_SLASH_FRACTION = re.compile(rf"([+-]?{_UNSIGNED})/([+-]?{_UNSIGNED})")
# \frac{3}{4}, \dfrac{3}{4}, \tfrac{3}{4}, and the brace-less shorthand \frac34.
_FRAC_ARG = rf"(?:\{{([+-]?{_UNSIGNED})\}}|(\d))"
_LATEX_FRACTION = re.compile(rf"([+-]?)\\[dt]?frac{_FRAC_ARG}{_FRAC_ARG}")
_PERCENT_SUFFIX = re.compile(r"\\?%$")


def _balanced_group(text: str, open_index: int) -> str | None:
    """Content of the ``{...}`` group opening at ``open_index``; None if it never closes."""
    depth = 0
    index = open_index
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2  # an escaped brace like \{ does not open or close a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
        index += 1
    return None


def _box_argument(text: str, after_command: int) -> str | None:
    """Argument of a box command ending at ``after_command``: a braced group or one token."""
    rest = text[after_command:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _balanced_group(text, after_command + len(rest) - len(stripped))
    if len(stripped) == len(rest):  # "\boxed5" is not a box command followed by a token
        return None
    token = re.match(r"[^\s$]+", stripped)
    return token.group(0) if token else None


def _last_boxed(text: str) -> str | None:
    contents = (_box_argument(text, m.end()) for m in _BOX_COMMAND.finditer(text))
    well_formed = [content for content in contents if content is not None]
    return well_formed[-1] if well_formed else None


def _after_last_gsm8k_marker(text: str) -> str | None:
    position = text.rfind(_GSM8K_MARKER)
    if position < 0:
        return None
    return text[position + len(_GSM8K_MARKER) :].split("\n", 1)[0]


def extract_answer(text: str) -> str | None:
    """Final answer in ``text``: the last ``\\boxed{}``/``\\fbox{}``, else the text after the last ``####``.

    Returns None when neither is present or the extracted answer is empty.
    """
    answer = _last_boxed(text)
    if answer is None:
        answer = _after_last_gsm8k_marker(text)
    if answer is None:
        return None
    answer = answer.strip()
    return answer or None


def normalize_answer(text: str) -> str:
    """Canonical, lower-cased string form of an answer for string comparison.

    Removes surrounding ``$``, ``\\text{...}`` wrappers (keeping their content),
    ``\\left``/``\\right``, ``\\!``, ``\\,``, all whitespace, one trailing period and
    thousands separators ("1,000" -> "1000"). Assignments such as "x = 5" are kept
    as they are, so "x=5" does not match "5".
    """
    normalized = text.strip().strip("$")
    previous = None
    while previous != normalized:  # unwrap nested \text{\text{...}} from the inside out
        previous = normalized
        normalized = _TEXT_WRAPPER.sub(r"\1", normalized)
    normalized = _LEFT_RIGHT.sub("", normalized)
    normalized = normalized.replace("\\!", "").replace("\\,", "")
    normalized = _WHITESPACE.sub("", normalized)
    normalized = normalized.strip("$")
    if normalized.endswith("."):
        normalized = normalized[:-1]
    normalized = _THOUSANDS_SEPARATOR.sub("", normalized)
    return normalized.lower()


def _fraction(numerator: str, denominator: str) -> Fraction | None:
    divisor = Fraction(denominator)
    if divisor == 0:
        return None
    return Fraction(numerator) / divisor


def parse_number(text: str) -> Fraction | None:
    """Exact value of a numeric answer, or None when ``text`` is not a number.

    Accepts integers, decimals, signs, thousands separators, "3/4" and
    ``\\frac{3}{4}`` / ``\\dfrac{3}{4}`` (optionally negated). A percentage is read
    as the number written, so "50%" is 50, not 1/2.
    """
    candidate = _PERCENT_SUFFIX.sub("", normalize_answer(text))
    if _DECIMAL.fullmatch(candidate):
        return Fraction(candidate)
    slash = _SLASH_FRACTION.fullmatch(candidate)
    if slash:
        return _fraction(slash.group(1), slash.group(2))
    latex = _LATEX_FRACTION.fullmatch(candidate)
    if latex:
        sign, braced_num, digit_num, braced_den, digit_den = latex.groups()
        value = _fraction(braced_num or digit_num, braced_den or digit_den)
        if value is None:
            return None
        return -value if sign == "-" else value
    return None


def answers_match(predicted: str, truth: str) -> bool:
    """True when the answers are equal numbers (exactly, as rationals) or equal normalized strings."""
    predicted_number = parse_number(predicted)
    truth_number = parse_number(truth)
    if predicted_number is not None and truth_number is not None:
        return predicted_number == truth_number
    return normalize_answer(predicted) == normalize_answer(truth)


def ground_truth_answer(answer_field: str) -> str:
    """The answer a dataset row stores: extracted from a ``####``/``\\boxed`` solution, else the bare field."""
    extracted = extract_answer(answer_field)
    return extracted if extracted is not None else answer_field.strip()


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer matches the dataset answer, else 0.0."""
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, ground_truth_answer(answer)) else 0.0
