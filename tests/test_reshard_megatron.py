"""The resharder on the megatron engine's real shards (4 gloo CPU ranks, training TP=4):

- generation at tg = 1: the generation shards, vocabulary trimmed, loaded into an HF model give
  the original HF model's logits (both paths);
- generation at tg = 2: every rank's shards are bitwise the tg-way slices of the (vocab-padded) HF
  weights, and a 2-way megatron TP model built from them gives the HF model's logits.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_harness import init_dist, spawn, tiny_hf  # noqa: E402

from hybridflow.spec.graph import TrainEngineSpec  # noqa: E402
from hybridflow.spec.layout import GenerationLayout, ParallelLayout, RankCoords  # noqa: E402

HEADS = {"num_attention_heads": 4, "num_key_value_heads": 4}  # TP=4 needs 4 query groups


def _check(rank, world, port):
    init_dist(rank, world, port)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_cuda_manual_seed

    from hybridflow.engines.megatron import Dims, MegatronTrainEngine, hf_to_megatron
    from hybridflow.engines.megatron.convert import resharding_full
    from hybridflow.engines.megatron import cpu_compat
    from hybridflow.engines.megatron.model import build_gpt_model, load_megatron_state
    from hybridflow.hybrid_engine.groups import gen_coords
    from hybridflow.hybrid_engine.reshard import build_groups, reference_generation_shard, reshard_to_generation

    hf = tiny_hf(tied=False, **HEADS)
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits

    train = ParallelLayout(tp=4, pp=1).resolve(world)
    engine = MegatronTrainEngine(
        copy.deepcopy(hf), TrainEngineSpec(engine="megatron", layout=train, micro_batch_size=2)
    )
    c = train.coords(rank)  # the resharder's rank numbering is megatron's
    assert (c.tp_rank, c.pp_rank, c.dp_rank) == (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    shard = engine.train_shard()
    specs = shard.specs
    full = resharding_full(hf.state_dict(), Dims.from_hf(hf.config), train.tp)

    # tg = 1: an HF model from the generation shards, taken straight from the engine's training
    # shard (its parameters' own storage: nothing packed)
    gen1 = GenerationLayout(train=train, tp=1, pp=1)
    for mode in ("zero_redundancy", "naive"):
        shards, stats = reshard_to_generation(shard.buffer, specs, gen1, build_groups(gen1), mode)
        assert stats.packed_bytes == 0
        own = shard.buffer.flat.untyped_storage().data_ptr()
        assert any(p.untyped_storage().data_ptr() == own for pieces in shards.values() for p in pieces)
        state = dict(shard.to_hf(shards, 1))
        model = copy.deepcopy(hf)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(state, strict=True)
        with torch.no_grad():
            got = model(input_ids=ids).logits
        assert torch.equal(got, want), (mode, float((got - want).abs().max()))
        shards.release()

    # tg = 2: bitwise shards, then a 2-way megatron TP model built from them
    gen2 = GenerationLayout(train=train, tp=2, pp=1)
    shards, stats = reshard_to_generation(shard.buffer, specs, gen2, build_groups(gen2))
    expected = reference_generation_shard(full, specs, gen2, rank)
    for name, tensor in expected.items():
        assert torch.equal(shards.tensor(name), tensor), name
    hf_state = dict(shard.to_hf(shards, 2))
    shards.release()
    del engine
    ps.destroy_model_parallel()
    # Generation TP groups take training TP ranks at stride t/tg = 2: {0, 2} and {1, 3}, i.e.
    # megatron's groups with DP fastest (micro-DP groups {0, 1}, {2, 3} are consecutive).
    ps.initialize_model_parallel(tensor_model_parallel_size=2, order="dp-tp-pp")
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=cpu_compat.needed())
    tg_rank = ps.get_tensor_model_parallel_rank()
    assert tg_rank == gen_coords(gen2, rank).tp
    assert ps.get_data_parallel_rank() == gen_coords(gen2, rank).micro_dp_rank
    config = copy.deepcopy(hf.config)
    config.vocab_size = specs[0].full_shape[0]  # keep the training padding
    dims = Dims.from_hf(config)
    # one tg-rank's HF shards are the full tensors of a model with 1/tg of the heads and ffn
    local = dataclasses.replace(
        dims,
        num_heads=dims.num_heads // 2,
        num_kv_heads=dims.num_kv_heads // 2,
        ffn_hidden_size=dims.ffn_hidden_size // 2,
        vocab_size=dims.vocab_size // 2,
    )
    module = build_gpt_model(config, RankCoords(ParallelLayout(tp=2), tp_rank=tg_rank))
    state = hf_to_megatron(hf_state, local, RankCoords(ParallelLayout()))
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):  # the partition's rows
        if key in state:  # (hf_to_megatron pads the vocabulary to 64 for vLLM)
            state[key] = state[key][: local.vocab_size]
    load_megatron_state(module, state)
    with torch.no_grad():
        out = module(ids, torch.arange(9)[None].expand(2, -1), cpu_compat.causal_mask(9))
        got = gather_from_tensor_model_parallel_region(out)[..., :vocab]
    err = float((got - want).abs().max())
    assert err < 1e-5, err


@pytest.mark.slow
def test_megatron_shards_reshard_to_hf_and_tg2_models():
    spawn(_check, 4)


def _check_grid(rank, world, port):
    """Every training layout (p, t, d) of 4 ranks x every generation layout (pg, tg), both paths:
    the generation shard gathered from the real engine's parameter buffer is bitwise the slice of
    the full weights a (pg, tg) model needs, and nothing was packed."""
    init_dist(rank, world, port)
    from megatron.core import parallel_state as ps

    from hybridflow.engines.megatron import Dims, MegatronTrainEngine
    from hybridflow.engines.megatron.convert import resharding_full
    from hybridflow.hybrid_engine.reshard import build_groups, reference_generation_shard, reshard_to_generation

    hf = tiny_hf(tied=False, num_hidden_layers=4, **HEADS)
    dims = Dims.from_hf(hf.config)
    checked = 0
    for p, t in [(1, 4), (2, 2), (4, 1), (1, 2), (2, 1)]:
        train = ParallelLayout(tp=t, pp=p).resolve(world)
        engine = MegatronTrainEngine(
            copy.deepcopy(hf), TrainEngineSpec(engine="megatron", layout=train, micro_batch_size=2)
        )
        c = train.coords(rank)
        assert (c.tp_rank, c.pp_rank) == (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
        shard = engine.train_shard()
        specs = shard.specs
        full = resharding_full(hf.state_dict(), dims, t)
        for pg in [k for k in range(1, p + 1) if p % k == 0]:
            for tg in [k for k in range(1, t + 1) if t % k == 0]:
                gen = GenerationLayout(train=train, tp=tg, pp=pg)
                groups = build_groups(gen)
                expected = reference_generation_shard(full, specs, gen, rank)
                for mode in ("zero_redundancy", "naive"):
                    shards, stats = reshard_to_generation(shard.buffer, specs, gen, groups, mode)
                    assert stats.packed_bytes == 0
                    assert set(shards) == set(expected), (p, t, pg, tg, mode)
                    for name, tensor in expected.items():
                        assert torch.equal(shards.tensor(name), tensor), (p, t, pg, tg, mode, name)
                    shards.release()
                    checked += 1
        del engine
        ps.destroy_model_parallel()
    assert checked == 2 * (3 + 2 * 2 + 3 + 2 + 2)


@pytest.mark.slow
def test_megatron_buffer_reshards_bitwise_over_the_layout_grid():
    spawn(_check_grid, 4)


@pytest.mark.slow
def test_reshard_benchmark_on_the_megatron_buffer_runs(tmp_path):
    """benchmarks/reshard.py --source megatron end to end on a small model, so the benchmark
    cannot rot: every layout has both paths, and the zero-redundancy one receives less wherever
    generation is smaller than training (as measured, not computed)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "reshard.py"
    out = subprocess.run(
        [sys.executable, str(script), "--world", "4", "--repeats", "1", "--source", "megatron",
         "--layers", "4", "--hidden", "64", "--ffn", "128"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line[:3].strip("| ").isdigit()]
    recv = {}
    for layout, gen, mode, _, received, *_ in rows:
        recv[(layout.strip(), gen.strip(), mode.strip())] = float(received.split()[0])
    layouts = {(layout, gen) for layout, gen, _ in recv}
    assert len(layouts) == 9
    for layout, gen in layouts:
        p, t, _ = map(int, layout.split("-"))
        pg, tg = map(int, gen.split("-"))
        zero, naive = recv[(layout, gen, "zero_redundancy")], recv[(layout, gen, "naive")]
        assert zero < naive if pg * tg > 1 else zero == naive, (layout, gen, zero, naive)
