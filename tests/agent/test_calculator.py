"""The calculator: exact arithmetic through a parser; everything else refused with a ToolError."""
from fractions import Fraction

import pytest

from megaflow.agent.calculator import Calculator, evaluate, format_number
from megaflow.agent.tool import ToolCall, ToolError, run_tool_call


@pytest.mark.parametrize("expression, value", [
    ("(12 + 7) * 3", Fraction(57)),
    ("0.1 + 0.2", Fraction(3, 10)),          # exact, not 0.30000000000000004
    ("2 ** -2", Fraction(1, 4)),
    ("7 // 2", Fraction(3)),
    ("-7 % 3", Fraction(2)),                 # floor modulo, as in Python
    ("-(3 - 5) * +4", Fraction(8)),
    ("1 / 3 * 3", Fraction(1)),
    ("123456789 * 987654321", Fraction(121932631112635269)),
])
def test_values(expression, value):
    assert evaluate(expression) == value


def test_formatting():
    assert format_number(Fraction(57)) == "57"
    assert format_number(Fraction(1, 3)) == "0.333333333333"
    assert format_number(Fraction(-5, 2)) == "-2.5"


@pytest.mark.parametrize("expression, kind", [
    ("__import__('os').system('true')", "bad_expression"),
    ("x + 1", "bad_expression"),
    ("[1, 2]", "bad_expression"),
    ("'a' * 3", "bad_expression"),
    ("True + 1", "bad_expression"),
    ("(1 + ", "bad_expression"),
    ("1 / 0", "math_error"),
    ("2 ** 0.5", "math_error"),
    ("9 ** 9 ** 9", "math_error"),
    ("(2 ** 1000) ** 5", "math_error"),
    ("(" * 250 + "1" + ")" * 250, "bad_expression"),  # deeper than the parser allows
    ("1 + " * 200 + "1", "bad_expression"),  # over the length limit
    ("1e400", "math_error"),
])
def test_refusals(expression, kind):
    with pytest.raises(ToolError) as info:
        evaluate(expression)
    assert info.value.kind == kind


def test_as_a_tool_call():
    tools = {"calculator": Calculator()}
    assert run_tool_call(ToolCall("calculator", {"expression": "6*7"}), tools).text == "42"
    bad = run_tool_call(ToolCall("calculator", {"expression": "six"}), tools)
    assert bad.error == "bad_expression" and bad.text.startswith("Error:")
