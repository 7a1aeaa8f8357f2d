"""Transfer protocols: how a worker method's input is split across ranks and its output collected.

A worker method declares its protocol next to its definition::

    class Scorer(Worker):
        @register(Dispatch.DP_SPLIT)
        def score(self, batch: TensorDict) -> tuple[TensorDict, dict]: ...

A protocol has a controller half (``split`` the call into one payload per rank, ``collect`` the
per-rank return refs into what ``WorkerGroup.call`` returns) and a worker half (``unpack`` a
payload into the method's positional arguments, ``pack`` the method's result into the actor's
return value(s)). The built-ins (``Dispatch``: one-to-all, all-to-all, DP split, 3D) are entries of
the same registry that ``register_protocol`` adds to.

Uneven batches: DP_SPLIT and DP_3D give every DP rank the same number of prompt groups. When the
groups do not divide evenly, the ranks short of a group get a copy of a real group appended
(padding); each rank reports how many of its output rows are real, and the collected
``ShardedRef`` covers only those, so padding never reaches the next node. Padded copies do take
part in the rank's own computation (a batch mean over its rows, a gradient), as in verl.

Rank order of the 3D protocol (megatron-core ``parallel_state`` default order ``tp-cp-ep-dp-pp``
with cp = ep = 1): tensor-parallel rank varies fastest, then data-parallel, then pipeline stage:
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``; see ``rank_coords``.

Every controller-side fetch goes through ``controller_get``, which counts the tensor bytes it
materialises (``fetched_tensor_bytes``), so "the controller never sees a rollout tensor" is a
number a test can read.

Batches move as ``ShardedRef``: the producer's shards stay in the object store, the controller
only plans which ``[start, stop)`` piece of which shard each consumer rank reads (``plan_split``),
and each rank fetches and concatenates its own pieces (``resolve``). The controller sees sizes
and small meta dicts, never tensors. A shard travels as a ``WireBatch``: its tensors as they are
and its per-sample strings as plain lists (a ``NonTensorStack`` of 256 short strings costs ~14 ms
to put and get through the object store, the same batch's tensors ~2 ms).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_non_tensor

# (shard ref, start, stop): rows [start, stop) of one shard, indices local to that shard.
Piece = tuple[Any, int, int]

NUM_SAMPLES = "num_samples"  # meta key: samples in the shard a DP_SPLIT call returned


class Dispatch(enum.StrEnum):
    """Built-in protocols; their values are their names in the protocol registry."""

    ONE_TO_ALL = "one_to_all"  # same args to every rank; a list of per-rank result refs
    ALL_TO_ALL = "all_to_all"  # every arg is a per-rank list, rank r gets item r; per-rank refs
    DP_SPLIT = "dp_split"  # batch split into contiguous, group-whole chunks; a PendingShards
    DP_3D = "dp_3d"  # one chunk per DP group, same to its TP/PP ranks; collect tp 0, last pp


# -- the wire format of a shard -------------------------------------------------------------------


class WireBatch:
    """A flat ``TensorDict`` as it is stored: tensors as they are, non-tensor fields as lists.

    ``to_wire`` / ``from_wire`` convert; ``from_wire`` also accepts a plain ``TensorDict`` (what
    a caller that ``ray.put`` a batch itself stores).
    """

    __slots__ = ("batch_size", "lists", "tensors")

    def __init__(self, tensors: dict, lists: dict, batch_size: tuple[int, ...]) -> None:
        self.tensors, self.lists, self.batch_size = tensors, lists, batch_size

    def __reduce__(self):
        return WireBatch, (self.tensors, self.lists, self.batch_size)


def to_wire(batch: TensorDictBase) -> WireBatch | TensorDictBase:
    """``batch`` in its stored form; a nested batch is stored as it is."""
    tensors, lists = {}, {}
    for key in batch.keys():
        value = batch.get(key)
        if is_non_tensor(value):
            lists[key] = value.tolist()
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            return batch
    return WireBatch(tensors, lists, tuple(batch.batch_size))


def from_wire(stored: WireBatch | TensorDictBase, with_text: bool = True) -> TensorDictBase:
    """The batch ``stored`` holds; ``with_text=False`` leaves out its non-tensor fields (building
    a ``NonTensorStack`` of 256 strings takes ~0.5 ms, and only the methods registered with
    ``text=True`` read them)."""
    if not isinstance(stored, WireBatch):
        if with_text:
            return stored
        return stored.exclude(*[k for k in stored.keys() if is_non_tensor(stored.get(k))])
    batch = TensorDict(stored.tensors, batch_size=stored.batch_size)
    for key, values in stored.lists.items() if with_text else ():
        batch.set(key, NonTensorStack.from_list(values))
    return batch


# -- the controller's one fetch -------------------------------------------------------------------

_FETCHED = {"tensor_bytes": 0}


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor inside ``value`` (tensors, TensorDicts, dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, TensorDictBase):
        return sum(
            tensor_bytes(leaf)
            for leaf in value.values(include_nested=True, leaves_only=True)
            if isinstance(leaf, torch.Tensor)
        )
    if isinstance(value, WireBatch):
        return tensor_bytes(value.tensors)
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def controller_get(refs: Any, timeout_s: float | None = None) -> Any:
    """``ray.get`` for the controller: the one place it materialises results, counted.

    Adds the tensor bytes of what it fetched to ``fetched_tensor_bytes()``.
    """
    values = ray.get(refs, timeout=timeout_s)
    _FETCHED["tensor_bytes"] += tensor_bytes(values)
    return values


def fetched_tensor_bytes() -> int:
    """Tensor bytes ``controller_get`` has materialised in this process so far."""
    return _FETCHED["tensor_bytes"]


# -- 3D coordinates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankCoords:
    """A rank's place in a TP x PP x DP layout."""

    dp: int
    tp: int
    pp: int


def rank_coords(layout: Any, rank: int) -> RankCoords:
    """``rank``'s coordinates under a resolved ``ParallelLayout`` (megatron-core's default order:
    tp fastest, then dp, then pp)."""
    if layout.dp is None:
        raise ValueError("rank_coords: resolve() the layout against its pool first")
    world = layout.tp * layout.pp * layout.dp
    if not 0 <= rank < world:
        raise IndexError(f"rank {rank} out of range for a layout of {world} ranks")
    return RankCoords(
        dp=(rank // layout.tp) % layout.dp, tp=rank % layout.tp, pp=rank // (layout.tp * layout.dp)
    )


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
        return cls(refs=[ray.put(to_wire(batch))], sizes=[_num_samples(batch)])

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
    how many of its rows are real, and whether the rank needs the non-tensor fields."""

    pieces: list[list[Piece]]
    num_valid: int
    with_text: bool = True


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

    Each distinct shard is fetched once (``fetch`` defaults to ``ray.get``). The pieces of one
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
    shards = {ref: from_wire(shard, with_text) for ref, shard in zip(distinct, fetch(distinct))}
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


def _result_passthrough(method_name: str, result: Any, payload: Any) -> Any:
    return result


def _all_ranks(num_ranks: int, kwargs: dict) -> list[int]:
    return list(range(num_ranks))


@dataclass(frozen=True)
class Protocol:
    """How one ``WorkerGroup.call`` travels.

    Controller side:
      ``split(num_ranks, args, kwargs) -> [(payload, kwargs), ...]``, one entry per rank;
      ``select(num_ranks, call_kwargs) -> [rank, ...]``: whose returns are collected (default
      all, in rank order);
      ``collect(returns_of_selected_ranks) -> result``; an entry is one ObjectRef, or a list of
      ``num_returns`` refs when ``num_returns > 1``.
    Worker side (inside ``Worker.execute``):
      ``unpack(payload) -> positional args`` of the method;
      ``pack(method_name, result, payload) -> return value`` (a ``num_returns``-tuple when > 1).
    """

    split: Callable[[int, tuple, dict], list[tuple[Any, dict]]]
    collect: Callable[[list[Any]], Any]
    num_returns: int = 1
    unpack: Callable[[Any], tuple] = _args_passthrough
    pack: Callable[[str, Any, Any], Any] = _result_passthrough
    select: Callable[[int, dict], list[int]] = _all_ranks


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
_TEXT_ATTR = "__hybridflow_text_table__"  # on a class: {method name: reads per-sample strings}
_TEXT_PROTOCOLS = (Dispatch.DP_SPLIT, Dispatch.DP_3D)  # the ones that take ``with_text=``


class _Registration:
    """What ``register`` returns inside a class body; swaps itself for the plain function.

    ``__set_name__`` runs once when the class is created: it records the method in the class's
    own tables and puts the undecorated function back, so Ray and Python see an ordinary method.
    """

    def __init__(self, fn: Callable, dispatch: Dispatch | str, text: bool) -> None:
        self.fn = fn
        self.dispatch = dispatch
        self.text = text

    def __set_name__(self, owner: type, name: str) -> None:
        for attr, value in ((_TABLE_ATTR, self.dispatch), (_TEXT_ATTR, self.text)):
            table = owner.__dict__.get(attr)
            if table is None:
                table = {}
                setattr(owner, attr, table)
            table[name] = value
        setattr(owner, name, self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def register(dispatch: Dispatch | str, *, text: bool = True) -> Callable[[Callable], Any]:
    """Declare a worker method's transfer protocol (a ``Dispatch`` or a registered name).

    ``text=False`` (DP_SPLIT and DP_3D methods): the method reads only tensors, so its ranks get
    their batches without the per-sample strings (prompt text, ground truth), which are then
    neither sent nor rebuilt.
    """
    name = str(dispatch)
    get_protocol(name)  # fail at class definition, not at the first call
    mode: Dispatch | str = Dispatch(name) if name in Dispatch._value2member_map_ else name
    if not text and mode not in _TEXT_PROTOCOLS:
        raise ValueError(f"text=False applies to DP_SPLIT and DP_3D methods, not {name!r}")

    def decorate(fn: Callable) -> _Registration:
        setattr(fn, DISPATCH_ATTR, mode)
        return _Registration(fn, mode, text)

    return decorate


def _class_table(worker_cls: type, attr: str) -> dict:
    table: dict = {}
    for klass in reversed(worker_cls.__mro__):
        table.update(klass.__dict__.get(attr, {}))
    return table


def dispatch_table(worker_cls: type) -> dict[str, Dispatch | str]:
    """``{method name: dispatch}`` of every registered method of ``worker_cls`` and its bases.

    Walks the MRO from the root down, so a subclass's registration overrides its base's; a
    method overridden without ``register`` keeps the base's dispatch.
    """
    return _class_table(worker_cls, _TABLE_ATTR)


def text_table(worker_cls: type) -> dict[str, bool]:
    """``{method name: whether it reads per-sample strings}``, like :func:`dispatch_table`."""
    return _class_table(worker_cls, _TEXT_ATTR)


# -- the built-in protocols -----------------------------------------------------------------------


def _one_to_all_split(num_ranks: int, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    return [(args, kwargs)] * num_ranks


def _all_to_all_split(num_ranks: int, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != num_ranks:
            raise TypeError(
                f"an ALL_TO_ALL call takes one item per rank in every argument; {where} is not a "
                f"list of {num_ranks}"
            )
    return [
        (tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()})
        for rank in range(num_ranks)
    ]


def _dp_inputs(kind: str, args: tuple, kwargs: dict) -> tuple[list[ShardedRef], int, dict]:
    if len(args) != 1:
        raise TypeError(
            f"a {kind} call takes one positional argument, the list of input ShardedRefs, "
            f"got {len(args)}; pass other options as keywords"
        )
    inputs = [args[0]] if isinstance(args[0], ShardedRef) else list(args[0])
    if not all(isinstance(sharded, ShardedRef) for sharded in inputs):
        raise TypeError(f"a {kind} call's inputs must be ShardedRefs")
    kwargs = dict(kwargs)
    if "group_size" not in kwargs:
        raise TypeError(f"a {kind} call needs group_size= (samples per prompt that stay together)")
    group_size = kwargs.pop("group_size")
    return inputs, group_size, kwargs


def _shares(inputs: list[ShardedRef], num_ranks: int, group_size: int, kwargs: dict) -> list[DpShare]:
    """``plan_padded_split``, with the call's ``with_text=`` (default True) on every share."""
    with_text = bool(kwargs.pop("with_text", True))
    shares = plan_padded_split(inputs, num_ranks, group_size)
    return [replace(share, with_text=with_text) for share in shares]


def _dp_split(num_ranks: int, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    inputs, group_size, kwargs = _dp_inputs("DP_SPLIT", args, kwargs)
    return [(share, kwargs) for share in _shares(inputs, num_ranks, group_size, kwargs)]


def _dp_unpack(share: DpShare) -> tuple:
    return (resolve(share.pieces, with_text=share.with_text),)


def _dp_pack(method_name: str, result: Any, share: DpShare) -> tuple[TensorDictBase, dict]:
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
    rows_in = sum(stop - start for _, start, stop in share.pieces[0])
    rows_out = _num_samples(batch)
    if rows_out % rows_in:
        raise ValueError(
            f"DP method {method_name!r} returned {rows_out} rows for {rows_in} input rows; the "
            "output must be a whole multiple of the input (padding is removed by that ratio)"
        )
    # Padding rows are last in the input, so their outputs are last too (also after an n-fold
    # expansion like generate's, which keeps each prompt's samples together).
    return to_wire(batch), {**meta, NUM_SAMPLES: share.num_valid * (rows_out // rows_in)}


def _dp_collect(per_rank: list[Any]) -> PendingShards:
    return PendingShards(
        data_refs=[refs[0] for refs in per_rank], meta_refs=[refs[1] for refs in per_rank]
    )


def _layout_of(kind: str, num_ranks: int, kwargs: dict) -> Any:
    layout = kwargs.get("layout")
    if layout is None or getattr(layout, "dp", None) is None:
        raise TypeError(f"a {kind} call needs layout= (the model's resolved ParallelLayout)")
    world = layout.tp * layout.pp * layout.dp
    if world != num_ranks:
        raise ValueError(
            f"{kind}: layout tp={layout.tp} pp={layout.pp} dp={layout.dp} has {world} ranks, the "
            f"worker group has {num_ranks}"
        )
    return layout


def _3d_split(num_ranks: int, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    inputs, group_size, kwargs = _dp_inputs("DP_3D", args, kwargs)
    layout = _layout_of("DP_3D", num_ranks, kwargs)
    kwargs.pop("layout")
    shares = _shares(inputs, layout.dp, group_size, kwargs)
    out = []
    for rank in range(num_ranks):
        coords = rank_coords(layout, rank)
        out.append((shares[coords.dp], {**kwargs, "coords": coords}))
    return out


def _3d_select(num_ranks: int, kwargs: dict) -> list[int]:
    layout = _layout_of("DP_3D", num_ranks, kwargs)
    ranks = []
    for rank in range(num_ranks):
        coords = rank_coords(layout, rank)
        if coords.tp == 0 and coords.pp == layout.pp - 1:
            ranks.append(rank)
    return sorted(ranks, key=lambda r: rank_coords(layout, r).dp)  # DP order = sample order


register_protocol(Dispatch.ONE_TO_ALL.value, Protocol(split=_one_to_all_split, collect=list))
register_protocol(Dispatch.ALL_TO_ALL.value, Protocol(split=_all_to_all_split, collect=list))
register_protocol(
    Dispatch.DP_SPLIT.value,
    Protocol(
        split=_dp_split, collect=_dp_collect, num_returns=2, unpack=_dp_unpack, pack=_dp_pack
    ),
)
register_protocol(
    Dispatch.DP_3D.value,
    Protocol(
        split=_3d_split,
        collect=_dp_collect,
        num_returns=2,
        unpack=_dp_unpack,
        pack=_dp_pack,
        select=_3d_select,
    ),
)

__all__ = [
    "NUM_SAMPLES",
    "Dispatch",
    "DpShare",
    "PendingShards",
    "Piece",
    "Protocol",
    "RankCoords",
    "ShardedRef",
    "WireBatch",
    "controller_get",
    "dispatch_table",
    "fetched_tensor_bytes",
    "get_protocol",
    "merge_fields",
    "plan_padded_split",
    "plan_split",
    "rank_coords",
    "protocol_names",
    "register",
    "register_protocol",
    "resolve",
    "tensor_bytes",
    "from_wire",
    "to_wire",
]
