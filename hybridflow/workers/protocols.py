"""Transfer protocols: how a worker method's input is split across ranks and its output collected.

A worker method declares its protocol next to its definition::

    class Scorer(Worker):
        @register(Dispatch.DP_SPLIT)
        def score(self, batch: TensorDict) -> tuple[TensorDict, dict]: ...

A protocol has a controller half (``split`` the call into one payload per rank, ``collect`` the
per-rank return refs into what ``WorkerGroup.call`` returns) and a worker half (``unpack`` a
payload into the method's positional arguments, ``pack`` the method's result into the actor's
return value(s)). The built-ins, ``Dispatch.ONE_TO_ALL`` and ``Dispatch.DP_SPLIT``, are entries of
the same registry that ``register_protocol`` adds to.

Batches move as ``ShardedRef``: the producer's shards stay in the object store, the controller
only plans which ``[start, stop)`` piece of which shard each consumer rank reads (``plan_split``),
and each rank fetches and concatenates its own pieces (``resolve``). The controller sees sizes
and small meta dicts, never tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from tensordict import TensorDict, TensorDictBase

# (shard ref, start, stop): rows [start, stop) of one shard, indices local to that shard.
Piece = tuple[Any, int, int]

NUM_SAMPLES = "num_samples"  # meta key: samples in the shard a DP_SPLIT call returned


class Dispatch(enum.StrEnum):
    """Built-in protocols; their values are their names in the protocol registry."""

    ONE_TO_ALL = "one_to_all"  # same args to every rank; a list of per-rank result refs
    DP_SPLIT = "dp_split"  # batch split into contiguous, group-whole chunks; a PendingShards


# -- batches in the object store ------------------------------------------------------------------


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
        return cls(refs=[ray.put(batch)], sizes=[_num_samples(batch)])

    def fetch(self) -> TensorDict:
        """Materialise the whole batch here: for the end of a pipeline and tests, not hot paths."""
        shards = ray.get(list(self.refs))
        return torch.cat(list(shards), dim=0) if len(shards) > 1 else shards[0]


@dataclass
class PendingShards:
    """The output of a DP_SPLIT call before its sizes are known.

    ``data_refs[r]`` is rank r's output ``TensorDict``; ``meta_refs[r]`` its small meta dict
    (with ``num_samples``). Wait on ``meta_refs``; ``result()`` fetches only the metas.
    """

    data_refs: list[Any]
    meta_refs: list[Any]

    def result(self, timeout_s: float | None = None) -> tuple[ShardedRef, list[dict[str, Any]]]:
        metas = ray.get(list(self.meta_refs), timeout=timeout_s)
        sizes = [int(meta[NUM_SAMPLES]) for meta in metas]
        return ShardedRef(refs=list(self.data_refs), sizes=sizes), metas


# -- splitting (controller side, pure) ------------------------------------------------------------


def plan_split(
    inputs: Sequence[ShardedRef], num_ranks: int, group_size: int
) -> list[list[list[Piece]]]:
    """Plan which pieces of each input every rank reads.

    The global batch (each input's shards concatenated in order) is cut into ``num_ranks`` equal,
    contiguous chunks whose size is a multiple of ``group_size``, so the samples of one prompt
    (assumed contiguous, ``group_size`` of them) land on one rank. Returns
    ``plan[rank][input_index] = [(ref, start, stop), ...]`` in global order.

    Raises ``ValueError`` when the inputs disagree on the batch size, or when the batch is not a
    whole number of groups per rank.
    """
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
    num_groups = total // group_size
    if num_groups % num_ranks:
        raise ValueError(
            f"plan_split: {num_groups} groups of {group_size} samples ({total} samples) cannot be "
            f"split evenly across {num_ranks} ranks; make the number of prompts per batch a "
            f"multiple of {num_ranks}"
        )
    chunk = total // num_ranks
    return [
        [_pieces(sharded, rank * chunk, (rank + 1) * chunk) for sharded in inputs]
        for rank in range(num_ranks)
    ]


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
) -> TensorDict:
    """Fetch this rank's pieces and build its batch.

    Each distinct shard is fetched once (``fetch`` defaults to ``ray.get``). The pieces of one
    input are sliced and concatenated along dim 0; then the fields of the different inputs are
    merged into one ``TensorDict``. A field present in several inputs is taken from the *first*
    input that has it (the others are assumed equal and are not compared). Non-tensor fields
    (``NonTensorStack`` of strings) are sliced and concatenated like tensors.
    """
    if not pieces_per_input:
        raise ValueError("resolve: no inputs")
    fetch = fetch if fetch is not None else ray.get
    distinct = list(dict.fromkeys(ref for pieces in pieces_per_input for ref, _, _ in pieces))
    shards = dict(zip(distinct, fetch(distinct)))
    parts = []
    for index, pieces in enumerate(pieces_per_input):
        if not pieces:
            raise ValueError(f"resolve: input {index} has no pieces")
        chunks = [_slice(shards[ref], start, stop) for ref, start, stop in pieces]
        parts.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0))
    return merge_fields(parts)


def _slice(shard: TensorDictBase, start: int, stop: int) -> TensorDictBase:
    if start == 0 and stop == _num_samples(shard):
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


def _num_samples(batch: TensorDictBase) -> int:
    if batch.batch_dims < 1:
        raise ValueError(
            f"expected a batch with a sample dimension, got batch_size {tuple(batch.batch_size)}"
        )
    return int(batch.batch_size[0])


# -- the protocol registry ------------------------------------------------------------------------


def _args_passthrough(payload: Any) -> tuple:
    return tuple(payload)


def _result_passthrough(method_name: str, result: Any) -> Any:
    return result


@dataclass(frozen=True)
class Protocol:
    """How one ``WorkerGroup.call`` travels.

    Controller side:
      ``split(num_ranks, args, kwargs) -> [(payload, kwargs), ...]``, one entry per rank;
      ``collect(per_rank_returns) -> result``; an entry is one ObjectRef, or a list of
      ``num_returns`` refs when ``num_returns > 1``.
    Worker side (inside ``Worker.execute``):
      ``unpack(payload) -> positional args`` of the method;
      ``pack(method_name, result) -> return value`` (a ``num_returns``-tuple when > 1).
    """

    split: Callable[[int, tuple, dict], list[tuple[Any, dict]]]
    collect: Callable[[list[Any]], Any]
    num_returns: int = 1
    unpack: Callable[[Any], tuple] = _args_passthrough
    pack: Callable[[str, Any], Any] = _result_passthrough


_PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(name: str, protocol: Protocol) -> None:
    """Add a protocol that worker methods can name in ``register(name)``."""
    if name in _PROTOCOLS:
        raise ValueError(f"transfer protocol {name!r} is already registered")
    if protocol.num_returns < 1:
        raise ValueError(f"transfer protocol {name!r}: num_returns must be >= 1")
    _PROTOCOLS[name] = protocol


def get_protocol(dispatch: Dispatch | str) -> Protocol:
    try:
        return _PROTOCOLS[str(dispatch)]
    except KeyError:
        raise KeyError(
            f"unknown transfer protocol {str(dispatch)!r}; registered: {sorted(_PROTOCOLS)}"
        ) from None


def protocol_names() -> list[str]:
    return sorted(_PROTOCOLS)


# -- declaring worker methods ---------------------------------------------------------------------

DISPATCH_ATTR = "__hybridflow_dispatch__"  # on a registered function: its Dispatch / name
_TABLE_ATTR = "__hybridflow_dispatch_table__"  # on a class: {method name: dispatch}, own methods


class _Registration:
    """What ``register`` returns inside a class body; swaps itself for the plain function.

    ``__set_name__`` runs once when the class is created: it records the method in the class's
    own table and puts the undecorated function back, so Ray and Python see an ordinary method.
    """

    def __init__(self, fn: Callable, dispatch: Dispatch | str) -> None:
        self.fn = fn
        self.dispatch = dispatch

    def __set_name__(self, owner: type, name: str) -> None:
        table = owner.__dict__.get(_TABLE_ATTR)
        if table is None:
            table = {}
            setattr(owner, _TABLE_ATTR, table)
        table[name] = self.dispatch
        setattr(owner, name, self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def register(dispatch: Dispatch | str) -> Callable[[Callable], Any]:
    """Declare a worker method's transfer protocol (a ``Dispatch`` or a registered name)."""
    name = str(dispatch)
    get_protocol(name)  # fail at class definition, not at the first call
    mode: Dispatch | str = Dispatch(name) if name in Dispatch._value2member_map_ else name

    def decorate(fn: Callable) -> _Registration:
        setattr(fn, DISPATCH_ATTR, mode)
        return _Registration(fn, mode)

    return decorate


def dispatch_table(worker_cls: type) -> dict[str, Dispatch | str]:
    """``{method name: dispatch}`` of every registered method of ``worker_cls`` and its bases.

    Walks the MRO from the root down, so a subclass's registration overrides its base's; a
    method overridden without ``register`` keeps the base's dispatch.
    """
    table: dict[str, Dispatch | str] = {}
    for klass in reversed(worker_cls.__mro__):
        table.update(klass.__dict__.get(_TABLE_ATTR, {}))
    return table


# -- the built-in protocols -----------------------------------------------------------------------


def _one_to_all_split(num_ranks: int, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    return [(args, kwargs)] * num_ranks


def _dp_split(num_ranks: int, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    if len(args) != 1:
        raise TypeError(
            "a DP_SPLIT call takes one positional argument, the list of input ShardedRefs, "
            f"got {len(args)}; pass other options as keywords"
        )
    inputs = [args[0]] if isinstance(args[0], ShardedRef) else list(args[0])
    if not all(isinstance(sharded, ShardedRef) for sharded in inputs):
        raise TypeError("a DP_SPLIT call's inputs must be ShardedRefs")
    kwargs = dict(kwargs)
    if "group_size" not in kwargs:
        raise TypeError("a DP_SPLIT call needs group_size= (samples per prompt that stay together)")
    group_size = kwargs.pop("group_size")
    plan = plan_split(inputs, num_ranks, group_size)
    return [(pieces_per_input, kwargs) for pieces_per_input in plan]


def _dp_unpack(pieces_per_input: Any) -> tuple:
    return (resolve(pieces_per_input),)


def _dp_pack(method_name: str, result: Any) -> tuple[TensorDictBase, dict]:
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], TensorDictBase)
        and isinstance(result[1], dict)
    ):
        raise TypeError(
            f"DP_SPLIT method {method_name!r} must return (TensorDict, dict), "
            f"got {type(result).__name__}"
        )
    batch, meta = result
    return batch, {**meta, NUM_SAMPLES: _num_samples(batch)}


def _dp_collect(per_rank: list[Any]) -> PendingShards:
    return PendingShards(
        data_refs=[refs[0] for refs in per_rank], meta_refs=[refs[1] for refs in per_rank]
    )


register_protocol(Dispatch.ONE_TO_ALL.value, Protocol(split=_one_to_all_split, collect=list))
register_protocol(
    Dispatch.DP_SPLIT.value,
    Protocol(
        split=_dp_split, collect=_dp_collect, num_returns=2, unpack=_dp_unpack, pack=_dp_pack
    ),
)

__all__ = [
    "NUM_SAMPLES",
    "Dispatch",
    "PendingShards",
    "Piece",
    "Protocol",
    "ShardedRef",
    "dispatch_table",
    "get_protocol",
    "merge_fields",
    "plan_split",
    "protocol_names",
    "register",
    "register_protocol",
    "resolve",
]
