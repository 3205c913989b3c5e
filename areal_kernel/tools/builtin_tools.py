"""The built-in tools: ``calculator`` (arithmetic on a parsed expression tree,
nothing evaluated as code) and ``python`` (a program run in the kernel's
``code_exec`` sandbox)."""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_INT_BITS = 1024
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_length: int = Field(200, ge=1, description="Longest expression accepted, in characters.")
    max_exponent: int = Field(64, ge=1, description="Largest absolute exponent of '**' (keeps results small).")


def evaluate_arithmetic(expression: str, *, max_length: int = 200, max_exponent: int = 64) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``,
    unary signs and parentheses. Anything else (names, calls, attributes,
    strings) is a ``ValueError`` naming it: the text is parsed, never run."""
    if len(expression) > max_length:
        raise ValueError(f"expression is {len(expression)} characters long; at most {max_length}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value  # type: ignore[return-value]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))  # type: ignore[no-any-return]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise ValueError(f"exponent {right} is larger than {max_exponent}")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            except OverflowError:
                raise ValueError("result is too large") from None
            # Bounded intermediate integers keep every step cheap (no 10**10**6).
            if isinstance(out, int) and out.bit_length() > _MAX_INT_BITS:
                raise ValueError("result is too large")
            return out  # type: ignore[no-any-return]
        raise ValueError(f"'{ast.unparse(node)}' is not allowed (numbers and + - * / // % ** only)")

    value = ev(tree)
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("result is not a finite real number")
    return value


def format_number(value: int | float) -> str:
    """``7.0`` -> ``"7"``; other floats with up to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _one_string_parameter(name: str, description: str) -> dict[str, Any]:
    """The parameters schema of a tool that takes one string argument, ``name``."""
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


def _string_argument(arguments: dict[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ValueError(f"argument '{name}' must be a string, got {value!r}")
    return value


class CalculatorTool:
    description = "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."
    parameters: dict[str, Any] = _one_string_parameter("expression", "for example (12 + 7) * 3")

    def __init__(self, max_length: int = 200, max_exponent: int = 64) -> None:
        self.max_length = max_length
        self.max_exponent = max_exponent

    async def call(self, arguments: dict[str, Any]) -> str:
        expr = _string_argument(arguments, "expression")
        return format_number(evaluate_arithmetic(expr, max_length=self.max_length, max_exponent=self.max_exponent))


class PythonToolSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(5.0, gt=0, description="Wall time of the sandboxed program.")
    memory_mb: int = Field(512, ge=16, description="Address-space limit per process.")
    max_processes: int = Field(8, ge=1, description="Processes the program may run at once.")
    max_output_chars: int = Field(2000, ge=16, description="Longest output fed back to the model.")


class PythonTool:
    description = "Run a Python program in a sandbox and return what it prints (use print for results)."
    parameters: dict[str, Any] = _one_string_parameter("code", "a complete Python program")

    def __init__(
        self, timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 8, max_output_chars: int = 2000
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_output_chars = max_output_chars

    async def call(self, arguments: dict[str, Any]) -> str:
        from areal_kernel.reward.code_exec import run_untrusted

        code = _string_argument(arguments, "code")
        # The sandbox blocks until the program ends (it enforces timeout_s
        # itself): off the event loop, so other episodes keep generating.
        res = await asyncio.to_thread(
            run_untrusted,
            code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
            output_limit=self.max_output_chars,
        )
        if res.timed_out:
            return f"error: the program ran longer than {self.timeout_s:g} s and was stopped"
        out = res.stdout
        if res.returncode != 0:
            out += ("\n" if out and not out.endswith("\n") else "") + res.stderr
            out += f"(exit code {res.returncode})"
        return out[: self.max_output_chars]
