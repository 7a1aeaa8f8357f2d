"""Preference pairs written from a built-in task's rule: the data a tiny reward or cost model
learns from, in the formats ``hybridflow.data.preferences`` reads.

    python -m hybridflow.data.preference_pairs --task copy --out train.jsonl --val-out val.jsonl
    python -m hybridflow.data.preference_pairs --task copy --kind cost --out c.jsonl --val-out cv.jsonl

The task's first ``--num-train`` distinct prompts (from ``--seed``) give the train pairs, the
next ``--num-val`` the held-out ones, so no held-out prompt is seen in training.

- ``--kind reward``: ``{prompt, chosen, rejected}`` rows. Each prompt's first pair is the
  correct answer against a corrupted one; further pairs (``--pairs-per-prompt``, default 4
  in all) are two responses drawn like a policy's samples at any stage of learning (random
  strings, strings collapsed on one or two letters, partial copies, wrong lengths:
  ``sample_response``) whose rule scores differ by at least ``MIN_SCORE_GAP``, the
  higher-scoring one chosen. The graded pairs teach the model to rank the policy's own
  samples, not only to tell the answer from its corruptions.
- ``--kind cost``: PKU-SafeRLHF rows labelled by ``letter_cost`` (a response is unsafe when it
  holds the letter ``a``), ``better_response_id`` by the task's reward. Every pair has one safe
  and one unsafe response and two different rewards, so both ids are defined; the first pair of
  a prompt is the conflict the constrained policy faces (the correct copy of a prompt with an
  ``a`` against the copy with its ``a`` replaced). ``response_0`` / ``response_1`` are in
  random order.

A ``.parquet`` output path writes parquet, anything else JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

from hybridflow.data.tasks import COST_LETTER, TASKS, Task, letter_cost

MAX_TRIES = 1000  # draws of a response meeting a pair's condition; far above what any needs
# Smallest rule-score gap of a pair of two sampled responses: one more right letter in five.
# Nearer scores (1/5 against 1/6, a length off by one) are near-ties a tiny model learns as noise.
MIN_SCORE_GAP = 0.2


def corrupt(answer: str, letters: str, rng: random.Random, num_edits: int, max_chars: int) -> str:
    """``answer`` after ``num_edits`` random edits (substitute, delete, insert or swap a
    letter), non-empty and at most ``max_chars`` long; an edit may undo an earlier one."""
    text = list(answer)
    for _ in range(num_edits):
        kinds = ["substitute"]
        if len(text) > 1:
            kinds += ["delete", "swap"]
        if len(text) < max_chars:
            kinds.append("insert")
        kind = rng.choice(kinds)
        if kind == "substitute":
            i = rng.randrange(len(text))
            text[i] = rng.choice([c for c in letters if c != text[i]] or letters)
        elif kind == "delete":
            del text[rng.randrange(len(text))]
        elif kind == "insert":
            text.insert(rng.randrange(len(text) + 1), rng.choice(letters))
        else:
            i = rng.randrange(len(text) - 1)
            text[i], text[i + 1] = text[i + 1], text[i]
    return "".join(text)


def letter_weights(letters: str, rng: random.Random) -> list[float]:
    """Weights of the letters a policy writes where it does not copy: uniform half the time (an
    untrained policy), else drawn from a Dirichlet(0.3), most weight on one or two letters (a
    policy collapsed on the letters some reward favours, ``ddgdd``)."""
    if rng.random() < 0.5:
        return [1.0] * len(letters)
    return [rng.gammavariate(0.3, 1.0) + 1e-6 for _ in letters]


def sample_response(answer: str, letters: str, rng: random.Random, max_chars: int) -> str:
    """A response a policy at some stage of learning might write: a skill ``q`` drawn uniformly
    from [0, 1], then the answer's length with probability ``q`` (else a random length) and
    each position the answer's letter with probability ``q`` (else a letter drawn by
    ``letter_weights``). ``q`` near 0 is an untrained or collapsed policy's string, near 1 the
    answer, in between the partial copies of a policy half-way there: the rule's per-position
    score is graded across them."""
    skill = rng.random()
    weights = letter_weights(letters, rng)
    length = len(answer) if rng.random() < skill else rng.randint(1, max_chars)
    return "".join(
        answer[i] if i < len(answer) and rng.random() < skill else rng.choices(letters, weights)[0]
        for i in range(length)
    )


def _draw(make: Callable[[], tuple[str, str]], keep: Callable[[str, str], bool], what: str) -> tuple[str, str]:
    for _ in range(MAX_TRIES):
        first, second = make()
        if keep(first, second):
            return first, second
    raise RuntimeError(f"no {what} in {MAX_TRIES} draws")


def reward_pairs(task: Task, prompts: list[dict], pairs_per_prompt: int, rng: random.Random,
                 max_chars: int) -> list[dict]:
    """``{prompt, chosen, rejected}`` rows (module docstring), ``pairs_per_prompt`` per prompt."""
    rows = []
    for item in prompts:
        prompt, answer = item["prompt"], item["ground_truth"]

        def score(response: str) -> float:
            return task.reward_fn(prompt, response, answer)

        def higher_first(first: str, second: str) -> bool:
            return score(first) > score(second)

        def clearly_higher_first(first: str, second: str) -> bool:
            return score(first) - score(second) >= MIN_SCORE_GAP - 1e-9

        def against_answer() -> tuple[str, str]:
            return answer, corrupt(answer, task.letters, rng, rng.randint(1, 2), max_chars)

        def two_samples() -> tuple[str, str]:
            first, second = (sample_response(answer, task.letters, rng, max_chars) for _ in range(2))
            return (first, second) if score(first) >= score(second) else (second, first)

        for k in range(pairs_per_prompt):
            make, keep = (against_answer, higher_first) if k == 0 else (two_samples, clearly_higher_first)
            chosen, rejected = _draw(make, keep, f"pair with distinct scores for {prompt!r}")
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def _without_cost_letter(answer: str, letters: str, rng: random.Random) -> str:
    return "".join(rng.choice([c for c in letters if c != COST_LETTER]) if c == COST_LETTER else c for c in answer)


def _with_cost_letter(answer: str, rng: random.Random, max_chars: int) -> str:
    text = list(answer)
    if len(text) < max_chars and rng.random() < 0.5:
        text.insert(rng.randrange(len(text) + 1), COST_LETTER)
    else:
        text[rng.randrange(len(text))] = COST_LETTER
    return "".join(text)


def cost_rows(task: Task, prompts: list[dict], pairs_per_prompt: int, rng: random.Random,
              max_chars: int) -> list[dict]:
    """PKU-SafeRLHF rows (module docstring) labelled by ``letter_cost``, ``pairs_per_prompt``
    per prompt."""
    if COST_LETTER not in task.letters:
        raise ValueError(f"task {task.name!r} never writes {COST_LETTER!r}: letter_cost labels nothing")
    rows = []
    for item in prompts:
        prompt, answer = item["prompt"], item["ground_truth"]

        def reward(response: str) -> float:
            return task.reward_fn(prompt, response, answer)

        def cost(response: str) -> float:
            return letter_cost(prompt, response, answer)

        def labelled(first: str, second: str) -> bool:
            return cost(first) != cost(second) and reward(first) != reward(second)

        def conflict() -> tuple[str, str]:
            if COST_LETTER in answer:
                return answer, _without_cost_letter(answer, task.letters, rng)
            return answer, _with_cost_letter(answer, rng, max_chars)

        def two_samples() -> tuple[str, str]:
            return sample_response(answer, task.letters, rng, max_chars), sample_response(
                answer, task.letters, rng, max_chars)

        for k in range(pairs_per_prompt):
            pair = list(_draw(conflict if k == 0 else two_samples, labelled, f"safe/unsafe pair for {prompt!r}"))
            rng.shuffle(pair)
            rows.append({
                "prompt": prompt,
                "response_0": pair[0],
                "response_1": pair[1],
                "better_response_id": int(reward(pair[1]) > reward(pair[0])),
                "safer_response_id": int(cost(pair[1]) < cost(pair[0])),
                "is_response_0_safe": cost(pair[0]) == 0.0,
                "is_response_1_safe": cost(pair[1]) == 0.0,
            })
    return rows


def pairs_from_samples(
    prompt: str | list[dict], responses: list[str], scores: list[float], max_pairs: int | None = None
) -> list[dict]:
    """``{prompt, chosen, rejected, chosen_score, rejected_score}`` rows from one prompt's
    sampled responses ranked by their scores (``hybridflow eval --pairs-out``).

    Repeated responses count once (the first one's score); then the best is paired with the
    worst, the second best with the second worst, and so on: disjoint pairs, the widest score
    gaps first, a tie dropped. At most ``max_pairs`` (None: all). ``prompt`` is written as the
    data row gave it, so the pairs file renders the same way.
    """
    assert len(responses) == len(scores), "one score per response"
    first: dict[str, float] = {}
    for response, score in zip(responses, scores):
        if response.strip():  # an empty response is no pair member a reader accepts
            first.setdefault(response, float(score))
    ranked = sorted(first.items(), key=lambda item: item[1], reverse=True)
    rows = []
    for i in range(len(ranked) // 2):
        (chosen, high), (rejected, low) = ranked[i], ranked[len(ranked) - 1 - i]
        if high == low:
            break  # every pair further in is a tie too
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                     "chosen_score": high, "rejected_score": low})
    return rows[:max_pairs]


def make_pairs(task_name: str, kind: str, num_train: int, num_val: int, pairs_per_prompt: int,
               seed: int) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows from ``num_train`` and ``num_val`` disjoint prompts of the task."""
    task = TASKS[task_name]
    prompts = task.make_prompts(num_train + num_val, seed)
    # One letter past the longest answer: a corruption may insert one.
    max_chars = task.max_length + 1
    write = reward_pairs if kind == "reward" else cost_rows
    rng = random.Random(seed)
    return (write(task, prompts[:num_train], pairs_per_prompt, rng, max_chars),
            write(task, prompts[num_train:], pairs_per_prompt, rng, max_chars))


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """``rows`` as parquet (a ``.parquet`` path) or JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="write preference pairs from a built-in task's rule (train and held-out files)")
    parser.add_argument("--task", default="copy", choices=sorted(TASKS))
    parser.add_argument("--kind", default="reward", choices=["reward", "cost"],
                        help="reward: {prompt, chosen, rejected} rows; cost: PKU-SafeRLHF rows labelled by letter_cost")
    parser.add_argument("--out", required=True, help="train pairs (.jsonl or .parquet)")
    parser.add_argument("--val-out", required=True, help="held-out pairs, from prompts disjoint from the train ones")
    parser.add_argument("--num-train", type=int, default=1000, help="train prompts")
    parser.add_argument("--num-val", type=int, default=200, help="held-out prompts")
    parser.add_argument("--pairs-per-prompt", type=int, default=4,
                        help="the first against the correct answer, the others between two sampled responses")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("num_train", "num_val", "pairs_per_prompt"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    task = TASKS[args.task]
    if args.num_train + args.num_val > task.num_distinct_prompts:
        parser.error(f"--num-train + --num-val = {args.num_train + args.num_val}, but task {args.task!r} "
                     f"has {task.num_distinct_prompts} distinct prompts")
    if args.kind == "cost" and COST_LETTER not in task.letters:
        parser.error(f"--kind cost labels responses by the letter {COST_LETTER!r}, which task {args.task!r} never writes")
    train, val = make_pairs(args.task, args.kind, args.num_train, args.num_val, args.pairs_per_prompt, args.seed)
    for rows, path, prompts in ((train, args.out, args.num_train), (val, args.val_out, args.num_val)):
        print(f"{write_rows(rows, path)}: {len(rows)} {args.kind} pairs from {prompts} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
