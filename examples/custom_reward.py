"""A custom reward function, used by PPO (GRPO when the PPO graph is not there).

A rule reward is any function ``fn(prompt, response, ground_truth) -> float`` that the workers
can import, named ``module:function`` in the graph (``models.reward.source.rule``). This one
rewards the copy task's exact answers and penalises rambling::

    python examples/custom_reward.py                  # 20 iterations
    python examples/custom_reward.py --iterations 2   # a smoke run

The workers import the module by name, so its directory must be on their ``PYTHONPATH``: this
script puts ``examples/`` there before Ray starts (on a cluster, install the module instead).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from example_args import parse_args, run_builder

HERE = Path(__file__).resolve().parent
REWARD = "custom_reward:exact_or_partial"


def exact_or_partial(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 for the exact answer; otherwise the share of leading characters right, minus 0.1
    per character beyond the answer's length."""
    if response == ground_truth:
        return 1.0
    prefix = 0
    for got, want in zip(response, ground_truth):
        if got != want:
            break
        prefix += 1
    extra = max(0, len(response) - len(ground_truth))
    return prefix / max(len(ground_truth), 1) - 0.1 * extra


def main() -> None:
    args = parse_args(__doc__)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))

    from hybridflow.graph import library

    algorithm = getattr(library, "ppo", None) or library.grpo
    run_builder(algorithm(reward_fn=REWARD), args, val_interval=args.iterations, sample_interval=1)


if __name__ == "__main__":
    main()
