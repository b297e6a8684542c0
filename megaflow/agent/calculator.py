"""The calculator tool: arithmetic on exact numbers, parsed, never ``eval``-ed.

Grammar: integers and decimals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses.
The expression is parsed with Python's own parser (:func:`ast.parse` in ``eval`` mode,
which builds a syntax tree and runs nothing) and the tree is walked here, accepting only
the nodes above; names, calls, attributes, subscripts and every other construct are
refused. Numbers are :class:`fractions.Fraction`, so ``0.1 + 0.2`` is ``0.3`` and
``1/3*3`` is ``1``. Size limits keep a call cheap: at most 512 characters, exponents up to
1,000 in size, and no intermediate value with a numerator or denominator above 4,096 bits.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from megaflow.agent.tool import Tool, ToolError

MAX_CHARS = 512
MAX_EXPONENT = 1000
MAX_BITS = 4096

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: operator.mod,
}


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression``.

    Raises:
        ToolError: syntax error, a construct outside the grammar, division by zero, a
            non-integer or too large exponent, a value beyond the size limits.
    """
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters", kind="bad_expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"cannot parse expression: {getattr(e, 'msg', e)}", kind="bad_expression") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero", kind="math_error") from None
    except RecursionError:
        raise ToolError("expression nested too deeply", kind="bad_expression") from None


def format_number(value: Fraction) -> str:
    """An integer as digits, any other value as a decimal with up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _checked(Fraction(node.value))
    if isinstance(node, ast.Constant) and type(node.value) is float:
        if not math.isfinite(node.value):
            raise ToolError("number too large", kind="math_error")
        return Fraction(repr(node.value))  # the shortest decimal of the literal: 0.1 is 1/10
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _checked(_power(_value(node.left), _value(node.right)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_value(node.left), _value(node.right)))
    raise ToolError(f"unsupported syntax: {type(node).__name__} (numbers, + - * / // % ** and parentheses only)",
                    kind="bad_expression")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("exponent must be an integer", kind="math_error")
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent beyond {MAX_EXPONENT}", kind="math_error")
    size = max(abs(base.numerator), base.denominator).bit_length()
    if size * abs(int(exponent)) > MAX_BITS:
        raise ToolError("result too large", kind="math_error")
    return base ** int(exponent)


def _checked(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator).bit_length() > MAX_BITS:
        raise ToolError("result too large", kind="math_error")
    return value


class Calculator(Tool):
    """``calculator(expression)``: the exact value of an arithmetic expression as text."""

    name = "calculator"
    description = "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
                  "required": ["expression"]}
    timeout_s = 5.0

    def call(self, args: Mapping[str, Any]) -> str:
        return format_number(evaluate(args["expression"]))
