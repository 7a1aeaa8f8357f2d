"""hybridflow vs TRL's GRPOTrainer on the same GRPO workload, iterations alternating in one run.

    make install-peers                      # .venv-peers: the project plus trl==1.16.0
    .venv-peers/bin/python benchmarks/peers.py [--iterations 50] [--warmup 3] [--engine hf|vllm] [--seeds 0 1 2]

Workload (the same for both): a random-init Qwen2 built from one config (hidden 256, 4 layers,
intermediate 512, 4 heads, 2 KV heads, tied embeddings), the built-in character tokenizer and
`copy` task with its per-position accuracy reward, 16 prompts x 8 samples per iteration, up to
64 new tokens at temperature 1.0, no KL term (TRL beta=0), AdamW lr 1e-3 (betas 0.9/0.999, no
weight decay), grad clip 1.0, one optimizer step per rollout batch.

TRL settings that make the work equal: `loss_type="dapo"` (token losses normalised by the
batch's response tokens: hybridflow's token-mean), `scale_rewards="group"` (advantages divided
by the group std: hybridflow's GRPO with norm_by_std), `num_iterations=1` and
`steps_per_generation=1` (one update per rollout batch, so neither side runs a separate
old-log-prob forward: 1 generate + 1 forward/backward each), `per_device_train_batch_size=128`.
hybridflow runs its default CPU layout: two data-parallel ranks (gloo), one torch thread each;
TRL runs in this process with two torch threads. Both see the same 2 cores.

After each TRL step (generation + update, timed by a callback from step begin to step end) the
callback runs one hybridflow iteration, so both share the machine's state over time. Prints mean
iteration time of each after warm-up, their ratio, tokens generated, and mean reward over the
last 10 iterations. With several ``--seeds`` the pair runs once per seed (model init, prompts
and sampling seeded alike on both sides) and the table averages them: the reward after 50
iterations of one seed varies by several hundredths between seeds, about the size of the
margin being checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MODEL_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROMPTS, SAMPLES, MAX_NEW_TOKENS, LR = 16, 8, 64, 1e-3


def hybridflow_trainer(run_dir: Path, iterations: int, engine: str, seed: int):
    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.builder import GraphBuilder

    g = GraphBuilder("peers", resources=str(Path(__file__).resolve().parent.parent / "resource_pools/local_cpu.yaml"))
    g.model(
        "actor",
        role="actor",
        source={"config": MODEL_CONFIG},
        train={"micro_batch_size": 64, "optim": {"lr": LR, "betas": [0.9, 0.999], "grad_clip": 1.0}},
        rollout={"engine": engine, "n": SAMPLES, "temperature": 1.0},
    )
    g.model("reward", role="reward", source={"rule": "hybridflow.data.tasks:copy_reward"})
    g.place({"actor": "default", "reward": "default"})
    g.node("generate", "generate", model="actor", inputs=["prompts"], outputs=["responses"])
    g.node("reward", "score", model="reward", inputs=["responses"], outputs=["scores"])
    g.node("advantage", "advantage", model="actor", inputs=["responses", "scores"], outputs=["advantages"],
           estimator="grpo", norm_by_std=True)
    g.node("update_actor", "update", model="actor", inputs=["responses", "advantages"], outputs=[],
           clip_ratio=0.2, kl_coef=0.0, mini_batches=1)
    g.data(source="builtin:copy", prompts_per_iteration=PROMPTS, max_prompt_length=8,
           max_response_length=MAX_NEW_TOKENS, seed=seed)
    g.trainer(iterations=iterations, seed=seed, val_interval=0, progress=False, save_final=False)
    trainer = Trainer(g.build(), run_dir=str(run_dir))
    trainer._setup()
    return trainer


def trl_trainer(out_dir: Path, iterations: int, callback, seed: int):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from hybridflow.data.tasks import copy_reward, get_task
    from hybridflow.engines.models import TINY_QWEN2

    task = get_task("copy")
    tokenizer = task.tokenizer()
    config = Qwen2Config(**(TINY_QWEN2 | MODEL_CONFIG), vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    rows = task.make_prompts(2000, seed)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])

    def reward(prompts, completions, ground_truth, completion_ids, **_):
        scores = [copy_reward(p, c, g) for p, c, g in zip(prompts, completions, ground_truth)]
        callback.trl_rewards.append(sum(scores) / len(scores))
        callback.trl_tokens.append(sum(len(ids) for ids in completion_ids))
        return scores

    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=iterations, per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=SAMPLES,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1,
        epsilon=0.2, loss_type="dapo", scale_rewards="group", learning_rate=LR, adam_beta1=0.9,
        adam_beta2=0.999, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        bf16=False, seed=seed, disable_dropout=True, dataloader_num_workers=0,
    )
    return GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                       processing_class=tokenizer, callbacks=[callback])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                        help="hybridflow's rollout engine (TRL always generates with transformers)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="one alternating pair of runs per seed; the table averages them")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self, hf):
            self.hf = hf
            self.trl_times, self.trl_rewards, self.trl_tokens = [], [], []
            self.hf_times, self.hf_rewards, self.hf_tokens = [], [], []

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.trl_times.append(time.perf_counter() - self._start)
            iteration = len(self.hf_times) + 1
            start = time.perf_counter()
            metrics = self.hf.step(iteration)
            self.hf_times.append(time.perf_counter() - start)
            self.hf_rewards.append(metrics["reward/mean"])
            self.hf_tokens.append(metrics["rollout/num_tokens"])
            print(f"iter {iteration:3d}  trl {self.trl_times[-1]:6.2f}s r={self.trl_rewards[-1]:.3f}  "
                  f"hybridflow {self.hf_times[-1]:6.2f}s r={self.hf_rewards[-1]:.3f}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="peers-"))
    runs = []
    for seed in args.seeds:
        hf = hybridflow_trainer(work / f"hybridflow-{seed}", args.iterations, args.engine, seed)
        callback = Alternate(hf)
        trainer = trl_trainer(work / f"trl-{seed}", args.iterations, callback, seed)
        try:
            trainer.train()
        finally:
            hf.shutdown()
        runs.append(callback)

    w, last = args.warmup, 10
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    over_runs = lambda get: mean([get(run) for run in runs])  # noqa: E731
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
        "iterations": args.iterations,
        "seeds": args.seeds,
        "hybridflow_rollout_engine": args.engine,
        "warmup": w,
        "trl_iter_s": over_runs(lambda r: mean(r.trl_times[w:])),
        "hybridflow_iter_s": over_runs(lambda r: mean(r.hf_times[w:])),
        "trl_tokens_per_iter": over_runs(lambda r: mean(r.trl_tokens[w:])),
        "hybridflow_tokens_per_iter": over_runs(lambda r: mean(r.hf_tokens[w:])),
        "trl_reward_last10": over_runs(lambda r: mean(r.trl_rewards[-last:])),
        "hybridflow_reward_last10": over_runs(lambda r: mean(r.hf_rewards[-last:])),
        "per_seed": [
            {"seed": seed, "trl_iter_s": mean(r.trl_times[w:]), "hybridflow_iter_s": mean(r.hf_times[w:]),
             "trl_reward_last10": mean(r.trl_rewards[-last:]),
             "hybridflow_reward_last10": mean(r.hf_rewards[-last:])}
            for seed, r in zip(args.seeds, runs)
        ],
    }
    result["ratio_hybridflow_over_trl"] = result["hybridflow_iter_s"] / result["trl_iter_s"]
    print()
    for run in result["per_seed"]:
        print(f"seed {run['seed']}: iteration TRL {run['trl_iter_s']:.3f} s, hybridflow "
              f"{run['hybridflow_iter_s']:.3f} s; reward (last 10) TRL {run['trl_reward_last10']:.3f}, "
              f"hybridflow {run['hybridflow_reward_last10']:.3f}")
    print("| system | mean iteration (s) | tokens generated / iteration | mean reward, last 10 |")
    print("| --- | --- | --- | --- |")
    print(f"| TRL 1.16 GRPOTrainer | {result['trl_iter_s']:.3f} | {result['trl_tokens_per_iter']:.0f} | "
          f"{result['trl_reward_last10']:.3f} |")
    print(f"| hybridflow ({args.engine} rollout) | {result['hybridflow_iter_s']:.3f} | {result['hybridflow_tokens_per_iter']:.0f} | "
          f"{result['hybridflow_reward_last10']:.3f} |")
    print(f"\nhybridflow / TRL iteration time: {result['ratio_hybridflow_over_trl']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
