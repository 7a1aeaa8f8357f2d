"""Batches held in the object store as shards, and how they are split over ranks.

Batches move as ``ShardedRef``: the producer's shards stay in the object store, the controller
only plans which ``[start, stop)`` piece of which shard each consumer rank reads (``plan_split``,
``plan_padded_split``), and each rank fetches and concatenates its own pieces (``resolve``). The
controller sees sizes and small meta dicts, never tensors.

Uneven batches: the DP protocols give every DP rank the same number of prompt groups. When the
groups do not divide evenly, the ranks short of a group get a copy of a real group appended
(padding); each rank reports how many of its output rows are real, and the collected
``ShardedRef`` covers only those, so padding never reaches the next node. Padded copies do take
part in the rank's own computation (a batch mean over its rows, a gradient), as in verl.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from tensordict import TensorDict, TensorDictBase

from hybridflow.workers.accounting import controller_get, count_fetched
from hybridflow.workers.wire import WireBatch, from_wire, to_wire

# (shard ref, start, stop): rows [start, stop) of one shard, indices local to that shard.
Piece = tuple[Any, int, int]

NUM_SAMPLES = "num_samples"  # meta key: samples in the shard a DP call returned


@dataclass
class ShardedRef:
    """A batch held as shards in the object store, in global sample order.

    ``refs[i]`` is a ``TensorDict`` with ``sizes[i]`` samples; the batch is their concatenation.
    """

    refs: list[Any]
    sizes: list[int]

    def __post_init__(self) -> None:
        if len(self.refs) != len(self.sizes):
            raise ValueError(f"ShardedRef: {len(self.refs)} refs but {len(self.sizes)} sizes")
        if any(size < 0 for size in self.sizes):
            raise ValueError(f"ShardedRef: negative shard size in {self.sizes}")

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @classmethod
    def put(cls, batch: TensorDictBase) -> ShardedRef:
        """One shard holding ``batch`` (how a data source hands a batch to the first node)."""
        return cls(refs=[ray.put(to_wire(batch))], sizes=[num_samples(batch)])

    def fetch(self) -> TensorDict:
        """Materialise the whole batch here (counted): for the end of a pipeline and tests."""
        shards = [from_wire(shard) for shard in controller_get(list(self.refs))]
        parts = [_slice(shard, 0, size) for shard, size in zip(shards, self.sizes)]
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


@dataclass
class PendingShards:
    """The output of a DP_SPLIT call before its sizes are known.

    ``data_refs[i]`` is the i-th collected rank's output ``TensorDict``; ``meta_refs[i]`` its
    small meta dict (with ``num_samples``, the real rows). Wait on ``meta_refs``; ``result()``
    fetches only the metas. ``all_meta_refs`` are the metas of every rank (for the timeline; a
    3D call collects data from some ranks only); empty means the same as ``meta_refs``.
    """

    data_refs: list[Any]
    meta_refs: list[Any]
    all_meta_refs: list[Any] = field(default_factory=list)

    def result(self, timeout_s: float | None = None) -> tuple[ShardedRef, list[dict[str, Any]]]:
        metas = controller_get(list(self.meta_refs), timeout_s=timeout_s)
        sizes = [int(meta[NUM_SAMPLES]) for meta in metas]
        return ShardedRef(refs=list(self.data_refs), sizes=sizes), metas


# -- splitting (controller side, pure) ------------------------------------------------------------


def _check_inputs(inputs: Sequence[ShardedRef], num_ranks: int, group_size: int) -> int:
    """The common batch size of ``inputs``; raises ValueError on what no split can fix."""
    if num_ranks < 1:
        raise ValueError(f"plan_split: num_ranks must be >= 1, got {num_ranks}")
    if group_size < 1:
        raise ValueError(f"plan_split: group_size must be >= 1, got {group_size}")
    if not inputs:
        raise ValueError("plan_split: no inputs to split")
    totals = [sharded.total for sharded in inputs]
    if len(set(totals)) != 1:
        raise ValueError(f"plan_split: inputs must have the same number of samples, got {totals}")
    total = totals[0]
    if total == 0:
        raise ValueError("plan_split: the batch is empty")
    if total % group_size:
        raise ValueError(
            f"plan_split: batch of {total} samples is not a whole number of groups of {group_size}"
        )
    return total


def plan_split(
    inputs: Sequence[ShardedRef], num_ranks: int, group_size: int
) -> list[list[list[Piece]]]:
    """Plan which pieces of each input every rank reads, refusing uneven batches.

    The global batch (each input's shards concatenated in order) is cut into ``num_ranks`` equal,
    contiguous chunks whose size is a multiple of ``group_size``, so the samples of one prompt
    (assumed contiguous, ``group_size`` of them) land on one rank. Returns
    ``plan[rank][input_index] = [(ref, start, stop), ...]`` in global order.

    Raises ``ValueError`` when the inputs disagree on the batch size, or when the batch is not a
    whole number of groups per rank (``plan_padded_split`` pads instead).
    """
    total = _check_inputs(inputs, num_ranks, group_size)
    num_groups = total // group_size
    if num_groups % num_ranks:
        raise ValueError(
            f"plan_split: {num_groups} groups of {group_size} samples ({total} samples) cannot be "
            f"split evenly across {num_ranks} ranks; make the number of prompts per batch a "
            f"multiple of {num_ranks}"
        )
    return [share.pieces for share in plan_padded_split(inputs, num_ranks, group_size)]


@dataclass(frozen=True)
class DpShare:
    """One DP rank's part of a split: ``pieces[input_index]`` (real rows, then padding rows),
    how many of its rows are real, whether the rank needs the non-tensor fields, and whether
    its output is collected (a 3D call collects one rank per DP group; the others return no
    data)."""

    pieces: list[list[Piece]]
    num_valid: int
    with_text: bool = True
    collected: bool = True


def plan_padded_split(
    inputs: Sequence[ShardedRef], num_ranks: int, group_size: int
) -> list[DpShare]:
    """Like ``plan_split``, but an uneven batch is padded instead of refused.

    The ``G`` groups go out contiguously, ``G // num_ranks`` per rank and one more to the first
    ``G % num_ranks`` ranks; every rank short of ``ceil(G / num_ranks)`` groups gets a copy of
    one real group appended (its own first group, or the batch's first when it has none). Each
    rank's ``num_valid`` counts only its real rows.
    """
    total = _check_inputs(inputs, num_ranks, group_size)
    num_groups = total // group_size
    base, extra = divmod(num_groups, num_ranks)
    per_rank_groups = base + (1 if extra else 0)
    shares = []
    first_group = 0
    for rank in range(num_ranks):
        own = base + (1 if rank < extra else 0)
        lo, hi = first_group * group_size, (first_group + own) * group_size
        pad_from = lo if own else 0
        pieces = []
        for sharded in inputs:
            rank_pieces = _pieces(sharded, lo, hi) if own else []
            for _ in range(per_rank_groups - own):
                rank_pieces += _pieces(sharded, pad_from, pad_from + group_size)
            pieces.append(rank_pieces)
        shares.append(DpShare(pieces=pieces, num_valid=hi - lo))
        first_group += own
    return shares


def _pieces(sharded: ShardedRef, lo: int, hi: int) -> list[Piece]:
    """The pieces of ``sharded`` covering global rows ``[lo, hi)``."""
    pieces: list[Piece] = []
    offset = 0
    for ref, size in zip(sharded.refs, sharded.sizes):
        start, stop = max(lo, offset), min(hi, offset + size)
        if start < stop:
            pieces.append((ref, start - offset, stop - offset))
        offset += size
        if offset >= hi:
            break
    return pieces


# -- resolving (worker side) ----------------------------------------------------------------------


def resolve(
    pieces_per_input: Sequence[Sequence[Piece]],
    fetch: Callable[[list[Hashable]], list[TensorDictBase]] | None = None,
    with_text: bool = True,
) -> TensorDict:
    """Fetch this rank's pieces and build its batch.

    Each distinct shard is fetched once (``fetch`` defaults to ``ray.get``; counted, see
    ``accounting``). The pieces of one
    input are sliced and concatenated along dim 0; then the fields of the different inputs are
    merged into one ``TensorDict``. A field present in several inputs is taken from the *first*
    input that has it (the others are assumed equal and are not compared). Non-tensor fields
    (``NonTensorStack`` of strings) are sliced and concatenated like tensors, or left out with
    ``with_text=False``.
    """
    if not pieces_per_input:
        raise ValueError("resolve: no inputs")
    fetch = fetch if fetch is not None else ray.get
    distinct = list(dict.fromkeys(ref for pieces in pieces_per_input for ref, _, _ in pieces))
    fetched = fetch(distinct)
    count_fetched(fetched)
    shards = dict(zip(distinct, fetched))
    parts = []
    for index, pieces in enumerate(pieces_per_input):
        if not pieces:
            raise ValueError(f"resolve: input {index} has no pieces")
        chunks = [_piece(shards[ref], start, stop, with_text) for ref, start, stop in pieces]
        parts.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0))
    return merge_fields(parts)


def _piece(stored: WireBatch | TensorDictBase, start: int, stop: int, with_text: bool) -> TensorDictBase:
    """Rows ``[start, stop)`` of a fetched shard as a batch (sliced before it is built)."""
    if isinstance(stored, WireBatch) and (start, stop) != (0, stored.batch_size[0]):
        return from_wire(stored.rows(start, stop), with_text)
    return _slice(from_wire(stored, with_text), start, stop)


def _slice(shard: TensorDictBase, start: int, stop: int) -> TensorDictBase:
    if start == 0 and stop == num_samples(shard):
        return shard
    # Copy a partial slice: a view would keep, and on return re-serialise, the whole shard.
    return shard[start:stop].clone()


def merge_fields(parts: Sequence[TensorDictBase]) -> TensorDict:
    """One ``TensorDict`` with the fields of all ``parts`` (same batch size); first one wins."""
    batch_size = parts[0].batch_size
    merged = TensorDict({}, batch_size=batch_size)
    for index, part in enumerate(parts):
        if part.batch_size != batch_size:
            raise ValueError(
                f"merge_fields: input {index} has batch size {tuple(part.batch_size)}, "
                f"input 0 has {tuple(batch_size)}"
            )
        for key in part.keys():
            if key not in merged.keys():
                merged.set(key, part.get(key))
    return merged


def num_samples(batch: TensorDictBase) -> int:
    """Rows of ``batch`` (its first batch dimension)."""
    if batch.batch_dims < 1:
        raise ValueError(
            f"expected a batch with a sample dimension, got batch_size {tuple(batch.batch_size)}"
        )
    return int(batch.batch_size[0])
