"""Built-in prompt tasks with rule rewards, small enough for a random-init tiny model to learn.

A task makes prompts ``"<letters>="`` (3 to 5 letters from a fixed alphabet) and knows the
expected answer and how to score a response. The tokenizer vocabulary is the letters, ``"="``
and the three special tokens, so a tiny model needs only a dozen output classes.

- ``copy``: the answer is the letters as given (``"cab="`` -> ``"cab"``). Measured to go from
  ~0.1 to 1.0 reward under plain GRPO on a hidden-64 two-layer Qwen2 within 60 iterations.
- ``reverse``: the answer is the letters reversed (``"cab="`` -> ``"bac"``). Harder.
- ``product``: ``"12*34="`` -> ``"408"``: beyond a tiny model, but not with a calculator;
  the multi-turn environment ``hybridflow.envs.product`` offers one.

Rewards are per-position character accuracy (see ``char_accuracy``), exposed at module level so
a graph file can name them as rule sources, e.g. ``hybridflow.data.tasks:copy_reward``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rules below are imported by reward processes that need no transformers
    from transformers import PreTrainedTokenizerFast

# reward_fn(prompt, response, ground_truth) -> reward in [0, 1]
RewardFn = Callable[[str, str, str], float]


def char_accuracy(response: str, ground_truth: str) -> float:
    """Share of positions where ``response`` matches ``ground_truth``, in [0, 1].

    ``#{i < len(ground_truth): response[i] == ground_truth[i]} / max(len(ground_truth),
    len(response))``: extra or missing characters count as wrong, so only an exact match scores
    1.0. Two empty strings match exactly (1.0).
    """
    longest = max(len(ground_truth), len(response))
    if longest == 0:
        return 1.0
    matches = sum(r == t for r, t in zip(response, ground_truth))
    return matches / longest


def copy_reward(prompt: str, response: str, ground_truth: str) -> float:
    """Reward of the ``copy`` task: character accuracy of the response against the letters."""
    return char_accuracy(response, ground_truth)


def reverse_reward(prompt: str, response: str, ground_truth: str) -> float:
    """Reward of the ``reverse`` task: character accuracy against the reversed letters."""
    return char_accuracy(response, ground_truth)


COST_LETTER = "a"


def letter_cost(prompt: str, response: str, ground_truth: str) -> float:
    """A cost that conflicts with the copy reward: 1.0 if the response uses the letter ``a``.

    About 40% of copy prompts contain an ``a``; a perfect copier pays the cost on those, so a
    policy under a tighter budget must give up some reward (leave the ``a`` out) to meet it.
    """
    return 1.0 if COST_LETTER in response else 0.0


@dataclass(frozen=True)
class Task:
    """A prompt generator with its answer rule, reward and tokenizer alphabet."""

    name: str
    letters: str  # symbols a prompt's body is drawn from
    answer: Callable[[str], str]  # prompt body -> ground truth
    reward_fn: RewardFn
    separator: str = "="  # ends every prompt; the model answers after it
    min_length: int = 3  # letters per prompt, inclusive
    max_length: int = 5
    symbols: str = ""  # more characters the model may write (tool-call tags), not in prompts
    draw: Callable[[random.Random], str] | None = None  # a prompt body; None: random letters
    num_distinct: int | None = None  # distinct bodies ``draw`` can make

    @property
    def alphabet(self) -> str:
        """Every character a prompt or answer can contain (the tokenizer's non-special vocab)."""
        return self.letters + self.symbols + self.separator

    @property
    def num_distinct_prompts(self) -> int:
        if self.num_distinct is not None:
            return self.num_distinct
        return sum(len(self.letters) ** n for n in range(self.min_length, self.max_length + 1))

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """A character tokenizer over ``alphabet`` (ids: <pad> 0, <eos> 1, <unk> 2, then chars)."""
        from hybridflow.data.tokenizer import build_char_tokenizer

        return build_char_tokenizer(self.alphabet)

    def make_prompts(self, num: int, seed: int) -> list[dict[str, str]]:
        """``num`` distinct prompts as ``{"prompt": ..., "ground_truth": ...}``, fixed by ``seed``.

        Distinct, so that splitting the list gives disjoint train and validation sets.
        """
        if num > self.num_distinct_prompts:
            raise ValueError(
                f"task {self.name!r} has only {self.num_distinct_prompts} distinct prompts, "
                f"asked for {num}"
            )
        rng = random.Random(seed)
        seen: set[str] = set()
        rows = []
        while len(rows) < num:
            if self.draw is not None:
                body = self.draw(rng)
            else:
                length = rng.randint(self.min_length, self.max_length)
                body = "".join(rng.choice(self.letters) for _ in range(length))
            if body in seen:
                continue
            seen.add(body)
            rows.append({"prompt": body + self.separator, "ground_truth": self.answer(body)})
        return rows


def _same(body: str) -> str:
    return body


def _reversed(body: str) -> str:
    return body[::-1]


def _draw_product(rng: random.Random) -> str:
    return f"{rng.randint(10, 99)}*{rng.randint(10, 99)}"


def _product(body: str) -> str:
    left, right = body.split("*")
    return str(int(left) * int(right))


def final_number(text: str) -> str:
    """The last run of digits in ``text`` ("" when it has none): a ``product`` answer, read the
    way GSM8K-style graders read the last number."""
    numbers = re.findall(r"\d+", text)
    return numbers[-1] if numbers else ""


def product_reward(prompt: str, response: str, ground_truth: str) -> float:
    """Reward of the ``product`` task as a single-turn rule: exact match of the last number
    after the last tool result (``]``), else nothing. The multi-turn environment
    (``hybridflow.envs.product``) gives the shaped rewards."""
    return float(final_number(response.rsplit("]", 1)[-1]) == ground_truth)


# Module-level functions rather than lambdas so a Task pickles (Ray ships them to workers).
TASKS: dict[str, Task] = {
    "copy": Task(name="copy", letters="abcdefgh", answer=_same, reward_fn=copy_reward),
    "reverse": Task(name="reverse", letters="abcdefgh", answer=_reversed, reward_fn=reverse_reward),
    # "12*34=": 2-digit products, a task for a calculator tool (hybridflow.envs.product);
    # "()[]" are the call and result tags.
    "product": Task(
        name="product", letters="0123456789", answer=_product, reward_fn=product_reward,
        symbols="*()[]", draw=_draw_product, num_distinct=90 * 90,
    ),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``; ``KeyError`` naming the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; expected one of {sorted(TASKS)}") from None
