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
from hybridflow.engines.megatron.convert import (  # noqa: E402
    Dims,
    hf_to_megatron,
    resharding_full,
    resharding_named,
    shard_specs,
    to_hf,
)
from hybridflow.spec.engines import TorchTrainSpec  # noqa: E402
from hybridflow.spec.graph import OptimSpec, TrainEngineSpec  # noqa: E402
from hybridflow.spec.layout import ParallelLayout, RankCoords  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

# -- single-process: conversion algebra ---------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_conversion_round_trip_is_bit_exact(tp, pp):
    """HF -> megatron parameters of every (tp, pp) rank -> resharding-layout tensors: each is
    chunk tp_rank of its full tensor along tp_dim; the chunks joined and turned back into HF
    names give the HF weights bit for bit."""
    hf = tiny_hf(tied=False)
    state = hf.state_dict()
    dims = Dims.from_hf(hf.config)
    full = resharding_full(state, dims, tp)
    specs = {s.name: s for s in shard_specs(dims, tp, pp)}
    assert set(full) == set(specs)
    pieces: dict[str, list] = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = RankCoords(ParallelLayout(tp=tp, pp=pp), tp_rank=tp_rank, pp_rank=pp_rank)
            named = resharding_named(hf_to_megatron(state, dims, rank), dims, rank)
            assert set(named) == {n for n, s in specs.items() if s.pp_stage == pp_rank}
            for name, tensor in named.items():
                assert torch.equal(tensor, specs[name].slice_full(full[name], tp, tp_rank)), name
                pieces.setdefault(name, []).append(tensor)
    joined = (
        (n, p[0] if specs[n].tp_dim is None else torch.cat(p, dim=specs[n].tp_dim))
        for n, p in pieces.items()
    )
    back = dict(to_hf(joined, dims, 1, trim_vocab=True))
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_grouped_per_query_group():
    """Megatron's fused qkv rows: per KV group, its query heads, then k, then v."""
    hf = tiny_hf()
    dims = Dims.from_hf(hf.config)
    qkv = hf_to_megatron(hf.state_dict(), dims, RankCoords(ParallelLayout()))["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, qpg = dims.head_dim, dims.heads_per_group
    attn = hf.model.layers[0].self_attn
    group1 = qkv[(qpg + 2) * d : 2 * (qpg + 2) * d]
    assert torch.equal(group1[: qpg * d], attn.q_proj.weight[qpg * d : 2 * qpg * d])
    assert torch.equal(group1[qpg * d : (qpg + 1) * d], attn.k_proj.weight[d : 2 * d])
    assert torch.equal(group1[(qpg + 1) * d :], attn.v_proj.weight[d : 2 * d])


# -- multi-rank: logits, log-probs, round trip, training step ------------------------------------


def _hf_reference_outputs(hf, batch, temperature):
    from hybridflow.engines.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine(hf, TorchTrainSpec(micro_batch_size=4))
    return engine.forward(batch, temperature)


def tiny_llama_gqa(seed: int = 0):
    """A tiny Llama with SmolLM2's attention shape: 9 query heads sharing 3 KV heads, tied
    embeddings, no q/k/v bias; every tensor random, as ``tiny_hf``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=37, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
        with torch.no_grad():
            for name, param in model.named_parameters():
                scale = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, 0.1)
                param.copy_(scale[0] + scale[1] * torch.randn_like(param))
    return model.float()


def _check_equivalence(rank, world, port, tp, pp, tied, backend="gloo", arch="qwen2"):
    """Raw logits (1e-5), log-probs/entropy through the schedule (1e-5), round trip (bitwise).
    On nccl the reference stays on the CPU: tolerances x10 for GPU-vs-CPU float32."""
    init_dist(rank, world, port, backend)
    tol = 1e-5 if backend == "gloo" else 1e-4
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hybridflow.engines.megatron import MegatronTrainEngine, cpu_compat

    hf = tiny_hf(tied=tied) if arch == "qwen2" else tiny_llama_gqa()
    spec = TrainEngineSpec(engine="megatron", layout=ParallelLayout(tp=tp, pp=pp), micro_batch_size=3)
    engine = MegatronTrainEngine(copy.deepcopy(hf), spec)

    # 0. The parameters are the views of one flat training shard, which holds nothing else.
    flat = engine.train_shard().buffer.flat
    inside = [
        p for n, p in engine.gpt_model.named_parameters()
        if p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    ]
    outside = [n for n, p in engine.gpt_model.named_parameters() if all(p is not q for q in inside)]
    assert outside == (["output_layer.weight"] if tied and engine.coords.is_last_stage and pp > 1 else [])
    assert sum(p.numel() for p in inside) == flat.numel()

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
    # Every rank of the model-parallel group passes the same samples (DP_3D; here dp = 1).
    batch = random_batch(7)
    got = engine.forward(batch, temperature=0.7)
    want = _hf_reference_outputs(copy.deepcopy(hf), batch, 0.7)
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


@pytest.mark.slow
def test_llama_gqa_tied_at_tp3():
    """SmolLM2's shape (Llama, 9 heads over 3 KV heads, tied embeddings, no qkv bias) at TP=3:
    one KV head and its three query heads per rank; logits within 1e-5 of HF's."""
    spawn(_check_equivalence, 3, 3, 1, True, "gloo", "llama_gqa")


def _gathered_grads(engine) -> dict[str, torch.Tensor]:
    """The engine's (reduced, clipped) gradients as full HF-named tensors: the weight gather
    run over the gradient buffers instead of the weights."""
    return engine.full_hf_state({n: p.main_grad for n, p in engine.gpt_model.named_parameters()})


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
    reference = TorchTrainEngine(copy.deepcopy(hf), TorchTrainSpec(micro_batch_size=4, optim=optim))
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
        # DP_3D: each data-parallel replica's chunk, the same on its model-parallel ranks.
        got = engine.train_step(batch.chunk(dp)[engine.coords.dp_rank], pg_loss)
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
