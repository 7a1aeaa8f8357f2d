"""hybridflow: a single-controller, dataflow-graph RLHF engine.

The Python API: compose a graph with ``GraphBuilder`` (or load a YAML file with ``load_graph``)
and run it with ``run``. Importing this package loads no Ray, vLLM or megatron.
"""

from hybridflow.graph.builder import GraphBuilder
from hybridflow.graph.dag import Graph, build_graph, load_graph
from hybridflow.spec.loading import SpecError, load_graph_spec

__all__ = ["Graph", "GraphBuilder", "SpecError", "build_graph", "load_graph", "load_graph_spec", "run"]


def run(graph: Graph, address: str | None = None, run_dir: str | None = None) -> dict:
    """Run a validated graph to completion; returns the final summary metrics."""
    from hybridflow.controller.trainer import Trainer

    return Trainer(graph, address=address, run_dir=run_dir).fit()
