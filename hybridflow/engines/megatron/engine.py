"""Megatron-core train engine: ``GPTModel`` (local spec) under TP x PP x DP, megatron DDP + optimizer.

Semantics match :class:`hybridflow.engines.torch_engine.TorchTrainEngine` (same ``LossFn``
contract, same metrics, same LR schedule); the tests check a step against an HF model + torch
AdamW.

Gradient arithmetic: the model config sets ``calculate_per_token_loss``, so megatron's schedules
neither divide a micro-batch loss by the number of micro-batches nor does its DDP average over
data-parallel ranks: the gradient is the plain sum of the ``loss_fn`` results over micro-batches
and DP ranks. ``loss_fn`` divides by ``num_global_tokens`` (all-reduced over the DP group before
the step), so the sum is the full-batch token mean. ``finalize_model_grads`` is called without a
token count for the same reason.

Padding: megatron's RoPE ignores ``position_ids`` (positions are 0..S-1), so each row is rolled
left by its number of left-pad tokens before the forward: valid tokens then sit at 0..L-1 with
exactly HF's positions, and a plain causal mask keeps them from seeing the trailing padding. The
response logits are read back at the rolled positions.

Batches: every rank of one model-parallel group (TP x PP, one data-parallel replica) is given
the same batch, its replica's chunk (``Dispatch.DP_3D``: the workers split by the layout's
data-parallel rank and collect TP rank 0 of the last stage), and runs it through the model with
its peers; outputs are returned on every rank.

Weights: the parameters are views of one flat tensor per rank, ``shard_buffer``, laid out by
``convert.shard_specs`` and set before megatron's DDP and optimizer take them. The
3D-HybridEngine gathers generation shards straight from it (``train_shard()``, used by
``hybridflow.hybrid_engine.sync``); ``full_hf_state`` is the naive full gather that ``save_hf``
uses.

Memory: the parameters live in megatron DDP's buffers, which a ``.to()`` would detach them from,
so ``offload``/``reload`` keep the state where it is (0 bytes moved) and a colocated torch model
is the one that moves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from itertools import chain

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor

from hybridflow.algos import count_sequences, entropy_from_logits, log_probs_from_logits
from hybridflow.data import keys as K
from hybridflow.engines.base import LossFn, ModelKind, TrainEngine, TrainShard
from hybridflow.engines.megatron import cpu_compat
from hybridflow.engines.megatron.convert import (
    Dims,
    hf_to_megatron,
    megatron_views,
    resharding_named,
    shard_specs,
    to_hf,
)
from hybridflow.engines.megatron.model import build_gpt_model, load_megatron_state
from hybridflow.engines.shards import TrainShardBuffer, checkpoint_piece
from hybridflow.engines.schedule import lr_factor
from hybridflow.spec.graph import TrainEngineSpec
from hybridflow.spec.layout import ParallelLayout


def init_parallel_state(tp: int, pp: int, seed: int) -> None:
    """``parallel_state`` for ``tp`` x ``pp`` (dp = world / (tp*pp)) over the default group.

    Idempotent for the same sizes; ``torch.distributed`` must be initialised (gloo or nccl).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_compat.enable()
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() != tp
            or ps.get_pipeline_model_parallel_world_size() != pp
        ):
            raise ValueError(
                "megatron parallel_state is already initialised with another layout (one megatron "
                "layout per process)"
            )
        return
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"tp*pp = {tp * pp} does not divide the {world} ranks")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    # The inference tracker forks the CPU RNG instead of a CUDA generator; dropout is 0 anyway.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu_compat.needed())


def _adam_step(optimizer: torch.optim.Optimizer, param: Tensor) -> float:
    """An Adam parameter's step count: in its state (torch's Adam/AdamW, megatron's CPU
    optimizer) or in its param group (apex's and Transformer Engine's FusedAdam)."""
    if "step" in optimizer.state[param]:
        return float(optimizer.state[param]["step"])
    return float(next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))["step"])


def _set_adam_step(optimizer: torch.optim.Optimizer, param: Tensor, step: float) -> None:
    state = optimizer.state[param]
    if "step" in state:
        if isinstance(state["step"], Tensor):
            state["step"].fill_(step)
        else:
            state["step"] = int(step)
        return
    next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))["step"] = int(step)


def _roll_left(x: Tensor, shifts: Tensor) -> Tensor:
    """Row b of (B, T) ``x`` rolled left by ``shifts[b]``."""
    seq_len = x.shape[1]
    index = (torch.arange(seq_len, device=x.device)[None] + shifts[:, None]) % seq_len
    return x.gather(1, index)


class MegatronTrainEngine(TrainEngine):
    """An HF causal LM trained as a megatron-core ``GPTModel`` shard.

    Args:
        hf_model: the HF model (every rank passes the same weights); converted, then kept only
            as the container ``save_hf`` and ``load_full_into`` write into.
        spec: layout (tp, pp; dp is the rest of the world), micro-batch size, optimizer.
        total_steps: optimizer steps of the run (cosine schedule).
        seed: seeds megatron's model-parallel RNG tracker.
    """

    def __init__(
        self,
        hf_model,
        spec: TrainEngineSpec,
        *,
        total_steps: int | None = None,
        kind: ModelKind = "policy",
        seed: int = 0,
    ) -> None:
        if kind != "policy":
            raise NotImplementedError("train.engine 'megatron' holds policy models (LM head) only")
        if spec.optim.schedule == "cosine" and (total_steps is None or total_steps < 1):
            raise ValueError("train.optim.schedule 'cosine' needs the run's total optimizer steps")
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.spec = spec
        self.total_steps = total_steps or 0
        tp, pp = spec.layout.tp, spec.layout.pp
        init_parallel_state(tp, pp, seed)
        self.ps = ps
        self.dp_size = ps.get_data_parallel_world_size()
        self.train_layout = ParallelLayout(tp=tp, pp=pp, dp=self.dp_size)
        self.coords = self.train_layout.coords(dist.get_rank())
        assert (self.coords.tp_rank, self.coords.pp_rank) == (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        ), "megatron's rank order must be ParallelLayout's"
        self._dp_group = ps.get_data_parallel_group()
        self.hf_model = hf_model
        self.hf_config = hf_model.config
        self.dims = Dims.from_hf(self.hf_config)
        self.dtype = next(hf_model.parameters()).dtype
        self.device = torch.device("cpu") if cpu_compat.needed() else torch.device("cuda")

        # The training shard: one flat tensor whose views are the parameters (set before DDP and
        # the optimizer take them), so the resharder sends and keeps it without a copy.
        self.specs = shard_specs(self.dims, tp, pp)
        self.shard_buffer = TrainShardBuffer.allocate(
            self.specs, self.coords.pp_rank, tp, dist.get_rank(), self.dtype, self.device
        )
        module = build_gpt_model(self.hf_config, self.coords, self.dtype).to(self.device)
        views = megatron_views(self.shard_buffer, self.dims, self.coords)
        for name, param in module.named_parameters():
            if name in views:  # all but a tied output layer's copy on the last stage (p > 1)
                param.data = views[name]
        state = {n: t.to(self.device) for n, t in hf_model.state_dict().items()}
        load_megatron_state(module, hf_to_megatron(state, self.dims, self.coords))
        self.gpt_model = module
        self.config = module.config
        self.model = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            module,
        )
        self.config.no_sync_func = self.model.no_sync
        # Token normalisation is the loss_fn's (num_global_tokens): no count-based rescaling.
        self.config.finalize_model_grads_func = (
            lambda model, num_tokens=None, **kw: finalize_model_grads(model, None, **kw)
        )
        self.config.variable_seq_lengths = pp > 1  # micro-batches of unequal size
        optim = spec.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1],
                adam_eps=1e-8,
                clip_grad=0.0,  # clipped below, so that a non-finite norm can skip the step
                params_dtype=self.dtype,
                bf16=self.dtype == torch.bfloat16,
                use_distributed_optimizer=False,
            ),
            [self.model],
        )
        self.step_count = 0

    @classmethod
    def build(
        cls, module, spec: TrainEngineSpec, *, kind: ModelKind, total_steps: int, seed: int
    ) -> "MegatronTrainEngine":
        """Converts ``module``'s weights; ``module`` stays the full HF model (the container
        ``save_hf`` writes and a tg = 1 rollout engine generates from, refreshed through the
        resharder after each update)."""
        return cls(module, spec, total_steps=total_steps, kind=kind, seed=seed)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._dp_group

    def offload(self) -> int:
        return 0  # see the module docstring: the state stays in megatron's buffers

    def reload(self) -> int:
        return 0

    # -- the pipeline schedule ----------------------------------------------------------------

    def _forward_step(self, temperature: float, loss_fn: LossFn | None, extra: dict, data_iterator, model):
        mb: TensorDict = next(data_iterator)
        input_ids = mb[K.INPUT_IDS].to(self.device)
        attention_mask = mb[K.ATTENTION_MASK]
        seq_len = input_ids.shape[1]
        shifts = (attention_mask.cumsum(1) == 0).sum(1).to(self.device)  # left-pad tokens
        rolled = _roll_left(input_ids, shifts)
        positions = torch.arange(seq_len, device=self.device)[None].expand_as(rolled)
        mask = cpu_compat.causal_mask(seq_len, self.device)
        output = model(rolled, positions, mask)
        return output, partial(self._loss, mb, shifts, temperature, loss_fn, extra)

    def _policy_outputs(self, logits: Tensor, mb: TensorDict, shifts: Tensor, temperature: float):
        """log-probs and entropy (B, R) from this TP rank's vocabulary shard of the logits."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        responses = mb[K.RESPONSES].to(self.device)
        num_response = responses.shape[1]
        seq_len = logits.shape[1]
        # Original positions T-R-1 .. T-2 predict the response tokens; find them after the roll.
        wanted = torch.arange(seq_len - num_response - 1, seq_len - 1, device=self.device)
        index = (wanted[None] - shifts[:, None]) % seq_len
        picked = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
        if self.train_layout.tp > 1:
            picked = gather_from_tensor_model_parallel_region(picked)
        picked = picked[..., : self.dims.vocab_size].float() / temperature
        mask = mb[K.RESPONSE_MASK].to(self.device, torch.float32)
        return {
            "log_probs": log_probs_from_logits(picked, responses) * mask,
            "entropy": entropy_from_logits(picked) * mask,
        }

    def _loss(self, mb, shifts, temperature, loss_fn, extra, logits):
        out = self._policy_outputs(logits, mb, shifts, temperature)
        one = torch.tensor(1, dtype=torch.int)
        if loss_fn is None:  # forward only: hand the outputs back through megatron's data store
            return logits.sum() * 0.0, one, {k: v.detach().cpu() for k, v in out.items()}
        out.update(extra)
        loss, metrics = loss_fn(mb, out)
        num_tokens = float(mb[K.RESPONSE_MASK].sum())
        record = {"loss": float(loss.detach()), "metrics": {k: float(v) * num_tokens for k, v in metrics.items()}}
        return loss, one, record

    def _run_schedule(self, batch: TensorDict, temperature: float, loss_fn: LossFn | None, extra: dict) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro_batches = list(batch.split(self.spec.micro_batch_size))
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, temperature, loss_fn, extra),
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=batch[K.INPUT_IDS].shape[1],
            micro_batch_size=self.spec.micro_batch_size,
            forward_only=loss_fn is None,
        )

    def _from_last_stage(self, obj):
        """``obj`` of the last pipeline stage, on every rank of this rank's pipeline group."""
        if self.train_layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(
            box,
            src=self.ps.get_pipeline_model_parallel_last_rank(),
            group=self.ps.get_pipeline_model_parallel_group(),
        )
        return box[0]

    # -- TrainEngine --------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: TensorDict, temperature: float = 1.0) -> dict[str, Tensor]:
        """``{"log_probs", "entropy"}`` (B, R) float32 of ``responses`` under logits / temperature
        (``batch``: this replica's samples, the same on every model-parallel rank)."""
        self.model.eval()
        try:
            store = self._run_schedule(batch, temperature, None, {})
        finally:
            self.model.train()
        parts = self._from_last_stage(store if self.coords.is_last_stage else None)
        return {key: torch.cat([p[key] for p in parts]).cpu() for key in parts[0]}

    def _all_reduce_dp(self, values: Tensor) -> Tensor:
        """Sum over the data-parallel group (on the engine's device: nccl takes CUDA tensors)."""
        if self.dp_size > 1:
            on_device = values.to(self.device)
            dist.all_reduce(on_device, group=self._dp_group)
            values = on_device.to(values.device)
        return values

    def train_step(self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over this replica's part of a mini-batch (the same on every
        model-parallel rank); metrics as :meth:`TorchTrainEngine.train_step`."""
        assert batch.batch_size[0] > 0, "every data-parallel replica needs at least one sample"
        counts = self._all_reduce_dp(
            torch.stack([batch[K.RESPONSE_MASK].sum(), count_sequences(batch[K.RESPONSE_MASK])]).to(torch.float64)
        )
        num_global_tokens = counts[0].to(torch.float32)
        extra = {"num_global_tokens": num_global_tokens.to(self.device), "num_global_seqs": counts[1].to(torch.float32).to(self.device)}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.spec.optim.lr * lr_factor(self.step_count, self.spec.optim, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        store = self._run_schedule(batch, temperature, loss_fn, extra)

        self.optimizer.prepare_grads()  # param.grad = param.main_grad
        # megatron's norm (TP/PP-reduced, replicated params counted once); the clip is applied
        # here with megatron's formula, since its own asserts a CUDA tensor type.
        grad_norm = float(self.optimizer.get_grad_norm())
        finite = math.isfinite(grad_norm)
        clip = self.spec.optim.grad_clip
        if finite and clip is not None and clip / (grad_norm + 1e-6) < 1.0:
            for param in self.optimizer.get_parameters():
                if param.grad is not None:
                    param.grad.mul_(clip / (grad_norm + 1e-6))
        if finite:
            self.optimizer.step_with_ready_grads()
        self.step_count += 1

        records = self._from_last_stage(store if self.coords.is_last_stage else None)
        names = sorted(records[0]["metrics"])
        sums = [sum(r["loss"] for r in records)] + [sum(r["metrics"][k] for r in records) for k in names]
        reduced = self._all_reduce_dp(torch.tensor(sums, dtype=torch.float64))
        out = {"loss": float(reduced[0])}
        total_tokens = max(float(num_global_tokens), 1.0)
        out.update({k: float(v) / total_tokens for k, v in zip(names, reduced[1:])})
        out.update(grad_norm=float(grad_norm), lr=lr, skipped_step=float(not finite))
        return out

    # -- weights ------------------------------------------------------------------------------

    def train_shard(self) -> TrainShard:
        """This rank's flat training shard (the parameters are its views) with the resharding
        layout of the whole model (all stages)."""
        return TrainShard(self.train_layout, self.shard_buffer, self.specs, self._generation_weights)

    def _generation_weights(self, shards, tp: int) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of a generation shard (``shards``: name -> TP pieces, as returned by
        the resharder for a ``tp``-way generation layout), one at a time: what a rollout engine's
        ``load_weights`` takes. At ``tp`` = 1 the vocabulary padding is dropped."""
        pieces = ((name, shards.tensor(name)) for name in shards)
        return to_hf(pieces, self.dims, tp, trim_vocab=tp == 1)

    def full_hf_state(self, megatron_tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The whole model with HF names on every rank (the naive path: TP all-gather within
        each stage, then a broadcast of each stage's tensors over the pipeline group).

        ``megatron_tensors`` (megatron parameter name -> this rank's tensor, e.g. the gradient
        buffers) are gathered instead of the weights.
        """
        if megatron_tensors is None:
            named = self.shard_buffer.views
        else:
            named = resharding_named(megatron_tensors, self.dims, self.coords)
        tp_group = self.ps.get_tensor_model_parallel_group()
        full: dict[str, Tensor] = {}
        for spec in self.specs:
            if spec.pp_stage != self.coords.pp_rank:
                continue
            tensor = named[spec.name]
            if spec.tp_dim is None or self.train_layout.tp == 1:
                full[spec.name] = tensor
            else:
                pieces = [torch.empty_like(tensor) for _ in range(self.train_layout.tp)]
                dist.all_gather(pieces, tensor.contiguous(), group=tp_group)
                full[spec.name] = torch.cat(pieces, dim=spec.tp_dim)
        if self.train_layout.pp > 1:
            pp_group = self.ps.get_pipeline_model_parallel_group()
            pp_ranks = dist.get_process_group_ranks(pp_group)
            for spec in self.specs:
                if spec.pp_stage != self.coords.pp_rank:
                    full[spec.name] = torch.empty(spec.full_shape, dtype=self.dtype, device=self.device)
                dist.broadcast(full[spec.name], src=pp_ranks[spec.pp_stage], group=pp_group)
        state = {name: t.contiguous() for name, t in to_hf(full.items(), self.dims, 1, trim_vocab=True)}
        if self.dims.tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full HF weights (gathered; a collective every rank must call)."""
        state = self.full_hf_state()
        params = dict(self.hf_model.named_parameters())
        for name in params:
            yield name, state[name]

    @torch.no_grad()
    def load_full_into(self, hf_model) -> None:
        """Copy the gathered full weights into ``hf_model`` (what ``save_hf`` writes)."""
        state = self.full_hf_state()
        for name, param in hf_model.named_parameters():
            param.copy_(state[name])

    def save_hf(self, path: str) -> None:
        """Global rank 0 writes ``save_pretrained(path)`` of the gathered model; all wait."""
        self.load_full_into(self.hf_model)
        if dist.get_rank() == 0:
            self.hf_model.save_pretrained(path)
        dist.barrier()

    # -- checkpoints --------------------------------------------------------------------------

    def _stepped(self) -> dict[str, tuple[Tensor, torch.optim.Optimizer]]:
        """Megatron parameter name -> (the tensor its optimizer steps, that torch optimizer): the
        parameter itself, or its fp32 main copy when the model is bf16."""
        names = {id(p): n for n, p in self.gpt_model.named_parameters()}
        out = {}
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "float16_groups"):  # mixed precision: the optimizer steps fp32 copies
                pairs = zip(chain(*opt.float16_groups, *opt.fp32_from_fp32_groups),
                            chain(*opt.fp32_from_float16_groups, *opt.fp32_from_fp32_groups))
            else:
                pairs = ((p, p) for group in opt.optimizer.param_groups for p in group["params"])
            for param, main in pairs:
                out[names[id(param)]] = (main, opt.optimizer)
        return out

    @staticmethod
    @torch.no_grad()
    def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
        """Give a fresh optimizer its per-parameter state (zero moments, step 0: what its first
        step would start from) by one step with zero gradients at lr 0, which leaves the weights
        bit for bit as they are; a checkpoint can then load into that state."""
        if optimizer.state:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        lrs = [group["lr"] for group in optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None
            _set_adam_step(optimizer, p, 0)  # the state of no step at all: the next is step 1

    def state_dict(self) -> dict:
        """The engine's state for ``torch.distributed.checkpoint``, layout-free: every tensor is
        a piece of the *full* HF-layout tensor (:func:`~hybridflow.engines.shards.checkpoint_piece`,
        the vocabulary with its padding, ``Dims.padded_vocab``), named as in the resharding
        layout, so the checkpoint loads under any tp x pp x dp (tp dividing 64).

        ``weights`` (views of ``train_shard``), ``optim`` (Adam's per-parameter moments, sharded
        like the weights, and its step), ``main`` (the fp32 main weights, bf16 models only) and
        ``schedule`` (the LR schedule's step counter). The tensors are the engine's own: a
        ``dcp.load`` into this dict fills them in place; :meth:`load_state_dict` then applies
        the rest. With tied embeddings and p > 1 the last stage's copy of the embedding loads
        from (and saves, deduplicated, to) the embedding's entries.
        """
        from torch.distributed.device_mesh import DeviceMesh

        tp = self.train_layout.tp
        if tp > 1 and getattr(self, "_tp_mesh", None) is None:
            self._tp_mesh = DeviceMesh.from_group(self.ps.get_tensor_model_parallel_group(), self.device.type)
        mesh = getattr(self, "_tp_mesh", None)
        specs = {spec.name: spec for spec in self.specs}

        def pieces(named: dict[str, Tensor]) -> dict[str, Tensor]:
            return {
                # the vocabulary with its padding (to 64 rows: the same under any tp dividing 64;
                # trimmed, its rows would not be torch.chunk's split that a DTensor shard is)
                name: checkpoint_piece(specs[name], tensor, tp, self.coords.tp_rank, mesh)
                for name, tensor in named.items()
            }

        def by_layout(megatron: dict[str, Tensor]) -> dict[str, Tensor]:
            named = resharding_named(megatron, self.dims, self.coords)
            if self.dims.tied and self.train_layout.pp > 1 and self.coords.is_last_stage:
                named["model.embed_tokens.weight"] = megatron["output_layer.weight"]
            return pieces(named)

        stepped = self._stepped()
        for optimizer in {id(o): o for _, o in stepped.values()}.values():
            self._init_optimizer_state(optimizer)
        moments = {
            key: by_layout({name: opt.state[main][key] for name, (main, opt) in stepped.items()})
            for key in ("exp_avg", "exp_avg_sq")
        }
        steps = {_adam_step(opt, main) for main, opt in stepped.values()}
        assert len(steps) == 1, f"parameters at different optimizer steps: {sorted(steps)}"
        params = dict(self.gpt_model.named_parameters())
        state = {
            "weights": by_layout({name: p.data for name, p in params.items()}),
            "optim": {**moments, "step": steps.pop()},
            "schedule": {"step_count": self.step_count},
        }
        if any(main is not params[name] for name, (main, _) in stepped.items()):
            state["main"] = by_layout({name: main for name, (main, _) in stepped.items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        """Take a state in :meth:`state_dict`'s form after ``dcp.load`` filled its tensors."""
        for main, opt in self._stepped().values():
            _set_adam_step(opt, main, state["optim"]["step"])
        self.step_count = state["schedule"]["step_count"]
