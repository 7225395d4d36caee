"""The built-in tools: ``calculator`` (exact arithmetic, no ``eval``) and ``python`` (a program
run in the code-execution reward's bubblewrap sandbox).

Both are plain functions with type hints and a Google-style docstring, TRL's convention for
tools: the docstring's first line and ``Args:`` become the JSON schema the model is shown.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

#: Longest expression the calculator reads, and the largest number (in bits) it builds.
MAX_EXPRESSION_CHARS = 500
MAX_BITS = 4096
MAX_EXPONENT = 1024

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _number(value: Fraction) -> Fraction:
    if abs(value.numerator).bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise ValueError("the result is too large")
    return value


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ZeroDivisionError("zero to a negative power")
            return _number(left ** int(right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _number(Fraction(_BINARY[type(node.op)](left, right)))
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "1234 * 5678" or "(7 + 5) / 4".

    Args:
        expression: The expression: numbers, + - * / // % ** and parentheses.
    """
    text = expression.replace("×", "*").replace("÷", "/").replace(",", "").strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    value = _evaluate(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


#: Limits of one ``python`` tool call (wall-clock and CPU seconds, memory, output).
PYTHON_TIMEOUT_S = 5.0
PYTHON_MEMORY_MB = 256
PYTHON_MAX_OUTPUT_CHARS = 4000


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout, then any error).

    Args:
        code: The program; print the values you need.
    """
    from builtin_rewards.sandbox import SandboxLimits, run_python

    limits = SandboxLimits(
        timeout=PYTHON_TIMEOUT_S, cpu_seconds=math.ceil(PYTHON_TIMEOUT_S), memory_mb=PYTHON_MEMORY_MB,
        max_output_bytes=PYTHON_MAX_OUTPUT_CHARS * 4,
    )
    try:
        result = run_python(code, limits=limits)
    except Exception as exc:  # noqa: BLE001 - e.g. the host out of processes: the model's error, not the trainer's
        return f"Error: the program could not be run ({type(exc).__name__}: {exc})"
    out = result.stdout
    # Killed at the wall clock, or by the CPU-time limit (SIGKILL / SIGXCPU): either is the time limit.
    if result.timed_out or result.returncode in (128 + 9, 128 + 24, -9, -24):
        out += f"\nError: the program was stopped after {PYTHON_TIMEOUT_S:g} seconds"
    elif result.returncode != 0:
        err = result.stderr.strip().splitlines()
        out += "\n" + ("\n".join(err[-5:]) if err else f"Error: exit status {result.returncode}")
    out = out.strip()
    return out[:PYTHON_MAX_OUTPUT_CHARS] if out else "(no output)"
