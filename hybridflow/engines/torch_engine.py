"""Plain-torch train engine: one full model copy per rank, data parallel over gloo or nccl.

Gradient arithmetic of ``train_step`` (why the DP result equals the single-process one): the
global counts (response tokens and samples of the whole mini-batch, all DP ranks) are
all-reduced first and handed to ``loss_fn``, which divides its token sum by them. Each
micro-batch's loss is backpropagated times ``dp_size`` and accumulated locally (DDP ``no_sync``
for all but the last micro-batch); DDP then averages over ranks, so the final gradient is
``sum over all tokens of all ranks / global tokens``, the gradient of the full-batch token mean.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from hybridflow.algos import count_sequences, entropy_from_logits, log_probs_from_logits
from hybridflow.algos.chunked_logits import chunked_log_probs_entropy
from hybridflow.data import keys as K
from hybridflow.engines.base import LossFn, ModelKind, TrainEngine
from hybridflow.engines.compile import CompiledLayers
from hybridflow.engines.lora import add_lora, merged_named_weights
from hybridflow.engines.packing import (
    pack,
    pack_shared_prompts,
    shared_prompts_cheaper,
    token_budget_micro_batches,
)
from hybridflow.engines.schedule import lr_factor
from hybridflow.spec.engines import TorchTrainSpec

# Optimizer state keyed "state.<param name>.<field>" (no param indices): layout-free.
_DCP_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A LoRA actor's checkpoint: the adapters and their AdamW state; the frozen base comes from
# the model's source.
_DCP_LORA_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


# From this vocabulary size on, a packed policy forward gathers the response tail's hidden
# states before the LM head instead of projecting every packed position: with a real
# vocabulary (SmolLM2: 49,152) the head over prompt positions costs ~15% of an update. The
# logits are the same; the gradients differ by float rounding (fewer rows summed), so small
# vocabularies, where the head costs next to nothing, keep the single call and their
# seeded runs stay bit-for-bit as before.
GATHER_BEFORE_HEAD_VOCAB = 1024

# (model class, config, shared prompts) whose forward passed the probe: the actor, the
# reference and a critic of one architecture are probed once per process.
_PACKING_CHECKED: set[tuple[type, str, bool]] = set()

# Config fields of architectures whose logits are not the plain head product (soft-capping,
# scaling): their log-probs keep the model's own logits.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@torch.no_grad()
def check_packing(model: nn.Module, shared_prompts: bool = False) -> None:
    """Refuse a model whose forward does not keep packed sequences apart.

    Packing relies on the model building its attention mask from restarting position ids (as
    transformers' own architectures do when no mask is passed); shared prompts on it taking a
    4D attention mask as given. A model that does neither would let samples attend to each
    other without any error, so a probe batch goes through the model padded and packed, and the
    outputs must agree: two samples of lengths 3 and 5 in a width of 8, or, for shared prompts,
    two samples with one 3-token prompt and responses of 2 and 4 tokens. The answer depends on
    the architecture only, so it is kept per model class and config.
    """
    key = (type(model), repr(getattr(model, "config", None)), shared_prompts)
    if key in _PACKING_CHECKED:
        return
    device = next(model.parameters()).device
    vocab = getattr(model.config, "vocab_size", 2)
    ids = (torch.arange(16, device=device).reshape(2, 8) * 7 + 3) % vocab
    if shared_prompts:
        ids[1, :4] = ids[0, :4]  # one prompt (columns 1-3) for both samples
        mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1]], device=device)
    else:
        mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    num_tail = 5 if shared_prompts else 3  # the last prompt column and the responses
    was_training = model.training
    model.eval()
    try:
        padded = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        if shared_prompts:
            packed = pack_shared_prompts(ids.cpu(), mask.cpu(), positions.cpu(), num_tail, prompt_width=4)
            extra = {"attention_mask": attention_mask_for(model, packed.attention_mask.to(device))}
        else:
            packed = pack(ids.cpu(), mask.cpu(), positions.cpu(), num_tail=num_tail)
            extra = {}
        out = model(
            input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
            use_cache=False, **extra,
        ).logits
    finally:
        model.train(was_training)
    diff = out.flatten(0, 1)[packed.index.to(device)] - padded[:, -num_tail:]
    diff = diff[mask[:, -num_tail:].bool()].abs().max().item()  # padding columns differ freely
    tolerance = 1e-3 if padded.dtype == torch.float32 else 5e-2
    if not diff <= tolerance:
        field = "share_prompts" if shared_prompts else "remove_padding"
        raise ValueError(
            f"train.{field}: {type(model).__name__} does not keep packed sequences apart "
            f"(packed vs padded outputs differ by {diff:.2g}); set {field}: false for it"
        )
    _PACKING_CHECKED.add(key)


def attention_mask_for(model: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A (1, 1, L, L) may-attend mask in the form the model's attention reads: SDPA takes it as
    booleans, eager attention adds it to the scores."""
    if getattr(model.config, "_attn_implementation", "sdpa") != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def _layout_flops(model: nn.Module) -> tuple[float, float] | None:
    """(a token's forward FLOPs outside attention, one attended pair's FLOPs over all layers)
    for costing a micro-batch's layout (``shared_prompts_cheaper``); None when the config does
    not say how attention is shaped. The embedding and the LM head are left out: the lookup is
    free and the head only projects the response positions, alike in every layout."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    left_out = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            left_out.add(id(module.weight))
    weights = sum(p.numel() for p in model.parameters() if id(p) not in left_out)
    # A pair costs a query-key product and a value product: 2 x 2 x head_dim per head and layer.
    return 2.0 * weights, 4.0 * heads * head_dim * layers


class _Hooks:
    """Removes the given hook handles on exit."""

    def __init__(self, *handles) -> None:
        self.handles = handles

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


class TorchTrainEngine(TrainEngine):
    """A transformers model (or any module with an HF-style forward) trained with AdamW.

    Args:
        model: the module; a causal LM for ``kind="policy"``, a per-token scalar head
            (``build_value_model``) for ``kind="value"``. The engine trains it in place; with
            ``torch.distributed`` initialised and more than one rank in ``process_group`` it is
            wrapped in ``DistributedDataParallel`` (ranks must start from equal weights; DDP also
            broadcasts rank 0's at construction).
        spec: micro-batch size, optimizer and schedule. Only ``tp == pp == 1`` layouts.
        total_steps: optimizer steps of the whole run; required by the cosine schedule.
        process_group: the data-parallel group; ``None`` = the default group (when initialised).
        kind: ``"policy"`` (log-probs and entropy) or ``"value"`` (values).
        seed: draws the initial LoRA adapters (``spec.lora``); the same on every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: TorchTrainSpec,
        *,
        total_steps: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        kind: ModelKind = "policy",
        seed: int = 0,
    ) -> None:
        if spec.layout.tp != 1 or spec.layout.pp != 1:
            raise ValueError(
                f"train.engine 'torch' supports tp = pp = 1 only (got tp={spec.layout.tp}, "
                f"pp={spec.layout.pp}); use train.engine 'megatron'"
            )
        if spec.optim.schedule == "cosine" and (total_steps is None or total_steps < 1):
            raise ValueError("train.optim.schedule 'cosine' needs the run's total optimizer steps")
        self.spec = spec
        self.kind: ModelKind = kind
        # LoRA: peft injects its layers into ``model`` in place and freezes the base weights;
        # ``model`` stays the module every forward runs, ``self.peft`` switches the adapters.
        self.peft = add_lora(model, spec.lora, seed) if spec.lora is not None else None
        self.module = model
        self.home = next(model.parameters()).device  # where reload() brings the state back
        # Shared prompts go per micro-batch to whichever layout costs fewer FLOPs: the shared
        # row or, without sharing, packed rows (or the padded batch, with remove_padding off or
        # a model that fails the packing probe).
        self._pack = spec.remove_padding
        self._layout_flops = _layout_flops(model) if spec.share_prompts else None
        if spec.share_prompts:
            check_packing(model, shared_prompts=True)
        if self._pack:
            try:
                check_packing(model)
            except ValueError:
                if not spec.share_prompts:
                    raise
                self._pack = False
        self._chunk_head = self._chunkable_head()
        # After the packing probes, which then run eagerly.
        self._compiled = CompiledLayers(model) if spec.compile else None
        self.process_group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.dp_size = dist.get_world_size(process_group) if distributed else 1
        self.dp_rank = dist.get_rank(process_group) if distributed else 0
        self._ddp: DistributedDataParallel | None = self._wrap_data_parallel(model)
        optim = spec.optim
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trained,
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            # One kernel over all tensors, as TRL's default optimizer (adamw_torch_fused): 3.5x
            # faster than the per-tensor loop on CPU (1.6M parameters: 0.9 ms against 3.1 ms).
            fused=all(p.device.type in ("cpu", "cuda") for p in trained) or None,
        )
        self.total_steps = total_steps or 0
        # A partial, not a lambda over self: the scheduler must not keep the engine alive.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, optim=optim, total_steps=self.total_steps)
        )

    def _wrap_data_parallel(self, model: nn.Module) -> DistributedDataParallel | None:
        """The wrapper the update's forward and backward run through (None: the module itself,
        one rank). A sharded engine overrides it to shard ``model`` in place."""
        if self.dp_size == 1:
            return None
        # Buffers (rotary tables) are derived from the config: no per-forward broadcast.
        return DistributedDataParallel(model, process_group=self.process_group, forward_sync_buffers=False)

    def _gradient_sync(self, is_last: bool):
        """Inside: this micro-batch's backward reduces gradients over the ranks or not (DDP
        reduces once, at the last micro-batch)."""
        return nullcontext() if (self._ddp is None or is_last) else self._ddp.no_sync()

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """The gradient norm before clipping (a plain 0-dim tensor, equal on every rank)."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    @classmethod
    def build(
        cls, module: nn.Module, spec: TorchTrainSpec, *, kind: ModelKind, total_steps: int, seed: int
    ) -> "TorchTrainEngine":
        """Data parallel over the default process group (every rank of the worker group)."""
        return cls(module, spec, total_steps=total_steps, kind=kind, seed=seed)

    def _chunkable_head(self) -> nn.Linear | None:
        """The LM head whose weight the chunked log-probs read, or None for the model's logits."""
        if self.kind != "policy" or self.spec.logits_chunk_tokens is None:
            return None
        head = self.module.get_output_embeddings() if hasattr(self.module, "get_output_embeddings") else None
        # A peft-wrapped head is no plain nn.Linear: its adapters would be skipped.
        if type(head) is not nn.Linear or head.bias is not None:
            return None
        if head.weight.shape[0] < GATHER_BEFORE_HEAD_VOCAB:
            return None
        config = getattr(self.module, "config", None)
        if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
            return None
        return head

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.process_group

    # -- forward ------------------------------------------------------------------------------

    def _outputs(
        self, module: nn.Module, mb: TensorDict, temperature: float
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs (B, R) of one micro-batch, zero outside ``response_mask``.

        The logit at position ``t`` predicts token ``t + 1``, so the response tokens
        ``input_ids[:, -R:]`` are read from positions ``-R-1 .. -2``; a value model's value of
        response token j is likewise its output at the position just before it (the state the
        token was sampled in).
        """
        responses = mb[K.RESPONSES]
        response_mask = mb[K.RESPONSE_MASK]
        num_response_tokens = responses.shape[1]
        tail = self._tail_outputs(module, mb, num_response_tokens + 1)  # (B, R + 1, D)
        if self.kind == "value":
            values = tail[:, :-1, 0].float()
            # A reward model scores the whole text: its output at the last valid token itself.
            last = (response_mask.sum(-1) - 1).clamp(min=0)
            last_values = tail[:, 1:, 0].float().gather(1, last[:, None])[:, 0]
            return {K.VALUES: values * response_mask, "last_values": last_values}
        if self._chunk_head is not None:
            return self._chunked_read_outs(tail[:, :-1], responses, response_mask, temperature)
        logits = tail[:, :-1]
        if logits.dtype not in (torch.float32, torch.float64):  # mixed precision: bf16 logits
            logits = logits.float()
        logits = logits / temperature
        mask = response_mask.to(torch.float32)
        return {
            "log_probs": log_probs_from_logits(logits, responses) * mask,
            "entropy": entropy_from_logits(logits) * mask,
        }

    def _chunked_read_outs(
        self, hidden: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, temperature: float
    ) -> dict[str, torch.Tensor]:
        """``_outputs``' log-probs and entropy (B, R) from the final hidden states (B, R, D) of
        the response positions, ``spec.logits_chunk_tokens`` valid tokens at a time."""
        weight = self._chunk_head.weight
        dtype = torch.bfloat16 if self.spec.compute_dtype == "bfloat16" else weight.dtype
        valid = response_mask.bool()
        log_probs, entropy = chunked_log_probs_entropy(
            hidden[valid].to(dtype), weight.to(dtype), responses[valid], temperature,
            self.spec.logits_chunk_tokens,
        )
        zeros = torch.zeros(responses.shape, dtype=log_probs.dtype, device=log_probs.device)
        return {"log_probs": zeros.masked_scatter(valid, log_probs), "entropy": zeros.masked_scatter(valid, entropy)}

    def _head_input_capture(self):
        """While active, the model's ``.logits`` are the LM head's inputs (the final hidden
        states of the positions it would project) and the head projects no row."""
        head = self._chunk_head
        if head is None:
            return nullcontext()
        captured: list[torch.Tensor] = []

        def take_input(_head: nn.Module, args: tuple) -> tuple:
            captured.append(args[0])
            return (args[0].narrow(-2, 0, 0), *args[1:])

        def give_input(_head: nn.Module, _args: tuple, _out: torch.Tensor) -> torch.Tensor:
            return captured.pop()

        return _Hooks(head.register_forward_pre_hook(take_input), head.register_forward_hook(give_input))

    def _tail_outputs(self, module: nn.Module, mb: TensorDict, num_tail: int) -> torch.Tensor:
        """The model's outputs (logits or values) at the last ``num_tail`` padded positions."""
        if self.spec.compute_dtype == "float32":
            return self._tail_outputs_at_dtype(module, mb, num_tail)
        # Mixed precision: autograd replays the casts in the backward.
        with torch.autocast(self.home.type, dtype=getattr(torch, self.spec.compute_dtype)):
            return self._tail_outputs_at_dtype(module, mb, num_tail)

    def _shares_prompts(self, mb: TensorDict) -> bool:
        """Whether this micro-batch runs as one shared-prompt row (``spec.share_prompts`` and
        cheaper than the layout without sharing; always when the model's costs are unknown)."""
        if not self.spec.share_prompts:
            return False
        if self._layout_flops is None:
            return True
        token_flops, pair_flops = self._layout_flops
        return shared_prompts_cheaper(
            mb[K.INPUT_IDS], mb[K.ATTENTION_MASK], mb[K.INPUT_IDS].shape[1] - mb[K.RESPONSES].shape[1],
            token_flops=token_flops, pair_flops=pair_flops, packed=self._pack,
        )

    def _tail_outputs_at_dtype(self, module: nn.Module, mb: TensorDict, num_tail: int) -> torch.Tensor:
        share = self._shares_prompts(mb)
        if not (share or self._pack):
            # A causal LM runs only the last positions through its head.
            keep = {"logits_to_keep": num_tail} if self.kind == "policy" else {}
            with self._head_input_capture():
                return module(
                    input_ids=mb[K.INPUT_IDS],
                    attention_mask=mb[K.ATTENTION_MASK],
                    position_ids=mb[K.POSITION_IDS],
                    use_cache=False,
                    **keep,
                ).logits[:, -num_tail:]
        if share:
            prompt_width = mb[K.INPUT_IDS].shape[1] - mb[K.RESPONSES].shape[1]
            packed = pack_shared_prompts(
                mb[K.INPUT_IDS], mb[K.ATTENTION_MASK], mb[K.POSITION_IDS], num_tail, prompt_width
            )
            extra = {"attention_mask": attention_mask_for(self.module, packed.attention_mask)}
        else:
            packed = pack(mb[K.INPUT_IDS], mb[K.ATTENTION_MASK], mb[K.POSITION_IDS], num_tail)
            extra = {}
        head = self.module.get_output_embeddings() if self.kind == "policy" else None
        if head is None or head.weight.shape[0] < GATHER_BEFORE_HEAD_VOCAB:
            out = module(
                input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **extra
            ).logits
            return out.flatten(0, 1)[packed.index]
        # Only the tail's hidden states go through the LM head: a packed row's prompt positions
        # would otherwise cost a (tokens x vocabulary) product, and its float32 logits, each.
        # The head's rows do not depend on each other, so the logits are those of the full head.
        def gather_tail(_head: nn.Module, args: tuple) -> tuple:
            return (args[0].flatten(0, 1)[packed.index], *args[1:])

        # The gather runs first; a chunked read-out then captures the gathered hidden states.
        with _Hooks(head.register_forward_pre_hook(gather_tail)), self._head_input_capture():
            return module(
                input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **extra
            ).logits

    def _compiled_layers(self):
        """Inside: the decoder layers run compiled (``train.compile``); a no-op without."""
        return self._compiled.active() if self._compiled is not None else nullcontext()

    @torch.no_grad()
    def forward(self, batch: TensorDict, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """No-grad forward in micro-batches; outputs (B, R) are zero outside ``response_mask``.

        Policy: ``{"log_probs", "entropy"}`` of ``responses`` under logits / temperature (float32).
        Value: ``{"values"}`` and ``{"last_values"}`` (B,), the output at the last valid
        response token (what a reward model's score is).
        """
        was_training = self.module.training
        self.module.eval()
        try:
            rows = self._micro_batch_rows(batch)
            micro_batches = [batch[r] for r in rows] if rows else batch.split(self.spec.micro_batch_size)
            with self._compiled_layers():
                parts = [self._outputs(self.module, mb, temperature) for mb in micro_batches]
        finally:
            self.module.train(was_training)
        out = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        if not rows:
            return out
        order = torch.cat(rows)  # the samples' places in `batch`
        return {key: torch.empty_like(value).index_copy_(0, order, value) for key, value in out.items()}

    def _micro_batch_rows(self, batch: TensorDict) -> list[torch.Tensor]:
        """With ``micro_batch_tokens``: the rows of ``batch`` of each micro-batch of the balanced
        token-budget cut. Empty without one (``micro_batch_size`` samples each, in order)."""
        budget = self.spec.micro_batch_tokens
        if budget is None:
            return []
        mask = batch[K.ATTENTION_MASK]
        packed = self.spec.remove_padding or self.spec.share_prompts
        tokens = mask.sum(-1).tolist() if packed else [mask.shape[1]] * mask.shape[0]
        return [torch.tensor(g) for g in token_budget_micro_batches(tokens, budget)]

    # -- update -------------------------------------------------------------------------------

    def _all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.process_group)
        return values

    def train_step(
        self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, float]:
        """One optimizer step over this rank's part of a mini-batch.

        ``loss_fn(micro_batch, forward_out)`` gets in ``forward_out``, besides the model outputs
        (with grad), ``"num_global_tokens"`` and ``"num_global_seqs"``: 0-dim float32 tensors,
        the response tokens and samples (with a response token) of the whole mini-batch over all DP ranks. Returned
        metrics: ``loss`` (sum of the returned losses over micro-batches and ranks, i.e. the
        full-batch loss), ``loss_fn``'s metrics averaged over micro-batches and ranks weighted by
        response tokens, ``grad_norm`` (before clipping), ``lr`` (used by this step),
        ``skipped_step`` (1.0 when the gradient was not finite and the optimizer did not step).
        ``loss_fn`` must return the same metric keys on every rank (they are all-reduced).
        """
        assert batch.batch_size[0] > 0, "every data-parallel rank needs at least one sample"
        model = self._ddp if self._ddp is not None else self.module
        self.module.train()
        num_local_tokens = batch[K.RESPONSE_MASK].sum()
        counts = self._all_reduce_sum(
            torch.stack([num_local_tokens, count_sequences(batch[K.RESPONSE_MASK])]).to(torch.float64)
        )
        num_global_tokens = counts[0].to(torch.float32)
        num_global_seqs = counts[1].to(torch.float32)

        self.optimizer.zero_grad(set_to_none=True)
        rows = self._micro_batch_rows(batch)
        micro_batches = [batch[r] for r in rows] if rows else batch.split(self.spec.micro_batch_size)
        loss_sum = torch.zeros((), dtype=torch.float64)
        weighted_metrics: dict[str, float] = {}
        for i, mb in enumerate(micro_batches):
            is_last = i == len(micro_batches) - 1
            with self._gradient_sync(is_last), self._compiled_layers():
                forward_out = self._outputs(model, mb, temperature)
                forward_out["num_global_tokens"] = num_global_tokens
                forward_out["num_global_seqs"] = num_global_seqs
                loss, metrics = loss_fn(mb, forward_out)
                # DDP (and FSDP2's reduce-scatter) average over ranks; undo it so rank
                # contributions add up.
                (loss * self.dp_size).backward()
            loss_sum += loss.detach().to(torch.float64)
            num_mb_tokens = float(mb[K.RESPONSE_MASK].sum())
            for key, value in metrics.items():
                weighted = float(value) * num_mb_tokens
                weighted_metrics[key] = weighted_metrics.get(key, 0.0) + weighted

        max_norm = self.spec.optim.grad_clip if self.spec.optim.grad_clip is not None else math.inf
        grad_norm = self._clip_gradients(max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        names = sorted(weighted_metrics)
        sums = [float(loss_sum)] + [weighted_metrics[k] for k in names]
        reduced = self._all_reduce_sum(torch.tensor(sums, dtype=torch.float64))
        out = {"loss": float(reduced[0])}
        total_tokens = max(float(num_global_tokens), 1.0)
        out.update({k: float(v) / total_tokens for k, v in zip(names, reduced[1:])})
        out.update(grad_norm=float(grad_norm), lr=lr, skipped_step=float(not finite))
        return out

    # -- weights ------------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters of the unwrapped module with HF names, detached, sharing storage.

        Tied parameters appear once (``lm_head.weight`` is ``model.embed_tokens.weight`` in a
        tied model); buffers are not included (HF causal LMs have none a checkpoint needs).
        """
        for name, param in self.module.named_parameters():
            yield name, param.detach()

    def save_hf(self, path: str) -> None:
        """Rank 0 of the DP group writes ``save_pretrained(path)``; every rank waits for it.

        A LoRA model writes its adapters (peft's ``adapter_config.json`` and
        ``adapter_model.safetensors``), and with ``lora.save_merged`` also the base model with
        the adapters merged into it, a plain HF model, under ``path/merged``.
        """
        if self.dp_rank == 0:
            if self.peft is None:
                self.module.save_pretrained(path)
            else:
                self.peft.save_pretrained(path)
                if self.spec.lora.save_merged:
                    merged = copy.deepcopy(self.peft).merge_and_unload()
                    merged.save_pretrained(os.path.join(path, "merged"))
        if self.dp_size > 1:
            dist.barrier(group=self.process_group)

    # -- LoRA -----------------------------------------------------------------------------------

    def adapters_disabled(self):
        if self.peft is None:
            return super().adapters_disabled()
        return self.peft.disable_adapter()

    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.peft is None:
            return super().merged_weights()
        return merged_named_weights(self.module)

    def adapter_weights(self) -> dict[str, torch.Tensor] | None:
        if self.peft is None:
            return None
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(self.peft).items()}

    def adapter_config(self) -> dict | None:
        if self.peft is None:
            return None
        return self.peft.peft_config["default"].to_dict()

    # -- memory -------------------------------------------------------------------------------

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = list(self.module.parameters())
        for state in self.optimizer.state.values():
            # "step" stays where torch keeps it (a CPU scalar unless capturable).
            tensors.extend(v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")
        return tensors

    def _move(self, device: torch.device) -> int:
        """Module (with its grads) and optimizer state to ``device``; the bytes moved."""
        moved = sum(t.numel() * t.element_size() for t in self._state_tensors() if t.device != device)
        if moved == 0:
            return 0
        self.module.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        return moved

    def offload(self) -> int:
        return self._move(torch.device("cpu"))

    def reload(self) -> int:
        return self._move(self.home)

    # -- checkpoints ----------------------------------------------------------------------------

    @property
    def _dcp_options(self) -> StateDictOptions:
        return _DCP_OPTIONS if self.peft is None else _DCP_LORA_OPTIONS

    def state_dict(self) -> dict:
        """The engine's state for ``torch.distributed.checkpoint``, keyed by parameter name only
        (no rank, no layout): ``model`` (the weights), ``optim`` (AdamW's ``exp_avg``,
        ``exp_avg_sq`` and ``step`` per parameter, and the param-group settings, flattened by
        name) and ``schedule`` (the LR scheduler's counters). Every data-parallel rank holds the
        same full tensors, so a checkpoint of any dp loads at any other. A LoRA engine's
        ``model`` and ``optim`` hold the adapters only (the frozen base is its source's).

        The tensors are the engine's own (no copy): a ``dcp.load`` into this dict fills them in
        place, after which :meth:`load_state_dict` applies the non-tensor values. A fresh
        optimizer gets its (zero) state first, so that there is something to load into.
        """
        fresh = not self.optimizer.state
        model, optim = get_state_dict(self.module, self.optimizer, options=self._dcp_options)
        if self.peft is not None:  # the tied head passes for trainable under its second name
            trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
            model = {name: tensor for name, tensor in model.items() if name in trainable}
        if fresh:  # made by a zero-gradient step at lr 0: make it the state of no step at all
            for param_state in self.optimizer.state.values():
                param_state["step"].zero_()
        return {"model": model, "optim": optim, "schedule": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Take a state in :meth:`state_dict`'s form (e.g. filled by ``dcp.load``)."""
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"],
            optim_state_dict=state["optim"], options=self._dcp_options,
        )
        self.scheduler.load_state_dict(state["schedule"])
        # The graph's optimizer spec, not the checkpoint's, sets the learning rate from here on:
        # a resume may change `train.optim.lr` and its schedule (the step count carries over).
        lr = self.spec.optim.lr
        factor = lr_factor(self.scheduler.last_epoch, self.spec.optim, self.total_steps)
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"], group["lr"] = lr, lr * factor
