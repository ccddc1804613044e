"""The calculator job's tool: every public function with type hints and a docstring in this file is a tool."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
