"""The ``product`` task's environment: products of 2-digit numbers, only reachable with ``calc``.

A prompt is ``"12*34="``; a tiny model cannot compute the product (8,100 of them, none
repeated between the train and validation prompts), but it can send the expression to the
calculator (tags ``(`` and ``)``: ``(12*34)``), read the result (between ``[`` and ``]``:
``[408]``) and copy it out as its answer (``408``). Rewards, summed over an episode:

- the first call: ``CALL_REWARD`` when it is well formed (the calculator answers), and up to
  ``OPERANDS_REWARD`` (well formed or not), by the character accuracy of its expression against the
  prompt's (``12*34``: exactly the prompt's two numbers); later calls get nothing (paying
  every call taught the model to call until ``max_turns`` instead of answering);
- the final turn: its answer is the last number in it (``"408)"`` and ``"= 408"`` answer
  ``408``, as GSM8K-style graders read the last number); 1.0 for the exact product; else up to
  ``COPY_REWARD`` by the character
  accuracy of the answer against the calculator's last result, times that of the call's
  operands (copying what the calculator said about the right question: partial credit
  against the true product was won by answering ``111`` everywhere, most products starting
  with a 1, and ungated copy credit by calling ``(7)`` and answering ``7``).

The shaping lets GRPO's group-relative advantages differ while the success rate is still ~0.
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.data.tasks import char_accuracy, final_number
from hybridflow.envs.parsing import TagFormat, ToolCall
from hybridflow.envs.tools import ToolEnv

PRODUCT_FORMAT = {"open": "(", "close": ")", "result_open": "[", "result_close": "]", "default_tool": "calc"}
CALL_REWARD = 0.05
OPERANDS_REWARD = 1.0
COPY_REWARD = 0.4
QUESTION = re.compile(r"\d+\s*\*\s*\d+")


class ProductEnv(ToolEnv):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("tools", ["calc"])
        kwargs.setdefault("tool_format", PRODUCT_FORMAT)
        super().__init__(**kwargs)

    def reset(self, row: dict[str, Any]) -> str:
        self.shaped = False
        self.operands = 0.0  # character accuracy of the last call against the question
        return super().reset(row)

    def step(self, action_text: str):
        step = super().step(action_text)
        if not step.done:
            call = self.format.parse(action_text, list(self.tools))
            self.operands = char_accuracy(call.argument.strip(), self.question)
        return step

    @property
    def question(self) -> str:
        """The prompt's ``12*34``: in ``"12*34="`` or in the last message of a chat prompt
        (``"What is 12*34? ..."``, a chat model's rendering of the same task)."""
        prompt = self.row.get("prompt", "")
        text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
        found = QUESTION.search(text)
        return found.group(0) if found else text.rstrip("=")

    def error_text(self, message: str) -> str:
        # "[]" in the tag format: the tiny model's alphabet has no letters, and its budget is small
        return "" if isinstance(self.format, TagFormat) else message

    def call_reward(self, call: ToolCall, ok: bool) -> float:
        if self.shaped:
            return 0.0
        self.shaped = True  # once per episode: more calls must not pay more
        # The operands count even in a malformed call: paid only for well-formed ones, "*" (which
        # half-written calls such as "(5*)" hold) was unlearned first and never came back.
        operands = OPERANDS_REWARD * char_accuracy(call.argument.strip(), self.question)
        return (CALL_REWARD if ok else 0.0) + operands

    def final_reward(self, answer: str) -> float:
        answer = final_number(answer)
        if answer == str(self.row.get("ground_truth", "")):
            return 1.0
        if not self.last_result:
            return 0.0
        return COPY_REWARD * char_accuracy(answer, self.last_result) * self.operands
