"""Preference pairs: the data a reward or cost model is trained on.

Read with HF ``datasets`` from the same local files as prompts (``data.train_files`` /
``data.val_files``: parquet, ``.jsonl`` or ``.json`` lines), in the conventions users have. The
format of each row is told by its fields:

- TRL / OpenRLHF: ``{"prompt", "chosen", "rejected"}``, each response a string or chat messages
  whose last message is the assistant's response. Messages before it, if any, must be the
  prompt's (HuggingFaceH4's ultrafeedback writes the whole conversation); without a ``prompt``
  field they are the prompt (TRL's "implicit prompt"). An optional ``margin`` (a number, TRL's
  column) is how far the chosen score must exceed the rejected one.
- PKU-SafeRLHF: ``prompt``, ``response_0``, ``response_1``, ``better_response_id``,
  ``safer_response_id``, ``is_response_0_safe``, ``is_response_1_safe``. Reward pairs take
  ``better_response_id`` as chosen; cost pairs (``kind="cost"``) take the *less* safe response
  as chosen, since a cost model must score it higher, and keep both safety labels for
  Safe-RLHF's sign term.

A row is ``{"prompt", "chosen", "rejected", "margin", "chosen_safe", "rejected_safe",
"chosen_field", "rejected_field", "origin", "field"}``: responses as their text, the safety
labels None for reward pairs, ``*_field`` the row field each response came from (for errors).
A bad row stops reading with one line naming the file, the row and the field
(``DataError``, exit 2 before any worker starts).

Tokens: the prompt is rendered as a prompt batch renders it (``render_prompt``: chat messages
through the chat template with the generation prompt); each response is its text's tokens and
then EOS, exactly what a rollout of that prompt would hold had the policy written it. A scalar
model scores a response at its last token (EOS), as the score op reads a rollout.

A pair batch (``collate_pairs``) is a ``TensorDict`` of B pairs::

    PROMPT_IDS, PROMPT_MASK  (B, P) int64  left-padded, as a prompt batch
    UID                      (B,)   int64  distinct per pair (a running counter)
    PROMPT_TEXT              (B,)   str    the rendered prompt
    CHOSEN_IDS, CHOSEN_MASK  (B, R) int64  right-padded with the pad id, EOS last
    REJECTED_IDS, REJECTED_MASK  (B, R) int64  the same length R as the chosen ones
    PAIR_MARGIN              (B,)   float
    CHOSEN_SAFETY_SIGN, REJECTED_SAFETY_SIGN  (B,) float  cost pairs only: +1 unsafe, -1 safe

Pairs are the batch dimension, so a batch split across data-parallel ranks keeps each pair
whole; ``pair_forward_batch`` then lays a rank's pairs out as 2B rollout-shaped samples for one
forward of the scalar model over chosen and rejected together, and ``pair_loss_inputs`` reads a
micro-batch's scores back into the arguments of a pairwise loss (``hybridflow.algos``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from tensordict import NonTensorStack, TensorDict
from transformers import PreTrainedTokenizerBase

from hybridflow.data import keys as K
from hybridflow.data.batch import sequence_fields
from hybridflow.data.datasets import (
    FIELD,
    ORIGIN,
    DataError,
    PromptDataset,
    _pad_id,
    check_messages,
    check_prompt,
    encode_prompts,
    read_records,
)
from hybridflow.data.echo import shorten
from hybridflow.data.tokenizer import is_char_tokenizer

PairKind = Literal["reward", "cost"]
PAIR_KINDS: tuple[str, ...] = ("reward", "cost")

PKU_REWARD_FIELDS = ("prompt", "response_0", "response_1", "better_response_id")
PKU_COST_FIELDS = ("prompt", "response_0", "response_1", "safer_response_id", "is_response_0_safe",
                   "is_response_1_safe")
_PKU_MARKERS = ("response_0", "response_1", "better_response_id", "safer_response_id",
                "is_response_0_safe", "is_response_1_safe")


# -- rows -------------------------------------------------------------------------------------


def read_pairs(path: str, kind: PairKind = "reward", field: str = "data.train_files") -> list[dict]:
    """The checked pair rows (module docstring) of one parquet or JSONL file."""
    if kind not in PAIR_KINDS:
        raise ValueError(f"pair kind {kind!r}, expected one of {PAIR_KINDS}")
    raw, wheres = read_records(path, field)
    return [pair_row(obj, where, field, kind) for obj, where in zip(raw, wheres)]


def load_pair_data(data, graph_file: str | Path | None, kind: PairKind = "reward") -> tuple[list[dict], list[dict]]:
    """Train and validation pairs of a ``DataSpec``: ``data.train_files`` read first (so a bad
    train row is the error a user sees first), then ``data.val_files`` (the first
    ``data.num_val`` pairs), else the last ``data.num_val`` train pairs, at least one train pair
    left. Paths as ``load_data`` takes them."""
    from hybridflow.spec.loading import resolve_relative

    def read(field: str, files) -> list[dict]:
        rows = []
        for path in [files] if isinstance(files, str) else files:
            rows += read_pairs(str(resolve_relative(path, graph_file)), kind, field)
        return rows

    if data.train_files is None:
        raise DataError(
            "data.train_files: expected preference files ({prompt, chosen, rejected} or PKU-SafeRLHF "
            "rows) to train a scalar model on",
            "data.train_files",
        )
    train = read("data.train_files", data.train_files)
    if data.val_files is not None:
        return train, read("data.val_files", data.val_files)[: data.num_val]
    keep = min(data.num_val, len(train) - 1)
    return train[: len(train) - keep], train[len(train) - keep :]


def pair_row(obj: dict, where: str, field: str, kind: PairKind = "reward") -> dict:
    """One checked pair row (module docstring) of a TRL/OpenRLHF or PKU-SafeRLHF record."""
    # "is not None": parquet gives a row every column of its file, None where it has none
    is_trl = obj.get("chosen") is not None or obj.get("rejected") is not None
    if not is_trl and all(obj.get(name) is None for name in _PKU_MARKERS):
        raise DataError(
            f"{where}: chosen: missing; expected a preference row, {{prompt, chosen, rejected}} or "
            f"PKU-SafeRLHF's {{prompt, response_0, response_1, better_response_id, ...}} "
            f"(found {shorten(', '.join(sorted(map(str, obj))) or 'no field')})",
            field,
        )
    if is_trl and kind == "cost":
        raise DataError(
            f"{where}: safer_response_id: missing; cost pairs need PKU-SafeRLHF rows "
            f"({', '.join(PKU_COST_FIELDS)}), {{prompt, chosen, rejected}} has no safety labels",
            field,
        )
    row = _trl_row(obj, where, field) if is_trl else _pku_row(obj, where, field, kind)
    if row["chosen"] == row["rejected"]:
        raise DataError(
            f"{where}: {row['rejected_field']}: the same as {row['chosen_field']}; expected two "
            "different responses",
            field,
        )
    return {**row, ORIGIN: where, FIELD: field}


def _missing(obj: dict, names: Sequence[str], where: str, field: str, what: str) -> None:
    for name in names:
        if obj.get(name) is None:
            raise DataError(f"{where}: {name}: missing; expected {what}", field)


def _response(value, name: str, where: str, field: str) -> tuple[list[dict] | None, str]:
    """``(messages before the response or None, response text)`` of a string or a message list
    ending with the assistant's response."""
    if isinstance(value, str):
        leading, text = None, value
    elif isinstance(value, list) and value:
        messages = check_messages(value, where, field, name)
        last = len(messages) - 1
        if messages[last]["role"] != "assistant":
            raise DataError(
                f"{where}: {name}[{last}].role: expected assistant (the response is the last "
                f"message), got {messages[last]['role']!r}",
                field,
            )
        leading, text = messages[:last], messages[last]["content"]
    else:
        raise DataError(
            f"{where}: {name}: expected a string or a list of {{role, content}} messages", field
        )
    if not text.strip():
        raise DataError(f"{where}: {name}: expected a non-empty response", field)
    return leading, text


def _as_messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _trl_row(obj: dict, where: str, field: str) -> dict:
    _missing(obj, ("chosen", "rejected"), where, field, "a string or chat messages")
    chosen_leading, chosen = _response(obj["chosen"], "chosen", where, field)
    rejected_leading, rejected = _response(obj["rejected"], "rejected", where, field)
    if obj.get("prompt") is not None:
        prompt = check_prompt(obj["prompt"], where, field)
        for name, leading in (("chosen", chosen_leading), ("rejected", rejected_leading)):
            if leading and leading != _as_messages(prompt):
                raise DataError(
                    f"{where}: {name}: the messages before its response differ from prompt; "
                    "expected the prompt's messages or the response alone",
                    field,
                )
        # A string prompt whose responses are conversations is a chat: render it as one.
        prompt = chosen_leading or rejected_leading or prompt
    elif chosen_leading and rejected_leading:
        if chosen_leading != rejected_leading:
            raise DataError(
                f"{where}: rejected: the messages before its response differ from chosen's; "
                "expected one prompt for both",
                field,
            )
        prompt = chosen_leading
    else:
        raise DataError(
            f"{where}: prompt: missing; expected a string or chat messages (or chosen and rejected "
            "as conversations that start with it)",
            field,
        )
    margin = obj.get("margin")
    if margin is None:
        margin = 0.0
    elif isinstance(margin, bool) or not isinstance(margin, Real) or not math.isfinite(margin):
        raise DataError(f"{where}: margin: expected a finite number, got {shorten(repr(margin))}", field)
    return {
        "prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": float(margin),
        "chosen_safe": None, "rejected_safe": None, "chosen_field": "chosen", "rejected_field": "rejected",
    }


def _response_id(obj: dict, name: str, where: str, field: str) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1):
        raise DataError(f"{where}: {name}: expected 0 or 1, got {shorten(repr(value))}", field)
    return value


def _pku_row(obj: dict, where: str, field: str, kind: PairKind) -> dict:
    needed = PKU_COST_FIELDS if kind == "cost" else PKU_REWARD_FIELDS
    _missing(obj, needed, where, field, f"PKU-SafeRLHF's fields ({', '.join(needed)})")
    prompt = check_prompt(obj["prompt"], where, field)
    responses = [_response(obj[f"response_{i}"], f"response_{i}", where, field)[1] for i in (0, 1)]
    if kind == "reward":
        chosen = _response_id(obj, "better_response_id", where, field)
        safe = [None, None]
    else:
        chosen = 1 - _response_id(obj, "safer_response_id", where, field)  # higher cost: the less safe
        safe = []
        for i in (0, 1):
            label = obj[f"is_response_{i}_safe"]
            if not isinstance(label, bool):
                raise DataError(
                    f"{where}: is_response_{i}_safe: expected true or false, got {shorten(repr(label))}", field
                )
            safe.append(label)
    rejected = 1 - chosen
    return {
        "prompt": prompt, "chosen": responses[chosen], "rejected": responses[rejected], "margin": 0.0,
        "chosen_safe": safe[chosen], "rejected_safe": safe[rejected],
        "chosen_field": f"response_{chosen}", "rejected_field": f"response_{rejected}",
    }


# -- tokens and batches -------------------------------------------------------------------------


class EncodedPair(NamedTuple):
    prompt_text: str
    prompt_ids: list[int]
    chosen_ids: list[int]  # EOS last
    rejected_ids: list[int]


def response_ids(tokenizer: PreTrainedTokenizerBase, text: str, ended: bool = True) -> list[int]:
    """How a scalar model reads a response: its text's tokens, then EOS where it ended (a pair's
    responses always end). An empty response that did not end is EOS alone: one token to read."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.eos_token_id] if ended or not ids else list(ids)


def encode_pairs(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    max_response_length: int,
    system_prompt: str | None = None,
) -> list[EncodedPair]:
    """The tokens of each pair row (module docstring). ``DataError`` naming the row and field
    for a prompt outside 1..``max_prompt_length`` tokens, a response over
    ``max_response_length`` tokens with its EOS, or a response holding characters a built-in
    task's tokenizer does not have."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no EOS token, expected one")
    prompts = encode_prompts(rows, tokenizer, max_prompt_length, system_prompt)
    char_vocab = tokenizer.get_vocab() if is_char_tokenizer(tokenizer) else None
    encoded = []
    for i, (row, (text, prompt_ids)) in enumerate(zip(rows, prompts)):
        where, field = row.get(ORIGIN, f"pair row {i}"), row.get(FIELD, "data.train_files")
        responses = []
        for side in ("chosen", "rejected"):
            name = row.get(f"{side}_field", side)
            if char_vocab is not None and (missing := sorted({c for c in row[side] if c not in char_vocab})):
                raise DataError(
                    f"{where}: {name}: has characters outside the built-in task's tokenizer: "
                    f"{shorten(repr(''.join(missing)))}; expected only its alphabet",
                    field,
                )
            ids = response_ids(tokenizer, row[side])
            if len(ids) > max_response_length:
                raise DataError(
                    f"{where}: {name}: the response is {len(ids)} tokens with its EOS, expected at most "
                    f"data.max_response_length = {max_response_length}",
                    field,
                )
            responses.append(ids)
        encoded.append(EncodedPair(text, list(prompt_ids), *responses))
    return encoded


def collate_pairs(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    max_response_length: int,
    uid_start: int = 0,
    system_prompt: str | None = None,
) -> TensorDict:
    """One pair batch (module docstring) of ``rows``, uids ``uid_start, uid_start + 1, ...``;
    safety signs when every row has safety labels (cost pairs)."""
    encoded = encode_pairs(rows, tokenizer, max_prompt_length, max_response_length, system_prompt)
    return pairs_to_batch(rows, encoded, _pad_id(tokenizer), uid_start)


def _left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.int64)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _right_pad(seqs: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        mask[i, : len(s)] = 1
    return ids, mask


def _sign(safe: bool) -> float:
    return -1.0 if safe else 1.0  # Safe-RLHF: +1 unsafe, -1 safe


def pairs_to_batch(rows: Sequence[dict], encoded: Sequence[EncodedPair], pad_id: int, uid_start: int = 0) -> TensorDict:
    """The pair batch of already encoded rows (``encode_pairs``)."""
    assert rows and len(rows) == len(encoded), "a pair batch needs one encoding per row"
    num_pairs = len(rows)
    prompt_ids, prompt_mask = _left_pad([e.prompt_ids for e in encoded], pad_id)
    width = max(len(ids) for e in encoded for ids in (e.chosen_ids, e.rejected_ids))
    chosen_ids, chosen_mask = _right_pad([e.chosen_ids for e in encoded], width, pad_id)
    rejected_ids, rejected_mask = _right_pad([e.rejected_ids for e in encoded], width, pad_id)
    fields = {
        K.PROMPT_IDS: prompt_ids,
        K.PROMPT_MASK: prompt_mask,
        K.UID: torch.arange(uid_start, uid_start + num_pairs, dtype=torch.int64),
        K.PROMPT_TEXT: NonTensorStack.from_list([e.prompt_text for e in encoded]),
        K.CHOSEN_IDS: chosen_ids,
        K.CHOSEN_MASK: chosen_mask,
        K.REJECTED_IDS: rejected_ids,
        K.REJECTED_MASK: rejected_mask,
        K.PAIR_MARGIN: torch.tensor([row.get("margin", 0.0) for row in rows], dtype=torch.float32),
    }
    labelled = [row.get("chosen_safe") is not None and row.get("rejected_safe") is not None for row in rows]
    if all(labelled):
        fields[K.CHOSEN_SAFETY_SIGN] = torch.tensor([_sign(r["chosen_safe"]) for r in rows], dtype=torch.float32)
        fields[K.REJECTED_SAFETY_SIGN] = torch.tensor([_sign(r["rejected_safe"]) for r in rows], dtype=torch.float32)
    else:
        assert not any(labelled), "a batch mixes cost pairs with unlabelled pairs"
    return TensorDict(fields, batch_size=[num_pairs])


def pair_forward_batch(pairs: TensorDict) -> TensorDict:
    """A pair batch's B pairs as 2B rollout-shaped samples for one forward of a scalar model.

    Row ``2i`` is pair i's chosen response, row ``2i + 1`` its rejected one, each after the
    pair's prompt: ``prompt_ids``, ``prompt_mask``, ``responses``, ``response_mask``,
    ``input_ids``, ``attention_mask``, ``position_ids`` of ``hybridflow.data.keys``, and the
    pair's own fields (``uid``, ``pair_margin``, the safety signs) on both of its rows.
    Interleaved, so that a train engine's in-order split into micro-batches of an even size
    keeps every pair in one micro-batch; ``pair_loss_inputs`` checks it did.
    """
    index = torch.arange(pairs.batch_size[0]).repeat_interleave(2)
    chosen_row = torch.arange(index.shape[0]) % 2 == 0
    prompt_ids, prompt_mask = pairs[K.PROMPT_IDS][index], pairs[K.PROMPT_MASK][index]
    responses = torch.where(chosen_row[:, None], pairs[K.CHOSEN_IDS][index], pairs[K.REJECTED_IDS][index])
    response_mask = torch.where(chosen_row[:, None], pairs[K.CHOSEN_MASK][index], pairs[K.REJECTED_MASK][index])
    per_pair = [K.UID, K.PAIR_MARGIN, K.CHOSEN_SAFETY_SIGN, K.REJECTED_SAFETY_SIGN]
    return TensorDict(
        {
            K.PROMPT_IDS: prompt_ids,
            K.PROMPT_MASK: prompt_mask,
            K.RESPONSES: responses,
            K.RESPONSE_MASK: response_mask,
            **sequence_fields(prompt_ids, prompt_mask, responses, response_mask),
            **{key: pairs[key][index] for key in per_pair if key in pairs.keys()},
        },
        batch_size=[index.shape[0]],
    )


def responses_as_text_tokens(batch: TensorDict, tokenizer: PreTrainedTokenizerBase) -> TensorDict:
    """A rollout batch whose responses are re-encoded as a pair's are: each response's decoded
    text (special tokens dropped, as decoding drops them) encoded again, then EOS where the
    response ended with it. A scalar model trained on pairs reads this, so the tokens a policy
    writes that its text does not show (a char tokenizer's ``<unk>`` or ``<pad>`` in the middle
    of an answer) cannot move its score: the model never saw one, and a policy finds what an
    unseen token scores. ``responses``, ``response_mask`` and the sequence fields are replaced,
    every other field kept. A multi-turn batch (observation tokens attended to but outside
    ``response_mask``) is returned as it is: its text alone is not what the model must read.
    """
    prompt_len = batch[K.PROMPT_IDS].shape[1]
    responses, mask = batch[K.RESPONSES], batch[K.RESPONSE_MASK]
    if not torch.equal(batch[K.ATTENTION_MASK][:, prompt_len:].to(mask.dtype), mask):
        return batch
    eos_id = tokenizer.eos_token_id
    last = mask.sum(-1).clamp(min=1) - 1
    ended = responses.gather(1, last[:, None])[:, 0] == eos_id
    texts = tokenizer.batch_decode(responses * mask, skip_special_tokens=True)
    seqs = [response_ids(tokenizer, text, end) for text, end in zip(texts, ended.tolist())]
    new_ids, new_mask = _right_pad(seqs, max(len(s) for s in seqs), _pad_id(tokenizer))
    out = batch.clone(recurse=False)
    out[K.RESPONSES], out[K.RESPONSE_MASK] = new_ids, new_mask
    out.update(sequence_fields(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], new_ids, new_mask))
    return out


def split_pair_scores(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen (B,), rejected (B,))`` of the (2B,) scores of a ``pair_forward_batch``."""
    assert scores.shape[0] % 2 == 0, "scores of a pair forward batch come in chosen/rejected rows"
    return scores[0::2], scores[1::2]


def pair_loss_inputs(samples: TensorDict, scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword arguments of a ``PAIR_LOSSES`` function for (a micro-batch of) a
    ``pair_forward_batch`` and the scalar model's scores of its rows (2B,): ``chosen_scores``,
    ``rejected_scores``, ``margin`` and, for cost pairs, ``chosen_signs`` / ``rejected_signs``,
    each (B,). ``ValueError`` if the rows do not hold whole pairs (an odd micro-batch size, or
    micro-batches cut by a token budget)."""
    uid = samples[K.UID]
    if uid.shape[0] % 2 or not torch.equal(uid[0::2], uid[1::2]):
        raise ValueError("these samples split a preference pair: micro-batches must hold whole pairs "
                         "(an even micro_batch_size, no micro_batch_tokens)")
    chosen, rejected = split_pair_scores(scores)
    inputs = {"chosen_scores": chosen, "rejected_scores": rejected,
              "margin": samples[K.PAIR_MARGIN][0::2].to(scores.dtype)}
    if K.CHOSEN_SAFETY_SIGN in samples.keys():
        inputs["chosen_signs"] = samples[K.CHOSEN_SAFETY_SIGN][0::2].to(scores.dtype)
        inputs["rejected_signs"] = samples[K.REJECTED_SAFETY_SIGN][0::2].to(scores.dtype)
    return inputs


class PairDataset(PromptDataset):
    """Endless fixed-size pair batches (module docstring) over the train pairs, epoch after
    epoch, shuffled and resumable exactly as ``PromptDataset`` serves prompts; every pair is
    tokenized and checked against both length limits up front, so a bad row stops the run
    before its first iteration."""

    unit = "pairs"

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        max_response_length: int,
        pairs_per_iteration: int,
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
    ) -> None:
        self.max_response_length = max_response_length
        super().__init__(rows, tokenizer, max_prompt_length, pairs_per_iteration, shuffle, seed, system_prompt)

    def _encode(self, rows, tokenizer, max_prompt_length, system_prompt) -> list[EncodedPair]:
        return encode_pairs(rows, tokenizer, max_prompt_length, self.max_response_length, system_prompt)

    def _batch(self, rows, encoded, uid_start) -> TensorDict:
        return pairs_to_batch(rows, encoded, self._pad_id, uid_start)
