"""A custom node in a graph: GRPO plus a node of your own that watches response length.

Any op can appear in a graph more than once, on models you add, reading and writing keys you
name; the edges follow from the keys. Here a second ``score`` node runs a rule of our own on a
``cost``-role model: it reads ``responses`` and writes ``costs``, which nothing consumes, so it
only adds ``cost/mean`` to the metrics and its own rows to ``samples.jsonl``; training is plain
GRPO. A new *op* is a plugin: a record and a body in a module of your own, named by the
graph file's ``plugins`` (``examples/plugin_op/``, docs/extending.md).::

    python examples/custom_node.py                    # 20 iterations
    python examples/custom_node.py --iterations 2
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from example_args import parse_args

HERE = Path(__file__).resolve().parent


def length_cost(prompt: str, response: str, ground_truth: str) -> float:
    """How much longer than the answer the response is, in characters (0 when not longer)."""
    return float(max(0, len(response) - len(ground_truth)))


def build(iterations: int):
    from hybridflow.graph.library import grpo

    g = grpo(n=8)
    g.model("length_monitor", role="cost", source={"rule": "custom_node:length_cost"})
    g.place({"actor": "default", "ref": "default", "reward": "default", "length_monitor": "default"})
    g.node("response_length", "score", model="length_monitor", inputs=["responses"], outputs=["costs"])
    g.trainer(sample_interval=1)
    if iterations:  # 0: the library's default length
        g.trainer(iterations=iterations, val_interval=iterations)
    return g.build()


def main() -> None:
    args = parse_args(__doc__)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))

    from hybridflow import run
    from hybridflow.graph.render import describe

    graph = build(args.iterations)
    print(describe(graph))
    print(run(graph, run_dir=args.run_dir))


if __name__ == "__main__":
    main()
