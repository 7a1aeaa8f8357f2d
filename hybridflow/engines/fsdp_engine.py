"""Sharded data-parallel train engine: torch's ``fully_shard`` (FSDP2) over the data-parallel ranks.

Everything but the sharding is the torch engine's (``TorchTrainEngine``): micro-batches and the
token-budget cut, gradient accumulation, the global-token loss normalisers, packing, shared
prompts, chunked log-probs, clipping, the LR schedule, layout-free checkpoints. What differs:

- each decoder layer (the model's ``_no_split_modules`` classes) and then the whole model are
  ``fully_shard``-ed over a one-axis device mesh of the data-parallel group, so every rank keeps
  1/dp of each parameter, its gradient and its AdamW state (DTensors sharded on dim 0). A
  forward gathers one layer's parameters at a time; a backward reduce-scatters each layer's
  gradients (averaged, like DDP's all-reduce, so the torch engine's ``loss * dp`` still makes
  rank contributions add up).
- gradient accumulation reduce-scatters every micro-batch into the sharded gradients (no
  ``no_sync``: holding unsharded gradients until the last micro-batch would cost DDP's memory);
  the sum is the same up to float rounding. Every rank therefore runs the same number of
  micro-batches (``_micro_batch_rows``), forwards included.
- ``clip_grad_norm_`` over DTensor gradients returns a replicated DTensor: its local value is
  the global norm.
- weights for sync (``named_weights``) are full tensors gathered a bucket at a time; the
  transformers rollout generates from a full copy of its own (``rollout_module``), since
  generating from the sharded module would make every decoding step a collective that ranks
  with different response lengths would call different numbers of times.

Under ``compute_dtype: bfloat16`` the mixed-precision policy gathers parameters in bfloat16
and reduces gradients in float32 into float32 parameters (no autocast).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hybridflow.engines.base import ModelKind
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.spec.engines import FSDP2TrainSpec


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class FSDP2TrainEngine(TorchTrainEngine):
    """The torch engine with its module under ``fully_shard`` over ``process_group``.

    Args: those of ``TorchTrainEngine``; ``spec`` is an ``FSDP2TrainSpec``. Every rank must
    pass the same initial weights (each keeps its own slice of them).
    """

    spec: FSDP2TrainSpec

    def __init__(
        self,
        model: nn.Module,
        spec: FSDP2TrainSpec,
        *,
        total_steps: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        kind: ModelKind = "policy",
        seed: int = 0,
    ) -> None:
        self._module_class = type(model)  # fully_shard swaps the class for an FSDP subclass
        self._sync_stats: dict[str, float] = {}
        super().__init__(model, spec, total_steps=total_steps, process_group=process_group, kind=kind, seed=seed)

    @classmethod
    def build(
        cls, module: nn.Module, spec: FSDP2TrainSpec, *, kind: ModelKind, total_steps: int, seed: int
    ) -> "FSDP2TrainEngine":
        """Sharded over the default process group (every rank of the worker group)."""
        return cls(module, spec, total_steps=total_steps, kind=kind, seed=seed)

    # -- sharding -------------------------------------------------------------------------------

    def _mesh(self) -> DeviceMesh:
        group = self.process_group or dist.group.WORLD
        device = self.home.type
        return DeviceMesh.from_group(group, device, mesh_dim_names=("dp",))

    def _wrap_data_parallel(self, model: nn.Module) -> None:
        """Shard ``model`` in place, layer by layer and then the rest, over the group (of one
        rank too: FSDP2's collectives and mixed precision then run, on one device); without
        ``torch.distributed``: left whole, the torch engine alone."""
        self._sharded = dist.is_available() and dist.is_initialized()
        if not self._sharded:
            return None
        mp = MixedPrecisionPolicy()
        if self.spec.compute_dtype == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # pin_memory needs a CUDA runtime; on a CPU rank the policy changes nothing.
        offload = CPUOffloadPolicy(pin_memory=self.home.type == "cuda") if self.spec.cpu_offload else OffloadPolicy()
        options = dict(mesh=self._mesh(), mp_policy=mp, offload_policy=offload)
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, reshard_after_forward=self.spec.reshard_after_forward, **options)
        fully_shard(model, **options)
        return None

    def _micro_batch_rows(self, batch) -> list[torch.Tensor]:
        """The torch engine's micro-batches (fixed-size or token-budget), as rows, cut further
        until every rank has as many as the rank with the most: each micro-batch's forward
        and backward are collectives (a layer's gather, its gradients' reduce-scatter), which
        DDP's are not until the last backward. Splitting the largest micro-batch in two keeps
        the gradients (loss normalisers are global); ranks hold equal sample counts (the
        dispatch splits batches evenly), so enough micro-batches always exist."""
        rows = super()._micro_batch_rows(batch)
        if not self._sharded or self.dp_size == 1:
            return rows
        if not rows:
            rows = list(torch.arange(batch.batch_size[0]).split(self.spec.micro_batch_size))
        count = torch.tensor([len(rows)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.process_group)
        while len(rows) < int(count):
            largest = max(range(len(rows)), key=lambda i: len(rows[i]))
            if len(rows[largest]) < 2:
                raise RuntimeError(
                    f"rank {self.dp_rank}: {batch.batch_size[0]} samples cannot make the "
                    f"{int(count)} micro-batches another data-parallel rank has"
                )
            half = len(rows[largest]) // 2
            rows[largest : largest + 1] = [rows[largest][:half], rows[largest][half:]]
        return rows

    def forward(self, batch, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """The torch engine's no-grad forward, then every module sharded again: FSDP2 keeps
        the root's gathered parameters (and, with ``reshard_after_forward: false``, every
        layer's) for a backward that a no-grad forward never runs, so a forward after the
        update (the weight-sync probe) would leave them whole for the sync's gather."""
        out = super().forward(batch, temperature)
        if self._sharded:
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return out

    def _gradient_sync(self, is_last: bool):
        return super()._gradient_sync(True)  # reduce-scatter every micro-batch (module docstring)

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _tail_outputs(self, module: nn.Module, mb, num_tail: int) -> torch.Tensor:
        if not self._sharded:  # the torch engine's autocast
            return super()._tail_outputs(module, mb, num_tail)
        return self._tail_outputs_at_dtype(module, mb, num_tail)  # the policy casts

    # -- weights --------------------------------------------------------------------------------

    def _buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The named parameters in buckets of about ``spec.sync_bucket_mb`` MiB of full tensors."""
        limit = self.spec.sync_bucket_mb * 2**20
        bucket, size = [], 0
        for name, param in self.module.named_parameters():
            nbytes = param.numel() * param.element_size()  # a DTensor's numel is the full one
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, param))
            size += nbytes
        if bucket:
            yield bucket

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with HF names, gathered one bucket at a time on every rank (collective:
        every rank of the group iterates to the end). A bucket's tensors are dropped when the
        next is gathered, so a consumer that copies them (a rollout engine's ``load_weights``)
        holds one bucket beside its own weights. Unsharded: the parameters
        themselves, as the torch engine gives them."""
        if not self._sharded:
            yield from super().named_weights()
            return
        stats = {"reshard/peak_bytes": 0.0, "reshard/received_bytes": 0.0, "reshard/model_bytes": 0.0}
        for bucket in self._buckets():
            gathered = [(name, param.detach().full_tensor()) for name, param in bucket]
            held = sum(_nbytes(t) for _, t in gathered)
            stats["reshard/peak_bytes"] = max(stats["reshard/peak_bytes"], float(held))
            stats["reshard/model_bytes"] += held
            stats["reshard/received_bytes"] += held - sum(_nbytes(_local(p)) for _, p in bucket)
            yield from gathered
            del gathered
        self._sync_stats = stats

    def sync_metrics(self) -> dict[str, float]:
        return dict(self._sync_stats)

    def rollout_module(self, module: nn.Module) -> nn.Module:
        """A full, unsharded copy of the model for the rollout engine (built from its config,
        then filled by one bucketed gather); unsharded: ``module`` itself."""
        if not self._sharded:
            return module
        with torch.random.fork_rng(devices=[]):  # the copy's throwaway init draws no run RNG
            copy = self._module_class(self.module.config)
        copy.generation_config = self.module.generation_config
        params = next(self.module.parameters())
        copy.to(device=self.home, dtype=params.dtype).eval().requires_grad_(False)
        held = dict(copy.named_parameters())
        with torch.no_grad():
            for name, tensor in self.named_weights():
                held[name].copy_(tensor)
        return copy

    def save_hf(self, path: str) -> None:
        """Rank 0 writes the full model (gathered into an unsharded copy on every rank)."""
        if not self._sharded:
            return super().save_hf(path)
        copy = self.rollout_module(self.module)
        if self.dp_rank == 0:
            copy.save_pretrained(path)
        if self.dp_size > 1:
            dist.barrier(group=self.process_group)

    # -- memory ---------------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients (those present now) and optimizer state:
        the local shards only."""
        return state_bytes(self.module, self.optimizer)


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of ``module``'s parameters, their gradients (present now) and
    ``optimizer``'s tensor state ("step" counters left out): the local part of a DTensor."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optim = [
        v for state in optimizer.state.values() for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    return {
        "params": sum(_nbytes(_local(p)) for p in params),
        "grads": sum(_nbytes(_local(g)) for g in grads),
        "optimizer": sum(_nbytes(_local(t)) for t in optim),
    }
