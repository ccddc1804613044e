"""The calculator job's tool: every public function with type hints and a docstring in this file is a tool."""


def multiply(numbers: list[int]) -> int:
    """Multiply integers together.

    Args:
        numbers: the factors
    """
    product = 1
    for number in numbers:
        product *= number
    return product
