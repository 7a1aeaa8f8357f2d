"""The wire format of a batch shard: how a ``TensorDict`` is stored in the object store.

A shard travels as a ``WireBatch``: its per-sample strings as plain lists (a ``NonTensorStack``
of 256 short strings costs ~14 ms to put and get through the object store, the same batch's
tensors ~2 ms) and its CPU tensors as their raw bytes. A tensor's own pickling writes each one
through ``torch.save`` and reads it back through ``torch.load``; raw bytes go into the object
store as pickle-5 out-of-band buffers and come out as one copy each (the copy keeps the received
tensors writable: the store's memory is read-only). A put + get of a generate node's shard
(15 tensors and 2 string fields of 512 rows) takes about 1 ms this way against 4.7 ms
(``tests/test_workers.py`` checks the round trip).
"""

from __future__ import annotations

from typing import Any

import numpy
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_non_tensor


class WireBatch:
    """A flat ``TensorDict`` as it is stored: non-tensor fields as lists; pickled, its CPU
    tensors as raw bytes (``tensors`` holds them as tensors on both ends).

    ``to_wire`` / ``from_wire`` convert; every batch enters the object store through
    ``to_wire`` (``ShardedRef.put``, the DP protocols' ``pack``), which stores a nested batch as
    the plain ``TensorDict`` it is, so ``from_wire`` takes that too.
    """

    __slots__ = ("batch_size", "lists", "tensors")

    def __init__(self, tensors: dict, lists: dict, batch_size: tuple[int, ...]) -> None:
        self.tensors, self.lists, self.batch_size = tensors, lists, batch_size

    def rows(self, start: int, stop: int) -> "WireBatch":
        """Rows ``[start, stop)``, copied (a view would keep the whole shard alive, and a
        returned view would store it again). Slicing the lists first spares building the
        ``NonTensorStack`` of the rows left out, and tensordict's slow copy of the kept ones."""
        return WireBatch(
            {key: tensor[start:stop].clone() for key, tensor in self.tensors.items()},
            {key: values[start:stop] for key, values in self.lists.items()},
            (stop - start, *self.batch_size[1:]),
        )

    def __reduce__(self):
        fields = {}
        for key, tensor in self.tensors.items():
            if tensor.device.type == "cpu" and tensor.layout == torch.strided:
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                fields[key] = (data, tensor.dtype, tuple(tensor.shape))
            else:  # a device or sparse tensor: torch's own pickling
                fields[key] = tensor
        return _rebuild, (fields, self.lists, self.batch_size)


def _rebuild(fields: dict, lists: dict, batch_size: tuple[int, ...]) -> WireBatch:
    """A ``WireBatch`` from its pickled form, each raw tensor copied out of the received buffer."""
    tensors = {}
    for key, value in fields.items():
        if not isinstance(value, torch.Tensor):
            data, dtype, shape = value
            value = torch.empty(shape, dtype=dtype)
            numpy.copyto(value.reshape(-1).view(torch.uint8).numpy(), data)
        tensors[key] = value
    return WireBatch(tensors, lists, batch_size)


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
