"""megatron-core train engine on CPU gloo ranks: HF equivalence of conversion, forward, update.

Every multi-rank check runs real megatron-core layers, schedules, DDP and optimizer on real gloo
process groups (torch.multiprocessing spawn); the CPU workarounds of ``cpu_compat`` are active.
A rank that fails an assertion fails the spawn, and so the test.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_harness import init_dist, pg_loss, random_batch, spawn, tiny_hf  # noqa: E402

from hybridflow.data import keys as K  # noqa: E402
from hybridflow.engines.megatron.convert import Dims, Rank, hf_shards, hf_to_megatron, merge_shards  # noqa: E402
from hybridflow.spec.graph import OptimSpec, TrainEngineSpec  # noqa: E402
from hybridflow.spec.layout import ParallelLayout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

# -- single-process: conversion algebra ---------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_conversion_round_trip_is_bit_exact(tp, pp):
    """HF -> megatron shards of every (tp, pp) rank -> HF-named shards -> merged: bit-exact, and
    every HF-named shard is chunk tp_rank of the full (padded) tensor along tp_dim."""
    hf = tiny_hf(tied=False)
    state = hf.state_dict()
    dims = Dims.from_hf(hf.config)
    pieces: dict[str, list] = {}
    tp_dims = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = Rank(tp_rank, tp, pp_rank, pp)
            for shard in hf_shards(hf_to_megatron(state, dims, rank), dims, rank):
                pieces.setdefault(shard.name, []).append(shard.tensor)
                tp_dims[shard.name] = shard.tp_dim
                assert shard.pp_stage == pp_rank
                if shard.tp_dim is not None:
                    full = state[shard.name]
                    padded = torch.zeros(shard.full_shape)
                    padded[tuple(slice(0, n) for n in full.shape)] = full
                    assert torch.equal(shard.tensor, padded.chunk(tp, shard.tp_dim)[tp_rank])
    assert set(pieces) == set(state)
    for name, tensor in state.items():
        merged = merge_shards(pieces[name][:: 1 if tp_dims[name] is not None else tp], tp_dims[name], name, dims)
        assert torch.equal(merged, tensor), name


def test_qkv_is_grouped_per_query_group():
    """Megatron's fused qkv rows: per KV group, its query heads, then k, then v."""
    hf = tiny_hf()
    dims = Dims.from_hf(hf.config)
    qkv = hf_to_megatron(hf.state_dict(), dims, Rank())["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, qpg = dims.head_dim, dims.heads_per_group
    attn = hf.model.layers[0].self_attn
    group1 = qkv[(qpg + 2) * d : 2 * (qpg + 2) * d]
    assert torch.equal(group1[: qpg * d], attn.q_proj.weight[qpg * d : 2 * qpg * d])
    assert torch.equal(group1[qpg * d : (qpg + 1) * d], attn.k_proj.weight[d : 2 * d])
    assert torch.equal(group1[(qpg + 1) * d :], attn.v_proj.weight[d : 2 * d])


# -- multi-rank: logits, log-probs, round trip, training step ------------------------------------


def _hf_reference_outputs(hf, batch, temperature):
    from hybridflow.engines.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine(hf, TrainEngineSpec(micro_batch_size=4))
    return engine.forward(batch, temperature)


def _check_equivalence(rank, world, port, tp, pp, tied, backend="gloo"):
    """Raw logits (1e-5), log-probs/entropy through the schedule (1e-5), round trip (bitwise).
    On nccl the reference stays on the CPU: tolerances x10 for GPU-vs-CPU float32."""
    init_dist(rank, world, port, backend)
    tol = 1e-5 if backend == "gloo" else 1e-4
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridflow.engines.megatron import MegatronTrainEngine, cpu_compat

    hf = tiny_hf(tied=tied)
    spec = TrainEngineSpec(engine="megatron", layout=ParallelLayout(tp=tp, pp=pp), micro_batch_size=3)
    engine = MegatronTrainEngine(copy.deepcopy(hf), spec)

    # 1. Raw logits of an unpadded batch: megatron (vocab shards gathered) vs HF.
    if pp == 1:
        ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            dev = engine.device
            positions = torch.arange(9, device=dev)[None].expand(2, -1)
            out = engine.gpt_model(ids.to(dev), positions, cpu_compat.causal_mask(9, dev))
            logits = gather_from_tensor_model_parallel_region(out)[..., : hf.config.vocab_size].cpu()
            ref = hf(input_ids=ids).logits
        assert (logits - ref).abs().max() < tol, float((logits - ref).abs().max())

    # 2. log-probs and entropy of a padded batch at a temperature (through the pipeline schedule).
    # Each rank passes its own samples (DP_SPLIT); the model-parallel group runs their union.
    batch = random_batch(7)
    got = engine.forward(batch.chunk(world)[rank], temperature=0.7)
    want = _hf_reference_outputs(copy.deepcopy(hf), batch.chunk(world)[rank], 0.7)
    for key in ("log_probs", "entropy"):
        err = (got[key] - want[key]).abs().max()
        assert err < tol, (key, float(err))

    # 3. Back to HF, bit-exact, on every rank.
    full = engine.full_hf_state()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(full[name].cpu(), tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,tied", [(2, 1, True), (1, 2, True), (2, 2, False)], ids=["tp2", "pp2", "tp2pp2"]
)
def test_hf_equivalence(tp, pp, tied):
    spawn(_check_equivalence, tp * pp, tp, pp, tied)


def _gathered_grads(engine) -> dict[str, torch.Tensor]:
    """The engine's (reduced, clipped) gradients as full HF-named tensors: the weight gather
    run over the gradient buffers instead of the weights."""
    grads = {n: p.main_grad for n, p in engine.gpt_model.named_parameters()}
    original = engine.gpt_model.named_parameters
    engine.gpt_model.named_parameters = lambda: iter(grads.items())
    try:
        return engine.full_hf_state()
    finally:
        engine.gpt_model.named_parameters = original


def _check_train_steps(rank, world, port, tp, pp, dp, grad_clip, backend="gloo"):
    """Two steps vs HF + torch AdamW on the full batch: metrics (1e-5 rel), first-step gradients
    (1e-6 of the largest entry), weights after both steps (2% of lr). x10 on nccl (GPU vs CPU)."""
    init_dist(rank, world, port, backend)
    scale = 1.0 if backend == "gloo" else 10.0
    from hybridflow.engines.megatron import MegatronTrainEngine
    from hybridflow.engines.torch_engine import TorchTrainEngine

    lr = 1e-3
    optim = OptimSpec(lr=lr, betas=(0.9, 0.99), warmup_steps=1, grad_clip=grad_clip)
    hf = tiny_hf(tied=True)
    reference = TorchTrainEngine(copy.deepcopy(hf), TrainEngineSpec(micro_batch_size=4, optim=optim))
    spec = TrainEngineSpec(
        engine="megatron", layout=ParallelLayout(tp=tp, pp=pp), micro_batch_size=2, optim=optim
    )
    engine = MegatronTrainEngine(copy.deepcopy(hf), spec, total_steps=3)
    for step in range(2):
        batch = random_batch(8, seed=10 + step)
        if step == 0:  # the reference gradient, clipped as the reference step will clip it
            probe = copy.deepcopy(reference.module)
            out = reference._outputs(probe, batch, 1.0)
            out["num_global_tokens"] = batch[K.RESPONSE_MASK].sum().float()
            pg_loss(batch, out)[0].backward()
            ref_grads = {n: p.grad for n, p in probe.named_parameters()}
        want = reference.train_step(batch, pg_loss)
        got = engine.train_step(batch.chunk(world)[rank], pg_loss)  # DP_SPLIT over all ranks
        for key in ("loss", "pg", "grad_norm", "lr"):
            assert abs(got[key] - want[key]) < scale * 1e-5 * max(1.0, abs(want[key])), (step, key, got, want)
        if step == 0:
            coeff = min(1.0, grad_clip / (want["grad_norm"] + 1e-6))
            grads = _gathered_grads(engine)
            for name, ref_grad in ref_grads.items():
                err = (grads[name].cpu() - coeff * ref_grad).abs().max()
                assert err < scale * 1e-6 * max(1.0, float(ref_grad.abs().max())), (name, float(err))
    # Adam divides by sqrt(v): float32 noise in near-zero gradient entries moves a weight by up to
    # ~lr, so the weights are compared at a fraction of lr (the gradients above are at 1e-6).
    full = engine.full_hf_state()
    for name, param in reference.module.named_parameters():
        err = (full[name] - param.detach()).abs().max()
        assert err < 2e-2 * lr, (name, float(err))


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,dp,grad_clip",
    [(2, 1, 1, 1.0), (1, 2, 1, 0.05), (2, 1, 2, 0.05), (2, 2, 1, 1.0)],
    ids=["tp2", "pp2-clipped", "tp2dp2-clipped", "tp2pp2"],
)
def test_train_step_matches_torch_adamw(tp, pp, dp, grad_clip):
    world = tp * pp * dp
    spawn(_check_train_steps, world, tp, pp, dp, grad_clip)


@pytest.mark.slow
def test_cuda_check_script_runs_on_cpu():
    """tests/gpu/megatron_cuda_check.py end to end with --cpu (gloo, a tiny model), so the
    one-shot GPU script cannot rot between GPU runs."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "gpu" / "megatron_cuda_check.py"
    small = "--hidden 64 --layers 2 --heads 4 --kv-heads 2 --vocab 100 --batch 4 --micro-batch 2"
    cmd = [sys.executable, str(script), "--cpu", *small.split(), "--prompt-len", "8",
           "--response-len", "8", "--steps", "1", "--dtype", "float32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ALL PASSED" in done.stdout and "tokens/s" in done.stdout
