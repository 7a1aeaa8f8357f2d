"""Shipped graphs with an ``old_log_prob`` node put back, for tests of what such a node does.

The GRPO-family graph files leave it out: their update takes one optimizer step per batch, so its
own first forward is pi_old (``Graph.redundant_nodes``). Tests of the node itself (the
redundancy check, an actor log_prob beside the ref's on another pool, the actor's log_prob on a
colocated process) load the file with the node added back, as graphs of several optimizer steps
per batch have it.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.graph.dag import Graph, build_graph
from hybridflow.spec.graph import GraphSpec
from hybridflow.spec.loading import apply_overrides, read_yaml, validate_model

OLD_LOG_PROB = {"name": "old_log_prob", "op": "log_prob", "model": "actor", "inputs": ["responses"],
                "outputs": ["old_log_probs"]}


def with_old_log_prob(path: str | Path, overrides: list[str] = (), pools_file: str | Path | None = None) -> Graph:
    """``load_graph(path, overrides, pools_file)`` with an ``old_log_prob`` node after
    ``generate`` feeding ``old_log_probs`` to ``update_actor``. The overrides apply first, so
    node indices in them are the file's."""
    raw = apply_overrides(read_yaml(path), list(overrides), path)
    names = [node["name"] for node in raw["nodes"]]
    assert "old_log_prob" not in names, f"{path} has an old_log_prob node already"
    raw["nodes"].insert(names.index("generate") + 1, dict(OLD_LOG_PROB))
    update = raw["nodes"][names.index("update_actor") + 1]
    update["inputs"].insert(1, "old_log_probs")
    return build_graph(validate_model(GraphSpec, raw, path), path, pools_file)
