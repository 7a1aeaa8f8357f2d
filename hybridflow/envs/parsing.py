"""Tool calls in model text, and observations as text.

``TagFormat`` is the configurable tag format: a call is ``open + body + close``; ``open`` and
``close`` may hold ``{tool}`` (``<calc>12*3</calc>``: the tag names the tool, the body is its
argument) or not (``<tool_call>calc(12*3)</tool_call>``: the body is ``name(argument)``). A
turn's generation stops at the first ``close`` (every tool's, when ``{tool}`` is in it); the
tool's answer comes back as ``result_open + text + result_close``.

``ChatTemplateFormat`` uses the tokenizer's chat template instead: a call is a Hermes-style
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in an assistant turn ended by EOS,
and the observation is the text the template renders for a ``tool`` message after an assistant
turn (plus the next assistant header): the *difference* of two renderings, so a template that
rewrites earlier turns never changes tokens already generated (they are not re-rendered).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class ToolCall:
    tool: str
    argument: str


class TagFormat(BaseModel):
    """The tag format of tool calls and results."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    open: str = Field("<tool_call>", description="Starts a call; may contain {tool}.")
    close: str = Field("</tool_call>", description="Ends a call (generation stops there); may contain {tool}.")
    result_open: str = Field("<tool_response>", description="Starts a tool's answer.")
    result_close: str = Field("</tool_response>", description="Ends a tool's answer.")
    default_tool: str | None = Field(
        None, description="Without {tool} in the tags: the body is this tool's argument, not name(argument)."
    )

    def stop_strings(self, tools: list[str]) -> list[str]:
        return sorted({self.close.format(tool=t) for t in tools})

    def parse(self, text: str, tools: list[str]) -> ToolCall | None:
        """The last complete call in ``text``; None when there is none. A call naming no
        known tool comes back with ``tool`` as written (the environment reports the error)."""
        found: list[tuple[int, ToolCall]] = []
        if "{tool}" in self.open:
            for tool in tools:
                pattern = re.escape(self.open.format(tool=tool)) + r"(.*?)" + re.escape(self.close.format(tool=tool))
                found += [(m.end(), ToolCall(tool, m.group(1))) for m in re.finditer(pattern, text, re.S)]
        else:
            pattern = re.escape(self.open) + r"(.*?)" + re.escape(self.close)
            for m in re.finditer(pattern, text, re.S):
                body = m.group(1).strip()
                if self.default_tool is not None:
                    found.append((m.end(), ToolCall(self.default_tool, body)))
                    continue
                call = re.fullmatch(r"(\w+)\((.*)\)", body, re.S)
                found.append((m.end(), ToolCall(call.group(1), call.group(2)) if call else ToolCall("", body)))
        return max(found, key=lambda f: f[0])[1] if found else None

    def render_result(self, text: str) -> str:
        return self.result_open + text + self.result_close


class ChatTemplateFormat:
    """Tool calls and results in a tokenizer's chat template (Hermes-style calls)."""

    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tool_format 'chat' needs a tokenizer with a chat_template")
        self.tokenizer = tokenizer

    def stop_strings(self, tools: list[str]) -> list[str]:
        return []  # a chat-template turn ends at EOS

    def parse(self, text: str, tools: list[str]) -> ToolCall | None:
        calls = self.CALL.findall(text)
        if not calls:
            return None
        try:
            call = json.loads(calls[-1])
            args = call.get("arguments", "")
            return ToolCall(str(call["name"]), args if isinstance(args, str) else json.dumps(args))
        except (ValueError, KeyError, TypeError, AttributeError):
            return ToolCall("", calls[-1])

    def render_result(self, text: str) -> str:
        """What the template adds after an assistant turn for a ``tool`` message, up to the
        next assistant header. The assistant turn's own closing text after EOS (ChatML's
        newline after ``<|im_end|>``) is part of it: the model stopped at EOS."""
        t = self.tokenizer
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = t.apply_chat_template(base, tokenize=False)
        after = t.apply_chat_template([*base, {"role": "tool", "content": text}], tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("chat template: a tool message changes the rendering of earlier turns; use tool_format 'tags'")
        eos = t.eos_token or ""
        closing = before[before.rindex(eos) + len(eos):] if eos and eos in before else ""
        return closing + after[len(before):]
