"""Multi-turn rollouts: per-sample asynchronous turns (overlap) against lock-step rounds.

Runs the same episodes twice through ``hybridflow.envs.rollout.run_episodes`` with a real
rollout engine (transformers by default; ``--engine vllm`` for vLLM in-process): once with
``overlap`` (an episode whose environment step returned joins the next generate call) and once
lock-step (every round waits for the slowest step). The environment's steps take a seeded,
heavy-tailed time (log-normal, ``--step-ms`` median), like sandboxed programs or remote tools,
or run a real sandboxed Python program (``--sandbox``). Prints one JSON line per mode: wall
seconds, generate calls, mean contexts per call, model tokens.

    OMP_NUM_THREADS=1 python benchmarks/multi_turn_overlap.py --episodes 64 --turns 4

Run it alone on the machine: the numbers are wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from hybridflow.data.tasks import TASKS
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.models import build_causal_lm
from hybridflow.envs.base import Environment, Step
from hybridflow.envs.rollout import TurnLimits, make_episodes, run_episodes
from hybridflow.spec.graph import ModelSource


class SlowToolEnv(Environment):
    """Every turn is a tool call that takes a seeded log-normal time; done after ``turns``."""

    def __init__(self, turns: int, step_ms: float, sandbox: bool) -> None:
        self.turns, self.step_ms, self.count = turns, step_ms, 0
        self.sandbox = None
        if sandbox:
            from hybridflow.envs.sandbox import Sandbox

            self.sandbox = Sandbox()

    def reset(self, row):
        self.rng = random.Random(row["seed"])
        return ""

    def step(self, action_text: str) -> Step:
        self.count += 1
        seconds = self.rng.lognormvariate(0.0, 1.0) * self.step_ms / 1000
        if self.sandbox is not None:
            self.sandbox.run(f"import time\ntime.sleep({seconds})\nprint(1)")
        else:
            time.sleep(seconds)
        return Step("[1]", 0.0, self.count >= self.turns, {"tool_calls": 1})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=200.0, help="median environment step time")
    parser.add_argument("--sandbox", action="store_true", help="steps run a sandboxed program")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=96, help="response tokens per episode")
    parser.add_argument("--workers", type=int, default=16, help="environment threads")
    args = parser.parse_args()

    torch.manual_seed(0)
    tok = TASKS["product"].tokenizer()
    source = ModelSource(config={"hidden_size": args.hidden, "num_hidden_layers": args.layers})
    module = build_causal_lm(source, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from hybridflow.engines.vllm import VLLMRolloutEngine as Engine
    else:
        from hybridflow.engines.hf_rollout import HFRolloutEngine as Engine
    engine = Engine.build(module, tok, max_model_len=args.budget + 16, max_num_seqs=args.episodes, seed=0)
    params = SamplingParams(temperature=1.0)
    rows = [{"seed": i, **r} for i, r in enumerate(TASKS["product"].make_prompts(args.episodes, 0))]
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    limits = TurnLimits(max_turns=args.turns, max_response_tokens=args.budget, eos_id=tok.eos_token_id)

    for overlap in (True, False, True, False):  # twice each, interleaved: the second pair is reported
        calls: list[int] = []

        def generate(contexts, budgets):
            calls.append(len(contexts))
            return engine.generate_turns(contexts, budgets, params, [])

        torch.manual_seed(0)  # the same sampling stream in both modes
        episodes = make_episodes(prompts, rows, lambda: SlowToolEnv(args.turns, args.step_ms, args.sandbox))
        start = time.perf_counter()
        run_episodes(episodes, generate, tok.decode, lambda s: tok.encode(s, add_special_tokens=False), limits,
                     overlap=overlap, num_env_workers=args.workers)
        seconds = time.perf_counter() - start
        print(json.dumps({
            "mode": "overlap" if overlap else "lock-step", "engine": args.engine, "seconds": round(seconds, 3),
            "generate_calls": len(calls), "contexts_per_call": round(sum(calls) / len(calls), 2),
            "model_tokens": sum(sum(e.model_mask) for e in episodes), "turns": sum(e.turns for e in episodes),
            "episodes": args.episodes, "step_ms_median": args.step_ms, "sandbox": args.sandbox,
            "load_avg_1m": os.getloadavg()[0],
        }), flush=True)


if __name__ == "__main__":
    main()
