"""The whole train -> generate transition of a megatron actor into vLLM (reshard + load), at
generation TP 1 vs 2, zero-redundancy vs naive, on four gloo CPU ranks (issue 19).

    .venv/bin/python benchmarks/hybrid_transition.py [--layers 4] [--hidden 256] [--ffn 1024]
                                                     [--repeats 5]

Megatron trains a tied Qwen2 (heads 8, KV heads 4: head size 32, vocab 256) at t = 2 x p = 2
(d = 1). For each generation layout, in a fresh world of four forked ranks (vLLM keeps its
parallel state per process), every rank builds its vLLM engine (tg = 1: a whole model per
rank; tg = 2: vLLM's external launcher over {0, 1} and {2, 3}) and a ``ReshardedSync`` per
mode, then runs ``--repeats`` transitions per mode after a warm-up: the resharder's gather, the
megatron engine's ``to_hf`` and vLLM's ``load_weights`` of the generation shard. The table gives
the transition time (median and min over repeats of the slowest rank), the resharder's part
(``reshard/seconds`` of the slowest rank, median), and the logged bytes (each the max over ranks): received, the
resharder's peak, and what vLLM took in (``weight_sync/bytes``), as fractions of M.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("zero_redundancy", "naive")


def _worker(rank: int, world: int, port: int, tg: int, args: dict, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.megatron import MegatronTrainEngine
    from hybridflow.engines.models import tiny_qwen2_config
    from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm
    from hybridflow.hybrid_engine.sync import ReshardedSync
    from hybridflow.spec.graph import TrainEngineSpec
    from hybridflow.spec.layout import ParallelLayout

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = tiny_qwen2_config(
        {"hidden_size": args["hidden"], "num_hidden_layers": args["layers"], "intermediate_size": args["ffn"],
         "num_attention_heads": 8, "num_key_value_heads": 4, "tie_word_embeddings": True},
        vocab_size=256, pad_id=0, eos_id=1,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float()
    train = ParallelLayout(tp=2, pp=2).resolve(world)
    engine = MegatronTrainEngine(copy.deepcopy(hf), TrainEngineSpec(engine="megatron", layout=train, micro_batch_size=1))
    syncs = {mode: ReshardedSync(engine.train_shard(), tp=tg, mode=mode) for mode in MODES}
    model_dir = save_for_vllm(hf, None, tempfile.mkdtemp(prefix="hybrid-transition-"))
    tp = {} if tg == 1 else {"tensor_parallel_size": tg, "tp_ranks": [rank - rank % tg + i for i in range(tg)]}
    rollout = VLLMRolloutEngine(model_dir, eos_id=1, pad_id=0, max_model_len=32, seed=0, kv_cache_bytes=16 << 20, **tp)
    rows = []
    for mode in MODES:
        times, reshard_times, metrics = [], [], {}
        for _ in range(args["repeats"] + 1):  # the first is warm-up
            dist.barrier()
            start = time.perf_counter()
            metrics = syncs[mode](rollout)
            times.append(time.perf_counter() - start)
            reshard_times.append(metrics["reshard/seconds"])  # the slowest rank's (max over ranks)
        rows.append({"tg": tg, "mode": mode, "times": times[1:], "reshard_times": reshard_times[1:], **metrics})
    with open(f"{out}/tg{tg}_rank{rank}.json", "w") as f:
        json.dump(rows, f)
    dist.barrier()
    rollout.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch.multiprocessing as mp
    import vllm  # noqa: F401  imported once here: the forked ranks inherit it

    import hybridflow.engines.megatron  # noqa: F401

    world = 4
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for tg in (1, 2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_worker, args=(world, port, tg, vars(args), out), nprocs=world, start_method="fork")
            results[tg] = [json.loads(Path(out, f"tg{tg}_rank{r}.json").read_text()) for r in range(world)]

    first = results[1][0][0]
    M = first["reshard/model_bytes"]
    print(
        f"megatron t=2 x p=2 on {world} gloo CPU ranks -> vLLM; tied Qwen2 {args.layers} layers, hidden "
        f"{args.hidden}, ffn {args.ffn}: M = {M / 2**20:.2f} MiB fp32; median of {args.repeats}\n"
    )
    print("| tg | mode | transition ms median (min) | reshard ms | received/M | peak/M | vLLM took/M | vLLM copy/M |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for tg, ranks in results.items():
        for i, row in enumerate(ranks[0]):
            per_rank = [r[i] for r in ranks]
            median_ms = max(statistics.median(r["times"]) for r in per_rank) * 1e3
            min_ms = max(min(r["times"]) for r in per_rank) * 1e3
            print(
                f"| {tg} | {row['mode']} | {median_ms:.0f} ({min_ms:.0f}) | {statistics.median(row['reshard_times']) * 1e3:.1f} "
                f"| {row['reshard/received_bytes'] / M:.3f} | {row['reshard/peak_bytes'] / M:.3f} "
                f"| {row['weight_sync/bytes'] / M:.3f} | {row['reshard/rollout_copy_bytes'] / M:.3f} |"
            )


if __name__ == "__main__":
    main()
