"""Train-engine forwards and updates on SmolLM2-135M-Instruct against a plain transformers loop.

Issue 18 asks, side by side in one run, on the same tokens and threads:

- each training-engine forward (log-probs + entropy, ``TorchTrainEngine.forward``) against a
  plain single-process transformers forward + log-softmax-gather of the response tokens;
- the update's forward + backward + AdamW step (``TorchTrainEngine.train_step``) against its
  plain equivalent (the same micro-batches, the same loss, ``loss.backward()``, AdamW);
- peak memory per worker, before (``train.logits_chunk_tokens: null``, full-vocabulary float32
  logits) and after (chunked read-out).

Every row runs in a fresh child process (a worker), so its peak resident memory is its own:
``rss_loaded_mb`` after the model is built, ``peak_rss_mb`` the process's high-water mark. The
plain loop pads each micro-batch (attention mask and position ids as the rollout gives them) and
projects only the response tail (``logits_to_keep``), as a hand-written loop would. ``CPU s`` is the process's
CPU time of the fastest repeat: on a shared machine it moves less than the wall time. The batch
has the shape of ``graphs/grpo_smollm2.yaml``'s update (see ``smollm2_update.make_batch``:
prompts of 60-79 tokens, ``--n`` samples each, responses of 15-32) with random tokens.

    .venv/bin/python benchmarks/engine_forward.py --threads 2 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_update import SMOLLM2, loss_fn, make_batch  # noqa: E402

from hybridflow.algos import log_probs_from_logits  # noqa: E402
from hybridflow.data import keys as K  # noqa: E402

# row name -> (side, stage, chunked); "before" = the full-logits read-out.
ROWS = {
    "plain forward": ("plain", "forward", False),
    "engine forward, full logits": ("engine", "forward", False),
    "engine forward, chunked": ("engine", "forward", True),
    "plain update": ("plain", "update", False),
    "engine update, full logits": ("engine", "update", False),
    "engine update, chunked": ("engine", "update", True),
}


def _rss_mb() -> float:
    """This process's peak resident set so far, MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _model(args):
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.models import ATTN_IMPLEMENTATION, model_dir

    model = AutoModelForCausalLM.from_pretrained(
        model_dir(SMOLLM2), dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    if args.lora:
        from hybridflow.engines.lora import add_lora
        from hybridflow.spec.graph import LoraSpec

        add_lora(model, LoraSpec(rank=16, alpha=32, target_modules="all-linear"))
    return model


def _plain_log_probs(model, mb, temperature: float = 1.0) -> torch.Tensor:
    """(B, R) log-probs of the responses: padded forward, tail logits, log-softmax, gather."""
    num = mb[K.RESPONSES].shape[1]
    logits = model(
        input_ids=mb[K.INPUT_IDS], attention_mask=mb[K.ATTENTION_MASK], position_ids=mb[K.POSITION_IDS],
        use_cache=False, logits_to_keep=num + 1,
    ).logits[:, :-1]
    return log_probs_from_logits(logits.float() / temperature, mb[K.RESPONSES]) * mb[K.RESPONSE_MASK]


def _plain_step(model, optimizer, batch, micro_batch_size: int) -> None:
    tokens = batch[K.RESPONSE_MASK].sum().float()
    for mb in batch.split(micro_batch_size):
        log_probs = _plain_log_probs(model, mb)
        loss, _ = loss_fn(mb, {"log_probs": log_probs, "num_global_tokens": tokens})
        loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_row(name: str, args) -> dict:
    """One row, in this process: warm-up, then ``args.repeats`` timed calls."""
    side, stage, chunked = ROWS[name]
    torch.set_num_threads(args.threads)
    batch = make_batch(args.samples, args.n)
    model = _model(args)
    if side == "plain":
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-5)
        if stage == "forward":
            model.eval()

            def call():
                with torch.no_grad():
                    for mb in batch.split(args.micro_batch_size):
                        _plain_log_probs(model, mb)
        else:
            model.train()

            def call():
                _plain_step(model, optimizer, batch, args.micro_batch_size)
    else:
        from hybridflow.engines.torch_engine import TorchTrainEngine
        from hybridflow.spec.engines import TorchTrainSpec
        from hybridflow.spec.graph import OptimSpec

        spec = TorchTrainSpec(
            micro_batch_size=args.micro_batch_size, share_prompts=args.share_prompts,
            optim=OptimSpec(lr=3e-5, grad_clip=1.0),
            logits_chunk_tokens=args.chunk_tokens if chunked else None,
        )
        engine = TorchTrainEngine(model, spec, total_steps=args.repeats + 1)
        assert (engine._chunk_head is not None) == chunked, "the engine did not take the asked read-out"

        def call():
            if stage == "forward":
                engine.forward(batch)
            else:
                engine.train_step(batch, loss_fn)

    loaded = _current_rss_mb()
    call()  # warm-up (and AdamW's state)
    times, cpu = [], []
    for _ in range(args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    tokens = int(batch[K.ATTENTION_MASK].sum())
    return {
        "row": name, "side": side, "stage": stage, "chunked": chunked,
        "min_s": min(times), "median_s": statistics.median(times), "cpu_s": min(cpu), "tokens": tokens,
        "tokens_per_s": tokens / min(times), "rss_loaded_mb": loaded, "peak_rss_mb": _rss_mb(),
    }


def _child(name: str, args) -> dict:
    """Run one row in a fresh process (a worker of its own) and read its JSON line."""
    options = json.dumps({**vars(args), "json": "", "row": name})
    done = subprocess.run([sys.executable, __file__, "--child", options], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"row {name!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    plain = {r["stage"]: r["min_s"] for r in results if r["side"] == "plain"}
    lines = [
        "| row | min s (median) | CPU s | tokens/s | x plain | RSS loaded MB | peak RSS MB | peak - loaded MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ratio = r["min_s"] / plain[r["stage"]] if r["stage"] in plain else float("nan")
        lines.append(
            f"| {r['row']} | {r['min_s']:.2f} ({r['median_s']:.2f}) | {r['cpu_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{ratio:.2f} | {r['rss_loaded_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_mb'] - r['rss_loaded_mb']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="train.logits_chunk_tokens")
    parser.add_argument("--share-prompts", action="store_true", help="engine: train.share_prompts")
    parser.add_argument("--lora", action="store_true", help="both sides: LoRA r=16 on all linear layers")
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # a child's options, JSON
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        options = argparse.Namespace(**json.loads(args.child))
        print(json.dumps(run_row(options.row, options)))
        return
    names = [name for name in ROWS if args.only in name]
    print(
        f"SmolLM2-135M, {args.samples} samples ({args.n} per prompt), micro-batches of "
        f"{args.micro_batch_size}, {args.threads} threads, chunks of {args.chunk_tokens} tokens"
        f"{', shared prompts' if args.share_prompts else ''}{', LoRA' if args.lora else ''}; "
        f"min (median) of {args.repeats} after one warm-up, each row in its own process\n",
        flush=True,
    )
    results = []
    for name in names:
        results.append(_child(name, args))
        print(f"  {name}: {results[-1]['min_s']:.2f} s", file=sys.stderr, flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": results}, indent=2))


if __name__ == "__main__":
    main()
