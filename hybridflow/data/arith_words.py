"""``builtin:arith_words``: seeded arithmetic word problems with integer answers.

Each problem is one of ``len(TEMPLATES)`` templates (one or two steps of +, -, x, /) filled
with a name, an object and numbers drawn from a ``random.Random(seed)``; the answer is always a
non-negative integer. ``make_problems(num, seed)`` returns ``num`` distinct problems as verl
rows (``data_source``, ``prompt`` as chat messages, ``ability``, ``reward_model.ground_truth``,
``extra_info``); the built-in source takes the first ``data.num_train`` as the train split and
the next ``data.num_val`` as the test split, so the two never share a problem.

``difficulty`` scales the numbers: at 1 (the default) factors and divisors are 2 to 10 and
other operands 2 to 30; ``difficulty`` multiplies those bounds.

``python -m hybridflow.data.arith_words OUT_DIR`` writes ``train.parquet`` and
``test.parquet`` in verl's schema (the same split, so ``data.train_files`` /
``data.val_files`` on them train and evaluate exactly as the built-in source does).

The answer is graded by ``hybridflow.rewards.default`` from the response's final number: the
grader knows nothing of the templates.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "hybridflow/arith_words"

NAMES = (
    "Ava", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira",
    "Leo", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera",
    "Wes", "Yuki", "Zane",
)
ITEMS = (
    "apples", "marbles", "stickers", "pencils", "cookies", "stamps", "books", "shells", "coins",
    "cards", "beads", "balloons", "oranges", "toy cars", "crayons", "eggs", "flowers", "buttons",
)


@dataclass(frozen=True)
class Template:
    """A problem shape: ``draw(rng, size)`` gives the numbers, ``text`` the words, ``answer``."""

    name: str
    text: str  # str.format fields: name, item, and the numbers a, b, c
    draw: Callable[[random.Random, int], dict[str, int]]
    answer: Callable[[dict[str, int]], int]


def _small(rng: random.Random, size: int) -> int:
    return rng.randint(2, 10 * size)


def _big(rng: random.Random, size: int) -> int:
    return rng.randint(2, 30 * size)


def _two(rng, size):
    return {"a": _big(rng, size), "b": _big(rng, size)}


def _minus(rng, size):
    a, b = _big(rng, size), _big(rng, size)
    return {"a": max(a, b), "b": min(a, b)}


def _times(rng, size):
    return {"a": _small(rng, size), "b": _small(rng, size)}


def _split(rng, size):
    b, q = _small(rng, size), _small(rng, size)
    return {"a": b * q, "b": b}


def _three(rng, size):
    a, b, c = _big(rng, size), _big(rng, size), _big(rng, size)
    return {"a": a + c, "b": b, "c": c}  # a - c + b >= 0


def _times_plus(rng, size):
    return {"a": _small(rng, size), "b": _small(rng, size), "c": _big(rng, size)}


def _times_minus(rng, size):
    a, b = _small(rng, size), _small(rng, size)
    return {"a": a, "b": b, "c": rng.randint(1, a * b)}


TEMPLATES: tuple[Template, ...] = (
    Template("add_buy", "{name} has {a} {item}. {name} buys {b} more. How many {item} does "
             "{name} have now?", _two, lambda v: v["a"] + v["b"]),
    Template("add_gift", "{name} had {a} {item} and got {b} {item} as a gift. How many {item} "
             "does {name} have in total?", _two, lambda v: v["a"] + v["b"]),
    Template("add_two_people", "{name} collected {a} {item} on Monday and {b} {item} on "
             "Tuesday. How many {item} did {name} collect over the two days?", _two,
             lambda v: v["a"] + v["b"]),
    Template("add_box", "A box holds {a} red {item} and {b} blue {item}. How many {item} are in "
             "the box?", _two, lambda v: v["a"] + v["b"]),
    Template("sub_give", "{name} has {a} {item} and gives {b} of them to a friend. How many "
             "{item} does {name} have left?", _minus, lambda v: v["a"] - v["b"]),
    Template("sub_lose", "There were {a} {item} on the table. {name} took {b} of them. How many "
             "{item} are still on the table?", _minus, lambda v: v["a"] - v["b"]),
    Template("sub_compare", "{name} has {a} {item}. A friend has {b} {item}. How many more "
             "{item} does {name} have than the friend?", _minus, lambda v: v["a"] - v["b"]),
    Template("sub_need", "{name} wants {a} {item} and already has {b}. How many more {item} "
             "does {name} need?", _minus, lambda v: v["a"] - v["b"]),
    Template("mul_bags", "{name} has {a} bags with {b} {item} in each bag. How many {item} does "
             "{name} have?", _times, lambda v: v["a"] * v["b"]),
    Template("mul_rows", "{name} puts {item} in {a} rows of {b}. How many {item} are there?",
             _times, lambda v: v["a"] * v["b"]),
    Template("mul_days", "{name} reads {b} pages every day for {a} days. How many pages does "
             "{name} read?", _times, lambda v: v["a"] * v["b"]),
    Template("mul_price", "One pack of {item} costs {b} dollars. How many dollars do {a} packs "
             "cost?", _times, lambda v: v["a"] * v["b"]),
    Template("div_share", "{name} shares {a} {item} equally among {b} friends. How many {item} "
             "does each friend get?", _split, lambda v: v["a"] // v["b"]),
    Template("div_groups", "{a} {item} are packed into bags of {b}. How many bags are there?",
             _split, lambda v: v["a"] // v["b"]),
    Template("div_rate", "{name} saved {a} dollars in {b} weeks, the same amount each week. How "
             "many dollars did {name} save each week?", _split, lambda v: v["a"] // v["b"]),
    Template("sub_add", "{name} had {a} {item}, gave away {c} and then found {b} more. How many "
             "{item} does {name} have now?", _three, lambda v: v["a"] - v["c"] + v["b"]),
    Template("add_add", "{name} has {a} {item}, a friend gives {b} more, and a neighbour gives "
             "{c} more. How many {item} does {name} have?",
             lambda rng, size: {"a": _big(rng, size), "b": _big(rng, size), "c": _big(rng, size)},
             lambda v: v["a"] + v["b"] + v["c"]),
    Template("mul_add", "{name} buys {a} boxes of {b} {item} and already had {c} {item}. How "
             "many {item} does {name} have now?", _times_plus, lambda v: v["a"] * v["b"] + v["c"]),
    Template("mul_sub", "{name} bakes {a} trays of {b} {item} and gives away {c}. How many "
             "{item} are left?", _times_minus, lambda v: v["a"] * v["b"] - v["c"]),
    Template("add_mul_price", "A notebook costs {a} dollars and a pen costs {b} dollars. How "
             "many dollars do {c} notebooks and one pen cost?",
             lambda rng, size: {"a": _small(rng, size), "b": _small(rng, size), "c": rng.randint(2, 9)},
             lambda v: v["c"] * v["a"] + v["b"]),
)


def render(template: Template, rng: random.Random, difficulty: int) -> tuple[str, int]:
    values = template.draw(rng, difficulty)
    text = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), **values)
    return text, template.answer(values)


def make_problems(num: int, seed: int, difficulty: int = 1) -> list[dict]:
    """``num`` distinct problems (module docstring), fixed by ``seed`` and ``difficulty``."""
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    attempts = 0
    while len(rows) < num:
        attempts += 1
        if attempts > 50 * num + 1000:
            raise ValueError(f"could not draw {num} distinct problems at difficulty {difficulty}")
        template = TEMPLATES[rng.randrange(len(TEMPLATES))]
        text, answer = render(template, rng, difficulty)
        if text in seen:
            continue
        seen.add(text)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": text}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": len(rows), "template": template.name, "answer": answer},
            }
        )
    return rows


def write_parquet(out_dir: str | Path, num_train: int, num_test: int, seed: int, difficulty: int = 1) -> list[Path]:
    """``train.parquet`` and ``test.parquet`` (verl schema) of the same split the built-in
    source makes from ``seed``: the first ``num_train`` problems, then ``num_test`` more."""
    import datasets

    rows = make_problems(num_train + num_test, seed, difficulty)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, part in (("train", rows[:num_train]), ("test", rows[num_train:])):
        for row in part:
            row["extra_info"]["split"] = split
        path = out / f"{split}.parquet"
        datasets.Dataset.from_list(part).to_parquet(str(path))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write arith_words train/test parquet files (verl schema)")
    parser.add_argument("out_dir")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, default=1)
    args = parser.parse_args(argv)
    for path in write_parquet(args.out_dir, args.num_train, args.num_test, args.seed, args.difficulty):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
