"""hybridflow: a single-controller, dataflow-graph RLHF engine.

The Python API: compose a graph with ``GraphBuilder`` (or load a YAML file with ``load_graph``)
and run it with ``run``. Importing this package loads no torch, Ray, vLLM or megatron: its names
load on first use, so a process that imports one submodule (a reward process importing a rule
from ``hybridflow.data.tasks``, the CLI's ``validate``) pays for that submodule only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The op records register their node models with the spec here, so a graph file naming any
# built-in op loads in every process, whichever submodule it imported first (pydantic only).
import hybridflow.graph.ops  # noqa: F401

if TYPE_CHECKING:
    from hybridflow.graph.builder import GraphBuilder
    from hybridflow.graph.dag import Graph, build_graph, load_graph
    from hybridflow.graph.plugins import load_graph_spec
    from hybridflow.spec.loading import SpecError

__all__ = ["Graph", "GraphBuilder", "SpecError", "build_graph", "load_graph", "load_graph_spec", "run"]

_WHERE = {
    "GraphBuilder": "hybridflow.graph.builder",
    "Graph": "hybridflow.graph.dag",
    "build_graph": "hybridflow.graph.dag",
    "load_graph": "hybridflow.graph.dag",
    "SpecError": "hybridflow.spec.loading",
    "load_graph_spec": "hybridflow.graph.plugins",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")


def run(graph: Graph, address: str | None = None, run_dir: str | None = None) -> dict:
    """Run a validated graph to completion; returns the final summary metrics."""
    from hybridflow.controller.trainer import Trainer

    return Trainer(graph, address=address, run_dir=run_dir).fit()
