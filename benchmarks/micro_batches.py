"""Update time by micro-batch size: the torch engine's, and TRL's GRPOTrainer step (peers.py).

``--side engine``: ``TorchTrainEngine.train_step`` (packed rows, the GRPO loss of peers.py's
graph, fused AdamW) on one rank's share of a fixed-length iteration: ``--samples`` samples,
prompts of 4-8 tokens in 8 columns, ``--response-len`` response tokens, a random Qwen2 of the
given shape at one thread (a worker of the 2 x 1 pool). One engine per setting in ``--settings``
(``64``: micro_batch_size 64; ``t1024``: micro_batch_tokens 1024; a trailing ``c``, as ``t1024c``:
with ``train.compile``), stepped in turn, ``--repeats`` rounds after two warm-up steps each
(compilation falls into them); medians printed.

``--side trl`` (run with ``.venv-peers``): TRL's whole step (generation, forward, backward,
AdamW) on peers.py's workload at each ``--trl-micro-batch`` in ``--settings``, 12 steps per
block (the first 3 left out), blocks alternating over ``--rounds``; peers.py's workload flags
pass through.

    .venv/bin/python benchmarks/micro_batches.py --side engine --hidden-size 256 --layers 2 \\
        --intermediate-size 768 --heads 4 --kv-heads 2 --samples 128 --response-len 24
    .venv-peers/bin/python benchmarks/micro_batches.py --side trl --settings 256 64 -- \\
        --hidden-size 256 --layers 2 --intermediate-size 768 --heads 4 --kv-heads 2 --prompts 32 \\
        --samples 8 --max-new-tokens 24 --lr 1e-3 --fixed-length
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import interleaved_medians  # noqa: E402


def engine_side(args: argparse.Namespace) -> None:
    from tensordict import TensorDict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridflow.data import keys as K
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.hybrid_engine.consistency import ConsistencyStats
    from hybridflow.algos.actor_loss import policy_loss_fn
    from hybridflow.spec.engines import TorchTrainSpec
    from hybridflow.spec.graph import TINY_QWEN2, UpdateOptions

    torch.set_num_threads(1)
    shape = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers,
             "intermediate_size": args.intermediate_size, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads}
    vocab, width, size, length = 14, 8, args.samples, args.response_len
    torch.manual_seed(0)
    prompt_lens = torch.randint(4, width + 1, (size // 8,)).repeat_interleave(8)
    prompt_mask = (torch.arange(width)[None] >= (width - prompt_lens)[:, None]).long()
    responses = torch.randint(3, vocab, (size, length))
    ids = torch.cat([torch.randint(3, vocab, (size, width)) * prompt_mask, responses], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(responses)], 1)
    batch = TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
                        K.RESPONSES: responses, K.RESPONSE_MASK: torch.ones_like(responses),
                        K.ADVANTAGES: torch.randn(size, 1).expand(size, length).contiguous()}, batch_size=[size])
    options = UpdateOptions(clip_ratio=0.2, kl_coef=0.0, loss_agg="token-mean")
    engines = {}
    for setting in args.settings:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**(TINY_QWEN2 | shape), vocab_size=vocab, attn_implementation="sdpa"))
        name = setting.removesuffix("c")
        cut = {"micro_batch_tokens": int(name[1:])} if name.startswith("t") else {"micro_batch_size": int(name)}
        engines[setting] = TorchTrainEngine(model, TorchTrainSpec(
            **cut, compile=setting.endswith("c"), optim={"lr": 1e-3, "grad_clip": 1.0}))

    def step(engine: TorchTrainEngine) -> None:
        engine.train_step(batch.clone(), policy_loss_fn(options, ConsistencyStats()))

    medians = interleaved_medians(
        {setting: (lambda engine=engine: step(engine)) for setting, engine in engines.items()}, args.repeats
    )
    first = medians[args.settings[0]]
    print(f"engine update of {size} samples ({length}-token responses), hidden {args.hidden_size}: "
          + " | ".join(f"{s} {ms:.1f} ms ({ms / first:.2f})" for s, ms in medians.items()))


def trl_side(args: argparse.Namespace, workload: list[str]) -> None:
    import peers
    from transformers import TrainerCallback

    base = peers.parse_args([*workload, "--iterations", "12"])
    torch.set_num_threads(base.threads)

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.trl_rewards, self.trl_tokens, self.trl_unfinished = [], [], []  # peers' reward writes these

        def on_step_begin(self, *_, **__) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, *_, **__) -> None:
            self.times.append(time.perf_counter() - self._start)

    times: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for setting in args.settings:
            flags = copy.copy(base)
            flags.trl_micro_batch = int(setting)
            steps = Steps()
            peers.trl_trainer(Path(tempfile.mkdtemp(prefix="trl-micro-")), flags, steps, base.seeds[0]).train()
            times.setdefault(setting, []).extend(steps.times[3:])
            print(f"round {round_}: --trl-micro-batch {setting}: {statistics.mean(steps.times[3:]):.3f} s per step",
                  flush=True)
    means = {setting: statistics.mean(t) for setting, t in times.items()}
    first = means[args.settings[0]]
    print("TRL step: " + " | ".join(f"micro-batch {s} {m:.3f} s ({m / first:.3f})" for s, m in means.items()))


def main() -> None:
    argv = sys.argv[1:]
    workload = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["engine", "trl"], default="engine")
    parser.add_argument("--settings", nargs="+", default=None,
                        help="engine: 64 (samples) or t1024 (tokens) each, c appended to compile "
                             "[64 32 16 t1024]; trl: samples [256 64]")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128, help="engine: one rank's samples")
    parser.add_argument("--response-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="trl: alternating blocks per setting")
    args = parser.parse_args(argv)
    if args.side == "engine":
        args.settings = args.settings or ["64", "32", "16", "t1024"]
        engine_side(args)
    else:
        args.settings = args.settings or ["256", "64"]
        trl_side(args, workload)


if __name__ == "__main__":
    main()
