"""What recording rollout log-probs costs a vLLM generate call (``rollout.log_prob_check_samples``).

One in-process vLLM engine on a random tiny Qwen2 of the given shape (the copy task's
tokenizer), one rollout rank's share of an iteration: ``--prompts`` prompts of 4-8 tokens x
``--n`` samples, every sample ``--max-new-tokens`` long (fixed length, as peers.py
``--fixed-length``). The same engine generates in turn with the log-probs of every sample, of the
default check sample (16) and of none, ``--repeats`` rounds after two warm-up rounds; medians
printed, and each as a ratio to "every sample". One torch thread, as a worker of the 2 x 1 pool.

    .venv/bin/python benchmarks/rollout_log_probs.py --hidden-size 256 --layers 2 \\
        --intermediate-size 768 --heads 4 --kv-heads 2 --prompts 16 --n 8 --max-new-tokens 24
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="prompts of this rank's share")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from tensordict import TensorDict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridflow.data import keys as K
    from hybridflow.data.tasks import get_task
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.vllm import VLLMRolloutEngine
    from hybridflow.spec.graph import TINY_QWEN2, RolloutSpec

    tokenizer = get_task("copy").tokenizer()
    config = Qwen2Config(
        **(TINY_QWEN2 | {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers,
                         "intermediate_size": args.intermediate_size, "num_attention_heads": args.heads,
                         "num_key_value_heads": args.kv_heads}),
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    width = 8
    engine = VLLMRolloutEngine.build(model, tokenizer, max_model_len=width + args.max_new_tokens,
                                     max_num_seqs=args.prompts * args.n, seed=0, shared_prefix_len=width)
    lengths = torch.randint(4, width + 1, (args.prompts,))
    mask = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
    prompts = TensorDict({K.PROMPT_IDS: torch.randint(3, len(tokenizer), (args.prompts, width)) * mask,
                          K.PROMPT_MASK: mask}, batch_size=[args.prompts])
    default = RolloutSpec().log_prob_check_samples
    cases = {"every sample": None, f"{default} samples (default)": default, "none": 0}

    def run(samples: int | None) -> None:
        engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens,
                                                min_new_tokens=args.max_new_tokens, log_prob_samples=samples))

    medians = interleaved_medians({name: (lambda s=samples: run(s)) for name, samples in cases.items()}, args.repeats)
    every = medians["every sample"]
    print(f"{args.prompts} x {args.n} samples, {args.max_new_tokens} tokens, hidden {args.hidden_size}: "
          + " | ".join(f"{name} {ms:.1f} ms ({ms / every:.2f})" for name, ms in medians.items()))


if __name__ == "__main__":
    main()
