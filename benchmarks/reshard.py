"""Train -> generate resharding: zero-redundancy (micro-DP all-gather) vs naive (gather the full
model, re-slice), on gloo CPU ranks.

    .venv/bin/python benchmarks/reshard.py [--world 4] [--layers 8] [--hidden 256] [--ffn 1024]
                                           [--repeats 5] [--source synthetic|megatron]

For every (p, t) x (pg, tg) layout on ``--world`` ranks (d = world / (p*t)) and both modes, each
rank reshards a synthetic decoder (every parameter TP-split, equal stages: Table 2's setting)
``--repeats`` times after a warm-up; the table gives the transition time (the all-gather plus
building the generation views; median and min over repeats, of the slowest rank), and
per rank the measured bytes received and peak actor-weight bytes (training shard included),
both as a fraction of the model size M next to Table 2's formula.

``--source megatron`` reshards the megatron engine's own parameter buffer instead (a Qwen2 of the
same size built per training layout; its replicated norms arrive again from micro-DP peers, the
``redundant`` column, so bytes and peak exceed Table 2's by about that much).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _layouts(world: int, max_mp: int) -> list[tuple[int, int, int, int, int]]:
    div = lambda n: [k for k in range(1, n + 1) if n % k == 0]  # noqa: E731
    return [
        (p, t, world // (p * t), pg, tg)
        for p in div(world)
        for t in div(world // p)
        if 1 < p * t <= max_mp
        for pg in div(p)
        for tg in div(t)
        if pg * tg < p * t
    ]


def _megatron_engines(world: int, args: dict, layouts):
    """Per training layout (p, t, d): a real megatron engine's (train_shard, specs), built from
    one random Qwen2 of the benchmark's size (heads 8, KV heads 4, vocab 256)."""
    import copy

    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.megatron import MegatronTrainEngine
    from hybridflow.engines.models import tiny_qwen2_config
    from hybridflow.spec.graph import TrainEngineSpec
    from hybridflow.spec.layout import ParallelLayout

    config = tiny_qwen2_config(
        {"hidden_size": args["hidden"], "num_hidden_layers": args["layers"], "intermediate_size": args["ffn"],
         "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": False},
        vocab_size=256, pad_id=0, eos_id=1,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float()
    for p, t, d in dict.fromkeys((p, t, d) for p, t, d, _, _ in layouts):
        spec = TrainEngineSpec(engine="megatron", layout=ParallelLayout(tp=t, pp=p, dp=d), micro_batch_size=1)
        engine = MegatronTrainEngine(copy.deepcopy(hf), spec)
        shard = engine.train_shard()
        yield (p, t, d), shard.buffer, shard.specs
        del engine
        ps.destroy_model_parallel()


def _synthetic(world: int, args: dict, layouts):
    """Per training layout (p, t, d): this rank's shard of the synthetic decoder, and its specs."""
    import torch.distributed as dist

    from hybridflow.hybrid_engine.reshard import shard_full_weights
    from hybridflow.hybrid_engine.synthetic import decoder_specs, full_weights
    from hybridflow.spec.layout import ParallelLayout

    for p, t, d in dict.fromkeys((p, t, d) for p, t, d, _, _ in layouts):
        specs = decoder_specs(args["layers"], args["hidden"], args["ffn"], 64, pp=p, embeddings=False)
        full = full_weights(specs)
        buffer = shard_full_weights(full, specs, ParallelLayout(tp=t, pp=p, dp=d), dist.get_rank())
        del full
        yield (p, t, d), buffer, specs


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import torch.distributed as dist

    from hybridflow.hybrid_engine.reshard import build_groups, reshard_to_generation
    from hybridflow.spec.layout import GenerationLayout, ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layouts = _layouts(world, args["max_mp"])
    source = _megatron_engines if args["source"] == "megatron" else _synthetic
    rows = []
    for (p, t, d), buffer, specs in source(world, args, layouts):
        for pg, tg in [(pg, tg) for pp_, tt, dd, pg, tg in layouts if (pp_, tt, dd) == (p, t, d)]:
            gen = GenerationLayout(train=ParallelLayout(tp=t, pp=p, dp=d), tp=tg, pp=pg)
            groups = build_groups(gen)
            for mode in ("zero_redundancy", "naive"):
                times, stats = [], None
                for _ in range(args["repeats"] + 1):  # the first is warm-up
                    dist.barrier()
                    start = time.perf_counter()
                    shards, stats = reshard_to_generation(buffer, specs, gen, groups, mode)
                    times.append(time.perf_counter() - start)
                    shards.release()
                rows.append({"layout": [p, t, d, pg, tg], "mode": mode, "times": times[1:], **stats.__dict__})
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-mp", type=int, default=8, help="largest p*t to include")
    parser.add_argument(
        "--source", choices=["synthetic", "megatron"], default="synthetic",
        help="synthetic: every tensor TP-split (Table 2's setting); megatron: the megatron "
        "engine's own parameter buffer (a Qwen2 with replicated norms)",
    )
    args = parser.parse_args()

    import multiprocessing

    import torch.multiprocessing as mp

    preload = ["torch", "hybridflow.hybrid_engine.reshard"]
    if args.source == "megatron":
        preload += ["hybridflow.engines.megatron", "transformers"]
    multiprocessing.set_forkserver_preload(preload)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker, args=(args.world, port, vars(args), out), nprocs=args.world, start_method="forkserver"
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]

    model_mb = ranks[0][0]["model_bytes"] / 2**20
    what = "synthetic decoder" if args.source == "synthetic" else "megatron engine buffer, Qwen2"
    print(
        f"world {args.world} gloo CPU ranks, {what} {args.layers} layers, hidden {args.hidden}, "
        f"ffn {args.ffn}: M = {model_mb:.1f} MiB fp32; median of {args.repeats}\n"
    )
    header = (
        "| p-t-d | pg-tg | mode | time ms median (min) | recv/M max rank (Table 2) "
        "| peak/M max rank (Table 2) | redundant recv/M | collectives |"
    )
    print(header)
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, row in enumerate(ranks[0]):
        p, t, d, pg, tg = row["layout"]
        per_rank = [r[i] for r in ranks]
        time_ms = max(statistics.median(r["times"]) for r in per_rank) * 1e3
        min_ms = max(min(r["times"]) for r in per_rank) * 1e3
        M = row["model_bytes"]
        recv = max(r["received_bytes"] for r in per_rank) / M
        peak = max(r["peak_bytes"] for r in per_rank) / M
        if row["mode"] == "zero_redundancy":
            recv_f, peak_f = (t * p - tg * pg) / (tg * pg * t * p), 1 / (tg * pg)
        else:
            recv_f, peak_f = (t * p - 1) / (t * p), 1.0
        redundant = max(r["redundant_bytes_received"] for r in per_rank) / M
        print(
            f"| {p}-{t}-{d} | {pg}-{tg} | {row['mode']} | {time_ms:.0f} ({min_ms:.0f}) | {recv:.3f} ({recv_f:.3f}) "
            f"| {peak:.3f} ({peak_f:.3f}) | {redundant:.4f} | {row['num_collectives']} |"
        )


if __name__ == "__main__":
    main()
