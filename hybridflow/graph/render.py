"""Pictures of a graph drawn from the real ``Graph`` object, so they cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from hybridflow.graph.dag import SOURCE, Graph, Node, generation_nodes, refilled_nodes
from hybridflow.spec.loading import SpecError


def describe(graph: Graph) -> str:
    """A text picture: one line per node in execution order with what it waits for."""
    lines = [f"graph {graph.spec.name} ({graph.file})", "models:"]
    for name, model in graph.spec.models.items():
        layout = graph.layouts[name]
        lines.append(
            f"  {name:<12} {model.role:<7} pool={graph.placement[name]:<10} "
            f"tp={layout.tp} pp={layout.pp} dp={layout.dp}"
            + (f" rollout pool={graph.rollout_pools[name]}" if name in graph.rollout_pools else "")
        )
    lines.append("nodes (execution order):")
    mode = graph.spec.trainer.async_.mode
    depth = graph.spec.trainer.async_.ahead
    ahead = {n.name for n in generation_nodes(graph)} if depth else set()
    how_far = "the next iteration" if depth == 1 else f"{depth} iterations ahead"
    partial = graph.spec.trainer.async_.partial_rollout
    while_running = f"; new weights load while it runs, partial rollouts {partial}" if partial != "off" else ""
    for node in graph.nodes:
        waits = sorted({src for src in graph.producers(node).values() if src != SOURCE})
        outputs = _refill_note(graph, node) or ", ".join(node.outputs) or (
            "(update)" if graph.op(node).trains else "(metrics only)"
        )
        lines.append(
            f"  {node.name:<14} {node.op:<10} on {node.model:<8} "
            f"{', '.join(node.inputs) or '-'} -> {outputs}"
            + (f"   waits for: {', '.join(waits)}" if waits else "")
            + (f"   ({mode}: submitted for {how_far} before this one's updates{while_running})" if node.name in ahead else "")
        )
    return "\n".join(lines)


def _refill_note(graph: Graph, node: Node) -> str:
    """For a refilling node (dynamic sampling): what it re-runs, else ''."""
    if not graph.op(node).refills:
        return ""
    again = ", ".join(n.name for n in refilled_nodes(graph, node))
    return f"(filtered; re-runs {again} on fresh prompts, <= {node.spec.options.max_rounds} rounds)"


def draw(graph: Graph, out: str | Path) -> Path:
    """Draw the DAG into an image file: one box per node (coloured by its model's pool), edges
    labelled with the keys they carry, data flowing left to right. Needs matplotlib (the ``plot``
    extra); imported here so that describing a graph does not need it."""
    try:
        import matplotlib
    except ImportError:
        raise SpecError(
            graph.file, "--out", "drawing needs matplotlib: pip install 'hybridflow[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    dag = graph.dag.copy()
    for layer, names in enumerate(nx.topological_generations(dag)):
        for name in names:
            dag.nodes[name]["layer"] = layer
    positions = nx.multipartite_layout(dag, subset_key="layer", align="vertical")
    positions = {name: (x, -y) for name, (x, y) in positions.items()}
    pools = graph.used_pools()
    palette = plt.get_cmap("tab10")
    pool_colour = {pool: palette(i % 10) for i, pool in enumerate(pools)}
    pool_of = {node.name: graph.pool_of(node) for node in graph.nodes}
    colours = [pool_colour[pool_of[n]] if n in pool_of else (0.85, 0.85, 0.85, 1.0) for n in dag]
    labels = {
        n: (f"{n}\n{graph.node(n).op} on {graph.node(n).model}" if n in pool_of else "prompts")
        for n in dag
    }
    mode = graph.spec.trainer.async_
    for node in generation_nodes(graph) if mode.ahead else []:  # the pipelining
        labels[node.name] += f"\n({mode.mode}, {mode.ahead} ahead"
        labels[node.name] += f", partial: {mode.partial_rollout})" if mode.partial_rollout != "off" else ")"
    for node in graph.nodes:  # a filter says what it re-runs (the refill is no edge: acyclic)
        if graph.op(node).refills:
            again = ", ".join(n.name for n in refilled_nodes(graph, node))
            labels[node.name] += f"\nre-runs {again}\n<= {node.spec.options.max_rounds} rounds"
    layers = 1 + max(nx.get_node_attributes(dag, "layer").values())
    fig, ax = plt.subplots(figsize=(max(6.0, 2.6 * layers), 5.0))
    nx.draw_networkx_nodes(dag, positions, ax=ax, node_color=colours, node_size=3800, node_shape="s")
    nx.draw_networkx_labels(dag, positions, labels, ax=ax, font_size=7)
    # Edges that skip a layer bend, so they do not run through the boxes in between.
    layer = nx.get_node_attributes(dag, "layer")
    for long_edges, style in ((False, "arc3"), (True, "arc3,rad=0.25")):
        edges = [(u, v) for u, v in dag.edges if (layer[v] - layer[u] > 1) == long_edges]
        nx.draw_networkx_edges(dag, positions, edgelist=edges, ax=ax, node_size=3800,
                               arrowsize=14, node_shape="s", connectionstyle=style)
        nx.draw_networkx_edge_labels(
            dag, positions, {(u, v): ", ".join(dag.edges[u, v]["keys"]) for u, v in edges},
            ax=ax, font_size=6, connectionstyle=style,
        )
    ax.legend(
        handles=[Patch(color=pool_colour[p], label=f"pool {p}: {', '.join(_residents(graph, p))}")
                 for p in pools],
        loc="upper left", fontsize=8, frameon=False,
    )
    ax.set_title(f"{graph.spec.name} ({graph.file})", fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _residents(graph: Graph, pool: str) -> list[str]:
    """What a pool's workers hold: its models, and standalone rollout engines."""
    return graph.models_on(pool) + [f"{m} (rollout)" for m in graph.rollouts_on(pool)]
