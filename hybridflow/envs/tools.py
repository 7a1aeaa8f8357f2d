"""Built-in tools and the environment that offers them.

- ``calc``: arithmetic on integers and decimals (``+ - * / // % **`` and parentheses), evaluated
  in-process from the ``ast`` of the expression (no ``eval``): fast enough for every step of a
  training run.
- ``python``: runs the argument as a Python program in the sandbox (``envs.sandbox``) and
  returns its stdout, or the error line.

``ToolEnv`` runs the tool each model turn calls (``TagFormat`` or the chat template's format);
a turn without a call is the final answer, scored against the row's ground truth with exact
match. Subclass it and override ``final_reward`` / ``call_reward`` for shaped rewards.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

from hybridflow.envs.base import Environment, Step
from hybridflow.envs.parsing import ChatTemplateFormat, TagFormat, ToolCall


class ToolError(Exception):
    """A tool could not answer; the message becomes the observation."""


_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # 10**10**10 would hang the step
MAX_EXPRESSION_CHARS = 200
LEADING_ZEROS = re.compile(r"(?<![\d.\w])0+(?=\d)")


def calc(expression: str) -> str:
    """The value of an arithmetic ``expression``; ``ToolError`` for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError("error: expression too long")
    # A calculator reads "07" as 7; Python's grammar refuses leading zeros (not after a "." or a digit).
    expression = LEADING_ZEROS.sub("", expression)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("error: not an expression") from None

    def value(node: ast.AST):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError("error: exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ToolError("error: only numbers and + - * / // % ** ( )")

    try:
        result = value(tree)
    except ZeroDivisionError:
        raise ToolError("error: division by zero") from None
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


class PythonTool:
    """Runs a program in the sandbox; stdout (cut), or the error line."""

    def __init__(self, **sandbox_config: Any) -> None:
        from hybridflow.envs.sandbox import Sandbox, SandboxConfig

        self.sandbox = Sandbox(SandboxConfig(**sandbox_config))

    def __call__(self, code: str) -> str:
        result = self.sandbox.run(code)
        if not result.ok:
            raise ToolError(f"error: {result.error()}")
        return result.stdout


def build_tools(names: list[str], sandbox: dict[str, Any] | None = None) -> dict[str, Callable[[str], str]]:
    known = {"calc": lambda: calc, "python": lambda: PythonTool(**(sandbox or {}))}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; expected some of {sorted(known)}")
    return {name: known[name]() for name in names}


class ToolEnv(Environment):
    """Offers ``tools``; the first turn without a call is the answer (exact match reward).

    Args:
        tools: tool names (``calc``, ``python``) or a ready mapping name -> callable(str) -> str.
        tool_format: ``TagFormat`` fields, or ``"chat"``: Hermes-style calls and results
            rendered by the tokenizer's chat template (``ChatTemplateFormat``).
        sandbox: ``SandboxConfig`` fields for the python tool.
    """

    def __init__(self, tools: list[str] | dict[str, Callable[[str], str]] = ("calc",),
                 tool_format: dict[str, str] | str | None = None, sandbox: dict[str, Any] | None = None) -> None:
        self.tools = dict(tools) if isinstance(tools, dict) else build_tools(list(tools), sandbox)
        if isinstance(tool_format, str) and tool_format != "chat":
            raise ValueError(f"tool_format {tool_format!r}: expected 'chat' or TagFormat fields")
        self.format = None if tool_format == "chat" else TagFormat(**(tool_format or {}))
        self.row: dict[str, Any] = {}

    def use_tokenizer(self, tokenizer) -> None:
        if self.format is None:
            self.format = ChatTemplateFormat(tokenizer)

    def reset(self, row: dict[str, Any]) -> str:
        self.row = row
        self.last_result: str | None = None  # the text of the last call's answer, before rendering
        return ""

    def stop_strings(self) -> list[str]:
        return self.format.stop_strings(list(self.tools))

    def step(self, action_text: str) -> Step:
        call = self.format.parse(action_text, list(self.tools))
        if call is None:
            reward = self.final_reward(action_text)
            return Step("", reward, True, {"success": reward == 1.0})
        try:
            if call.tool not in self.tools:
                raise ToolError(f"error: unknown tool {call.tool!r}")
            text, ok = self.tools[call.tool](call.argument), True
        except ToolError as exc:
            text, ok = self.error_text(str(exc)), False
        self.last_result = text
        return Step(self.format.render_result(text), self.call_reward(call, ok), False,
                    {"tool_calls": 1, "tool_errors": int(not ok)})

    def error_text(self, message: str) -> str:
        """What a failed call shows the model (the tool's error message)."""
        return message

    def call_reward(self, call: ToolCall, ok: bool) -> float:
        """Reward of a tool-call step (0: no shaping)."""
        return 0.0

    def final_reward(self, answer: str) -> float:
        """Reward of the final answer: exact match with the ground truth."""
        return float(answer.strip() == str(self.row.get("ground_truth", "")).strip())
