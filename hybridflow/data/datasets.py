"""Prompt sources and the prompt batches the controller feeds to the graph each iteration.

``load_prompt_rows`` turns ``data.source`` into train and validation rows; ``PromptDataset``
serves the train rows as fixed-size batches, epoch after epoch, with a resumable position;
``collate_prompts`` turns any list of rows into one batch (train and validation share it).

A batch is a ``TensorDict`` with batch size ``[B]`` holding the ``prompts`` fields of
``hybridflow.data.keys``::

    PROMPT_IDS    (B, P) int64  left-padded with the pad id; P = longest prompt in the batch
    PROMPT_MASK   (B, P) int64  1 on real prompt tokens
    UID           (B,)   int64  distinct per prompt (a running counter)
    PROMPT_TEXT   (B,)   str    NonTensorStack: one string per sample
    GROUND_TRUTH  (B,)   str    NonTensorStack: one string per sample ("" when unknown)

The strings are stored with ``NonTensorStack.from_list`` so indexing, ``torch.cat`` and pickling
keep one string per sample. (``td.set_non_tensor(key, list)`` would store the whole list as a
single value shared by every sample.) Read them back with ``td[key]`` (a list subclass) or
``td.get(key).tolist()``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from tensordict import NonTensorStack, TensorDict
from transformers import PreTrainedTokenizerBase

from hybridflow.data import keys
from hybridflow.data.tasks import TASKS

BUILTIN_PREFIX = "builtin:"
ORIGIN = "origin"  # optional row field: where the row came from, for error messages


class DataError(ValueError):
    """Bad prompt data; the message is one line naming the file/row and what was expected."""


# -- loading rows -----------------------------------------------------------------------------


def load_prompt_rows(
    source: str, base_dir: str, num_train: int, num_val: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """Train and validation rows ``{"prompt": str, "ground_truth": str, "origin": str}``.

    ``"builtin:NAME"`` makes ``num_train + num_val`` distinct prompts of the built-in task from
    ``seed`` (the first ``num_train`` train, the rest validation, so the splits are disjoint).
    Anything else is a JSONL file (relative paths against ``base_dir``) of
    ``{"prompt": str, "ground_truth": str}`` rows, ``ground_truth`` optional; its last
    ``num_val`` rows are the validation split, fewer if that would leave no train row.
    ``num_train`` only applies to built-in tasks. Blank lines and extra fields are ignored.
    """
    if source.startswith(BUILTIN_PREFIX):
        rows = _builtin_rows(source, num_train + num_val, seed)
        return rows[:num_train], rows[num_train:]
    rows = _jsonl_rows(source, base_dir)
    num_val = min(num_val, len(rows) - 1)
    split = len(rows) - num_val
    return rows[:split], rows[split:]


def _builtin_rows(source: str, num: int, seed: int) -> list[dict]:
    name = source[len(BUILTIN_PREFIX) :]
    if name not in TASKS:
        raise DataError(
            f"data.source {source!r}: unknown built-in task {name!r}, "
            f"expected one of {sorted(TASKS)}"
        )
    task = TASKS[name]
    if num > task.num_distinct_prompts:
        raise DataError(
            f"data.source {source!r}: num_train + num_val = {num} but the task has only "
            f"{task.num_distinct_prompts} distinct prompts"
        )
    rows = task.make_prompts(num, seed)
    return [{**row, ORIGIN: f"{source} prompt {i}"} for i, row in enumerate(rows)]


def _jsonl_rows(source: str, base_dir: str) -> list[dict]:
    path = source if os.path.isabs(source) else os.path.join(base_dir, source)
    if not os.path.isfile(path):
        raise DataError(
            f"{path}: no such prompt file (data.source {source!r}, "
            f'expected "builtin:NAME" or a JSONL file)'
        )
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read prompt file as UTF-8 text ({e})") from None

    rows = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: expected valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise DataError(f'{where}: expected a JSON object with a string "prompt"')
        if not obj["prompt"]:
            raise DataError(f'{where}: expected a non-empty "prompt"')
        ground_truth = obj.get("ground_truth")
        if ground_truth is None:
            ground_truth = ""
        if not isinstance(ground_truth, str):
            raise DataError(f'{where}: expected "ground_truth" to be a string')
        rows.append({"prompt": obj["prompt"], "ground_truth": ground_truth, ORIGIN: where})
    if not rows:
        raise DataError(f"{path}: expected at least one JSON row, found none")
    return rows


# -- batches ----------------------------------------------------------------------------------


def encode_prompts(
    rows: Sequence[dict], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int
) -> list[list[int]]:
    """Token ids of each row's prompt (no special tokens added); ``DataError`` if one is empty
    or longer than ``max_prompt_length``, naming the row."""
    texts = [row["prompt"] for row in rows]
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for i, (row, ids) in enumerate(zip(rows, all_ids)):
        if not 1 <= len(ids) <= max_prompt_length:
            where = row.get(ORIGIN, f"prompt row {i}")
            raise DataError(
                f"{where}: prompt {row['prompt']!r} is {len(ids)} tokens, expected 1 to "
                f"data.max_prompt_length = {max_prompt_length}"
            )
    return [list(ids) for ids in all_ids]


def collate_prompts(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    uid_start: int = 0,
) -> TensorDict:
    """One prompt batch (module docstring) of ``rows``, uids ``uid_start, uid_start + 1, ...``.

    Prompts are left-padded to the longest prompt **in this batch**, not to
    ``max_prompt_length``, which only bounds it.
    """
    all_ids = encode_prompts(rows, tokenizer, max_prompt_length)
    return _to_batch(rows, all_ids, _pad_id(tokenizer), uid_start)


def validation_batches(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    chunk_size: int | None = None,
) -> list[TensorDict]:
    """The validation rows as batches of at most ``chunk_size`` prompts (None: one batch),
    uids ``0 .. len(rows) - 1`` across them; no batch for no rows."""
    chunk_size = chunk_size or max(len(rows), 1)
    return [
        collate_prompts(rows[start : start + chunk_size], tokenizer, max_prompt_length, start)
        for start in range(0, len(rows), chunk_size)
    ]


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.pad_token_id is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no pad token, expected one")
    return tokenizer.pad_token_id


def _to_batch(
    rows: Sequence[dict], all_ids: Sequence[Sequence[int]], pad_id: int, uid_start: int
) -> TensorDict:
    assert rows and len(rows) == len(all_ids), "a batch needs one id list per row"
    num_prompts = len(rows)
    prompt_length = max(len(ids) for ids in all_ids)
    prompt_ids = torch.full((num_prompts, prompt_length), pad_id, dtype=torch.int64)
    prompt_mask = torch.zeros((num_prompts, prompt_length), dtype=torch.int64)
    for i, ids in enumerate(all_ids):
        prompt_ids[i, prompt_length - len(ids) :] = torch.tensor(ids, dtype=torch.int64)
        prompt_mask[i, prompt_length - len(ids) :] = 1
    return TensorDict(
        {
            keys.PROMPT_IDS: prompt_ids,
            keys.PROMPT_MASK: prompt_mask,
            keys.UID: torch.arange(uid_start, uid_start + num_prompts, dtype=torch.int64),
            keys.PROMPT_TEXT: NonTensorStack.from_list([row["prompt"] for row in rows]),
            keys.GROUND_TRUTH: NonTensorStack.from_list(
                [row.get("ground_truth", "") for row in rows]
            ),
        },
        batch_size=[num_prompts],
    )


class PromptDataset:
    """Endless fixed-size prompt batches over the train rows, epoch after epoch.

    Every ``next_batch()`` holds exactly ``prompts_per_iteration`` prompts; a batch that runs
    past the end of an epoch continues into the next. With ``shuffle`` each epoch's order is a
    permutation drawn from a ``torch.Generator`` seeded from ``(seed, epoch)``, so the order
    depends only on those and ``state_dict()`` (epoch, position, next uid) resumes exactly.
    All prompts are tokenized and checked against ``max_prompt_length`` up front, so a bad
    row stops the run before its first iteration.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        prompts_per_iteration: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not rows:
            raise DataError("no training prompts, expected at least one row")
        if prompts_per_iteration < 1:
            raise ValueError(f"prompts_per_iteration must be >= 1, got {prompts_per_iteration}")
        self._rows = list(rows)
        self._ids = encode_prompts(self._rows, tokenizer, max_prompt_length)
        self._pad_id = _pad_id(tokenizer)
        self.prompts_per_iteration = prompts_per_iteration
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next prompt to serve
        self.next_uid = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> "PromptDataset":
        return self

    def __next__(self) -> TensorDict:
        return self.next_batch()

    def next_batch(self) -> TensorDict:
        """The next ``prompts_per_iteration`` prompts as a batch (module docstring)."""
        picked = []
        while len(picked) < self.prompts_per_iteration:
            if self.position == len(self._rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_iteration - len(picked), len(self._rows) - self.position)
            picked.extend(self._order[self.position : self.position + take])
            self.position += take
        rows = [self._rows[i] for i in picked]
        batch = _to_batch(rows, [self._ids[i] for i in picked], self._pad_id, self.next_uid)
        self.next_uid += len(picked)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "next_uid": self.next_uid,
            "num_rows": len(self._rows),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != len(self._rows):
            raise DataError(
                f"resume state is for {state['num_rows']} prompts, this dataset has "
                f"{len(self._rows)}: expected the same data.source and split"
            )
        if not 0 <= state["position"] <= len(self._rows):
            raise ValueError(f"resume position {state['position']} outside 0..{len(self._rows)}")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.next_uid = state["next_uid"]
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self._rows)))
        # Mix seed and epoch into one 63-bit seed; distinct (seed, epoch) pairs stay distinct
        # for any epoch count a run can reach.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return torch.randperm(len(self._rows), generator=generator).tolist()
