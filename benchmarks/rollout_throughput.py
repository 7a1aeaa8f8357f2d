"""Generation throughput of the two rollout engines: transformers ``generate`` vs in-process vLLM.

    .venv/bin/python benchmarks/rollout_throughput.py [--repeats 3] [--threads 1]

Workloads (stated in the table): the default GRPO iteration of one DP rank (8 prompts x 16
samples, prompts of 5-8 characters, up to 8 new tokens) on the tiny Qwen2 the vLLM graph runs
(hidden 64, 2 layers, 2 heads of 32), and the same batch with up to 64 new tokens on a wider
model (hidden 256, 4 layers, 4 heads of 64). Both engines hold the same float32 weights and sample
at temperature 1 until EOS or the limit; throughput = generated tokens (``response_mask`` summed)
/ wall seconds of one ``generate`` call, median of ``--repeats`` after one warm-up call. One
process, ``--threads`` torch/OMP threads; vLLM's start-up time is reported separately.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    return parser.parse_args()


WORKLOADS = [
    # name, model config overrides, max new tokens
    ("tiny (h64 L2), 8 new", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}, 8),
    ("wide (h256 L4), 64 new",
     {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 512, "max_position_embeddings": 256}, 64),
]


def _time_generate(engine, prompts, params, repeats: int) -> tuple[float, float]:
    """(median seconds, median generated tokens) of ``repeats`` calls after one warm-up."""
    from hybridflow.data import keys as K

    engine.generate(prompts, params)
    seconds, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
        tokens.append(float(out[K.RESPONSE_MASK].sum()))
    return statistics.median(seconds), statistics.median(tokens)


def main() -> int:
    args = _args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, ROOT)
    from tensordict import NonTensorStack, TensorDict

    from hybridflow.data import keys as K
    from hybridflow.data.tasks import get_task
    from hybridflow.data.tokenizer import build_char_tokenizer
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.hf_rollout import HFRolloutEngine
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.vllm import VLLMRolloutEngine, save_for_vllm
    from hybridflow.spec.graph import ModelSource

    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz=")
    texts = ["abcde=", "hgfedcb=", "zyx=", "mnopq=", "qwerty=", "lkj=", "aaaa=", "pqrs="][: args.prompts]
    texts = (texts * ((args.prompts + 7) // 8))[: args.prompts]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    prompts = TensorDict(
        {
            K.PROMPT_IDS: enc["input_ids"],
            K.PROMPT_MASK: enc["attention_mask"],
            K.UID: torch.arange(len(texts)),
            K.PROMPT_TEXT: NonTensorStack(*texts),
            K.GROUND_TRUTH: NonTensorStack(*[""] * len(texts)),
        },
        batch_size=[len(texts)],
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = []
    for name, config, max_new in WORKLOADS:
        torch.manual_seed(0)
        module = build_causal_lm(ModelSource(config=config), len(tokenizer), pad, eos, seed=0)
        num_params = sum(p.numel() for p in module.parameters())
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=max_new)
        hf = HFRolloutEngine(module, eos_id=eos, pad_id=pad)
        hf_s, hf_tokens = _time_generate(hf, prompts, params, args.repeats)
        model_dir = save_for_vllm(module, tokenizer, tempfile.mkdtemp(prefix="bench-vllm-"))
        start = time.perf_counter()
        vllm = VLLMRolloutEngine(
            model_dir, eos_id=eos, pad_id=pad, max_model_len=enc["input_ids"].shape[1] + max_new
        )
        startup = time.perf_counter() - start
        vllm_s, vllm_tokens = _time_generate(vllm, prompts, params, args.repeats)
        sync_start = time.perf_counter()
        vllm.load_weights((k, v.detach()) for k, v in module.named_parameters())
        sync = time.perf_counter() - sync_start
        rows.append((name, num_params, len(texts) * args.n, hf_tokens / hf_s, vllm_tokens / vllm_s,
                     hf_s, vllm_s, startup, sync))
        # Next workload, next engine: vLLM's process-wide parallel state must go first.
        del vllm
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()

    print(f"# rollout throughput: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores visible, {args.threads} thread(s), float32, T=1, "
          f"median of {args.repeats} after 1 warm-up")
    print()
    print("| workload | params | samples | transformers tok/s | vLLM tok/s | speed-up "
          "| transformers s/call | vLLM s/call | vLLM start-up s | vLLM weight load s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, num_params, samples, hf_tps, v_tps, hf_s, v_s, startup, sync in rows:
        print(f"| {name} | {num_params / 1e6:.2f}M | {samples} | {hf_tps:,.0f} | {v_tps:,.0f} "
              f"| {v_tps / hf_tps:.1f}x | {hf_s:.3f} | {v_s:.3f} | {startup:.1f} | {sync:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
