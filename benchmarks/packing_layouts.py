"""Forward + backward time of one micro-batch in each layout the torch engine can run, and the
layout its cost model picks (`hybridflow.engines.packing.shared_prompts_cheaper`).

One prompt group after another (``--samples-per-prompt`` samples of each prompt, the groups'
prompts of ``--prompt-lens`` tokens in turn, left-padded to ``--prompt-width``), every response
``--response-len`` tokens long, on a
random Qwen2 of the given shape at one thread. Layouts: ``padded`` (the rollout's padded batch),
``packed`` (``pack``: rows of the padded width or of the longest sample) and ``shared``
(``pack_shared_prompts``: one row, each prompt once, a dense 4D mask). Each is timed in turn,
``--repeats`` rounds, medians printed.

    .venv/bin/python benchmarks/packing_layouts.py --hidden-size 384 --layers 4 --intermediate-size 1024 \
        --heads 6 --kv-heads 2 --samples 16 --samples-per-prompt 8 --prompt-lens 4 5 6 --response-len 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hybridflow.engines.packing import pack, pack_shared_prompts, shared_prompts_cheaper
from hybridflow.engines.torch_engine import _layout_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=14)
    parser.add_argument("--samples", type=int, default=16, help="samples in the micro-batch")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[4, 5, 6], help="per group, in turn")
    parser.add_argument("--prompt-width", type=int, default=8, help="the batch's prompt columns")
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=args.hidden_size, num_hidden_layers=args.layers, intermediate_size=args.intermediate_size,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    groups = args.samples // args.samples_per_prompt
    prompt_mask = torch.zeros(groups, args.prompt_width, dtype=torch.long)
    for group in range(groups):
        prompt_mask[group, args.prompt_width - args.prompt_lens[group % len(args.prompt_lens)]:] = 1
    prompts = torch.randint(3, args.vocab, (groups, args.prompt_width)) * prompt_mask
    prompts, prompt_mask = (t.repeat_interleave(args.samples_per_prompt, 0) for t in (prompts, prompt_mask))
    responses = torch.randint(3, args.vocab, (args.samples, args.response_len))
    ids = torch.cat([prompts, responses], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(responses)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    num_tail = args.response_len + 1

    def padded() -> None:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                    logits_to_keep=num_tail).logits
        out.log_softmax(-1).mean().backward()

    def packed() -> None:
        rows = pack(ids, mask, positions, num_tail)
        out = model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False).logits
        out.flatten(0, 1)[rows.index].log_softmax(-1).mean().backward()

    def shared() -> None:
        row = pack_shared_prompts(ids, mask, positions, num_tail, args.prompt_width)
        out = model(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=row.attention_mask,
                    use_cache=False).logits
        out.flatten(0, 1)[row.index].log_softmax(-1).mean().backward()

    medians = interleaved_medians({"padded": padded, "packed": packed, "shared": shared}, args.repeats, warmup=1)
    token_flops, pair_flops = _layout_flops(model)
    share = shared_prompts_cheaper(ids, mask, args.prompt_width, token_flops=token_flops, pair_flops=pair_flops)
    print(" | ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items())
          + f" | shared / packed {medians['shared'] / medians['packed']:.2f}"
          + f" | engine picks {'shared' if share else 'packed'}")


if __name__ == "__main__":
    main()
