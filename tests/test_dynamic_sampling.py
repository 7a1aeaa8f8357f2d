"""Dynamic sampling (DAPO): the ``filter`` op, its place in the DAG, and a real run of it.

The filter drops prompt groups whose scores are all equal and has the nodes before it re-run
on fresh prompts; every node after it reads its (filtered) batch. The DAG stays acyclic: the
readers of the filter's input keys that run after it get their edges from the filter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from hybridflow.algos import informative_groups
from hybridflow.graph.dag import build_graph, load_graph, refilled_nodes
from hybridflow.graph.render import describe
from hybridflow.spec.graph import GraphSpec
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
DAPO = ROOT / "graphs" / "dapo.yaml"


def test_informative_groups_by_hand():
    # uid 5: 1 1 1 (all equal: dropped); uid 2: 0 1 (kept); uid 9: one sample (dropped);
    # uid 4: 0.5 0.5 exactly equal floats (dropped); uid 7: 0.1 0.1 + 1e-9 (kept: exact test).
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0, 0.5, 0.5, 0.1, 0.1 + 1e-9, 1.0], dtype=torch.float64)
    uid = torch.tensor([5, 2, 5, 5, 9, 4, 4, 7, 7, 2])
    keep = informative_groups(values, uid)
    assert keep.tolist() == [False, True, False, False, False, False, False, True, True, True]


def test_filter_takes_the_edges_of_its_inputs_to_later_nodes():
    graph = load_graph(DAPO)
    later = {"old_log_prob": {"responses"}, "advantage": {"responses", "scores"}}
    for name, keys in later.items():
        producers = graph.producers(graph.node(name))
        assert set(producers) == keys and set(producers.values()) == {"dynamic_sampling"}, producers
    assert set(graph.producers(graph.node("update_actor")).values()) == {"dynamic_sampling", "old_log_prob", "advantage"}
    assert [n.name for n in refilled_nodes(graph, graph.node("dynamic_sampling"))] == ["generate", "reward"]
    order = [n.name for n in graph.nodes]
    assert order.index("dynamic_sampling") < min(order.index("old_log_prob"), order.index("advantage"))
    text = describe(graph)
    assert "re-runs generate, reward on fresh prompts, <= 3 rounds" in text


def test_graph_out_draws_the_filter(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hybridflow.cli.main import main

    out = tmp_path / "dapo.png"
    assert main(["graph", str(DAPO), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "re-runs generate, reward" in capsys.readouterr().out


def _dapo(edit) -> GraphSpec:
    raw = yaml.safe_load(DAPO.read_text())
    edit(raw)
    return GraphSpec.model_validate(raw)


def _node(raw: dict, name: str) -> dict:
    return next(n for n in raw["nodes"] if n["name"] == name)


def _refused(spec: GraphSpec) -> str:
    with pytest.raises(SpecError) as info:
        build_graph(spec, DAPO)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(DAPO))
    return message


def test_a_later_node_may_not_read_what_the_filter_re_runs():
    # A greedy generate after the filter would read the unfiltered prompts.
    def greedy_after(raw):
        raw["nodes"].append({"name": "greedy", "op": "generate", "model": "actor", "inputs": ["prompts", "advantages"],
                             "outputs": ["greedy_responses"], "options": {"greedy": True}})

    assert "reads ['prompts'] from '<data>', which the filter re-runs" in _refused(_dapo(greedy_after))


def test_filter_refusals():
    def two_filters(raw):
        raw["nodes"].append({"name": "again", "op": "filter", "model": "actor", "inputs": ["responses", "scores"]})

    assert "one filter node per graph" in _refused(_dapo(two_filters))

    def no_scores(raw):
        _node(raw, "dynamic_sampling")["inputs"] = ["responses"]

    assert "needs one score key (scores or costs)" in _refused(_dapo(no_scores))


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_with_what_it_has_after_max_rounds(ray_session, tmp_path):
    """Responses of one token cannot copy a prompt (3-5 letters): every score is 0, every
    group is filtered, both rounds; the batch is filled with the last round's groups and the
    run trains on (zero advantages). With mask_truncated the truncated rows leave the loss."""
    from hybridflow.controller.trainer import Trainer

    graph = load_graph(DAPO, [
        "trainer.iterations=2", "trainer.progress=false", "trainer.val_interval=0", "trainer.save_interval=0",
        "trainer.save_final=false", "data.prompts_per_iteration=4", "models.actor.rollout.n=4",
        "data.max_response_length=1", "nodes.reward.options.overlong_buffer=1",
        "nodes.dynamic_sampling.options.max_rounds=2", "nodes.update_actor.options.mask_truncated=true",
    ])
    Trainer(graph, run_dir=str(tmp_path / "run")).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["reward/mean"] <= 0.0  # 0, minus the overlong punishment of a 1-token response
        assert row["filter/rounds"] == 2 and row["filter/generated_groups"] == 8
        assert row["filter/filtered_groups"] == 8 and row["filter/kept_groups"] == 0
        assert row["filter/filled_groups"] == 4
        assert row["advantage/abs_mean"] == 0.0
        # the filled batch is the last round's: its truncated rows are masked out of the loss
        assert 0.0 <= row["actor/masked_truncated_frac"] <= 1.0
        assert row["timing/generate"] > 0
