"""Pictures of a graph drawn from the real ``Graph`` object, so they cannot drift from the code."""

from __future__ import annotations

from hybridflow.graph.dag import SOURCE, Graph


def describe(graph: Graph) -> str:
    """A text picture: one line per node in execution order with what it waits for."""
    lines = [f"graph {graph.spec.name} ({graph.file})", "models:"]
    for name, model in graph.spec.models.items():
        layout = graph.layouts[name]
        lines.append(
            f"  {name:<12} {model.role:<7} pool={graph.placement[name]:<10} "
            f"tp={layout.tp} pp={layout.pp} dp={layout.dp}"
        )
    lines.append("nodes (execution order):")
    for node in graph.nodes:
        waits = sorted({src for src in graph.producers(node).values() if src != SOURCE})
        lines.append(
            f"  {node.name:<14} {node.op:<10} on {node.model:<8} "
            f"{', '.join(node.inputs) or '-'} -> {', '.join(node.outputs) or '(update)'}"
            + (f"   waits for: {', '.join(waits)}" if waits else "")
        )
    return "\n".join(lines)
