"""Composing a graph in Python: the same ``GraphSpec`` a YAML file gives.

    g = GraphBuilder("grpo")
    g.model("actor", role="actor", source={"config": {}}, rollout={"n": 8})
    g.node("generate", "generate", model="actor", inputs=["prompts"], outputs=["responses"])
    spec = g.spec()            # validated GraphSpec
    graph = g.build()          # validated Graph (DAG, placement, layouts)
"""

from __future__ import annotations

from typing import Any

from hybridflow.graph.dag import Graph, build_graph
from hybridflow.graph.plugins import import_plugins
from hybridflow.spec.graph import GraphSpec
from hybridflow.spec.loading import validate_model


class GraphBuilder:
    def __init__(self, name: str, resources: str | None = None):
        self._raw: dict[str, Any] = {"name": name, "models": {}, "nodes": []}
        if resources is not None:
            self._raw["resources"] = resources

    def model(self, name: str, role: str, source: dict, **settings: Any) -> "GraphBuilder":
        """Add a model node; ``settings`` are ModelSpec fields (train=..., rollout=...)."""
        self._raw["models"][name] = {"role": role, "source": source, **settings}
        return self

    def node(
        self,
        name: str,
        op: str,
        model: str,
        inputs: list[str] | None = None,
        outputs: list[str] | None = None,
        **options: Any,
    ) -> "GraphBuilder":
        """Add an operation; keyword arguments are the op's options."""
        entry: dict[str, Any] = {"name": name, "op": op, "model": model}
        if inputs is not None:
            entry["inputs"] = inputs
        if outputs is not None:
            entry["outputs"] = outputs
        if options:
            entry["options"] = options
        self._raw["nodes"].append(entry)
        return self

    def plugins(self, *modules: str) -> "GraphBuilder":
        """Modules that register ops of their own (a graph file's ``plugins``): imported now and
        by the workers, found on ``PYTHONPATH``."""
        self._raw.setdefault("plugins", []).extend(modules)
        return self

    def place(self, placement: dict[str, str] | str) -> "GraphBuilder":
        self._raw["placement"] = placement
        return self

    def data(self, **fields: Any) -> "GraphBuilder":
        self._raw.setdefault("data", {}).update(fields)
        return self

    def trainer(self, **fields: Any) -> "GraphBuilder":
        self._raw.setdefault("trainer", {}).update(fields)
        return self

    def spec(self) -> GraphSpec:
        file = f"<python graph {self._raw['name']}>"
        import_plugins(self._raw.get("plugins", []), "", file)
        return validate_model(GraphSpec, self._raw, file)

    def build(self, pools_file: str | None = None) -> Graph:
        return build_graph(self.spec(), f"<python graph {self._raw['name']}>", pools_file)
