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

The DP protocols move batches as ``ShardedRef`` (``hybridflow.workers.sharded``): split plans
which pieces each rank reads, unpack fetches them, pack returns the rank's output shard in its
wire format (``hybridflow.workers.wire``). The 3D protocol numbers ranks as
``ParallelLayout.coords`` does (megatron-core's default order).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tensordict import TensorDict, TensorDictBase

from hybridflow.spec.layout import ParallelLayout, RankCoords
from hybridflow.workers.accounting import count_put
from hybridflow.workers.sharded import (
    NUM_SAMPLES,
    DpShare,
    PendingShards,
    ShardedRef,
    num_samples,
    plan_padded_split,
    resolve,
)
from hybridflow.workers.wire import to_wire


class Dispatch(enum.StrEnum):
    """Built-in protocols; their values are their names in the protocol registry."""

    ONE_TO_ALL = "one_to_all"  # same args to every rank; a list of per-rank result refs
    ALL_TO_ALL = "all_to_all"  # every arg is a per-rank list, rank r gets item r; per-rank refs
    DP_SPLIT = "dp_split"  # batch split into contiguous, group-whole chunks; a PendingShards
    DP_3D = "dp_3d"  # one chunk per DP group, same to its TP/PP ranks; collect tp 0, last pp


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
    rows_out = num_samples(batch)
    if rows_out % rows_in:
        raise ValueError(
            f"DP method {method_name!r} returned {rows_out} rows for {rows_in} input rows; the "
            "output must be a whole multiple of the input (padding is removed by that ratio)"
        )
    # Padding rows are last in the input, so their outputs are last too (also after an n-fold
    # expansion like generate's, which keeps each prompt's samples together).
    if not share.collected:  # a 3D peer of the collected rank: its equal output stays here
        batch = TensorDict({}, batch_size=batch.batch_size)
    stored = to_wire(batch)
    count_put(stored)
    return stored, {**meta, NUM_SAMPLES: share.num_valid * (rows_out // rows_in)}


def _dp_collect(per_rank: list[Any]) -> PendingShards:
    return PendingShards(
        data_refs=[refs[0] for refs in per_rank], meta_refs=[refs[1] for refs in per_rank]
    )


def _layout_of(kind: str, num_ranks: int, kwargs: dict) -> ParallelLayout:
    layout = kwargs.get("layout")
    if not isinstance(layout, ParallelLayout) or layout.dp is None:
        raise TypeError(f"a {kind} call needs layout= (the model's resolved ParallelLayout)")
    world = layout.world_size
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
        coords = layout.coords(rank)
        share = replace(shares[coords.dp_rank], collected=_collected(coords))
        out.append((share, {**kwargs, "coords": coords}))
    return out


def _collected(coords: RankCoords) -> bool:
    """Whether a 3D call collects this rank's output: TP rank 0 of the last pipeline stage."""
    return coords.tp_rank == 0 and coords.is_last_stage


def _3d_select(num_ranks: int, kwargs: dict) -> list[int]:
    layout = _layout_of("DP_3D", num_ranks, kwargs)
    collected = [c for c in map(layout.coords, range(num_ranks)) if _collected(c)]
    return [c.rank for c in sorted(collected, key=lambda c: c.dp_rank)]  # DP order = sample order


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
    "DISPATCH_ATTR",
    "Dispatch",
    "Protocol",
    "dispatch_table",
    "get_protocol",
    "protocol_names",
    "register",
    "register_protocol",
    "text_table",
]
