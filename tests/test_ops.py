"""Op records: one place per op. A new op defined in this module alone runs in a graph on Ray."""

from __future__ import annotations

import sys

import pytest
import torch
from pydantic import Field
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.graph.dag import Node
from hybridflow.graph.library import grpo, ppo
from hybridflow.graph.ops import OPS, Op, graph_keys, register_op, unregister_op
from hybridflow.spec.graph import GraphSpec, Spec, node_types
from hybridflow.spec.loading import SpecError
from hybridflow.workers.sharded import ShardedRef

# -- the built-in records ------------------------------------------------------------------------


def test_each_record_is_its_node_model_and_its_worker_method():
    from hybridflow.workers.model_worker import ModelWorker

    nodes = node_types()
    assert set(nodes) == set(OPS)
    for name, op in OPS.items():
        assert nodes[name].model_fields["options"].annotation is op.options, name
        for role in op.roles:
            assert callable(getattr(ModelWorker, op.method_for(role))), (name, role)
            for slot in op.slots_for(role).values():
                assert set(slot.keys) <= set(graph_keys()), (name, slot)


def test_graph_keys_are_the_fields_their_producers_write():
    keys = graph_keys()
    assert keys["prompts"] == (K.PROMPT_IDS, K.PROMPT_MASK, K.UID, K.PROMPT_TEXT, K.GROUND_TRUTH,
                               K.DATA_SOURCE, K.EXTRA_INFO)
    assert keys["advantages"] == (K.ADVANTAGES, K.RETURNS)
    assert keys["cost_advantages"] == (K.COST_ADVANTAGES, K.COST_RETURNS)
    assert set(keys["greedy_responses"]) < set(keys["responses"])
    vocabulary = {v for k, v in vars(K).items() if k.isupper() and isinstance(v, str)}
    assert {field for fields in keys.values() for field in fields} <= vocabulary


@pytest.mark.parametrize(
    "builder, node, edit, expected",
    [
        (grpo, "advantage", {"inputs": ["responses", "ref_log_probs"]}, "needs one score key (scores or costs)"),
        (grpo, "advantage", {"outputs": ["advantages", "cost_advantages"]}, "at most one advantage key"),
        (ppo, "update_critic", {"inputs": ["responses", "advantages"]}, "needs one values key"),
    ],
)
def test_a_node_that_does_not_fill_its_slots_is_refused_at_validation(builder, node, edit, expected):
    builder = builder()
    index, entry = next((i, n) for i, n in enumerate(builder._raw["nodes"]) if n["name"] == node)
    field = f"nodes[{index}].{next(iter(edit))}"
    entry.update(edit)
    with pytest.raises(SpecError) as info:
        builder.build()
    assert f": {field}: " in str(info.value) and expected in str(info.value)


def test_validation_fills_the_slots_the_worker_reads():
    graph = grpo().build()
    assert graph.node("advantage").slots == {"score": "scores", "values": None, "advantages": "advantages"}
    assert graph.node("update_actor").slots == {}  # the critic's update has values/advantages slots
    assert graph.op(graph.node("update_actor")).method_for("actor") == "update_policy"
    assert set(graph.ops) == {"generate", "log_prob", "score", "advantage", "update"}


# -- a new op, defined here only ---------------------------------------------------------------


class LengthBonusOptions(Spec):
    scale: float = Field(1.0, description="Bonus per response token.")


LENGTH_BONUS = Op(
    "length_bonus",
    roles=frozenset({"reward"}),
    options=LengthBonusOptions,
    method="length_bonus",
    inputs={"*": ("responses",)},
    outputs={"*": ("bonus",)},
    writes={"bonus": ("bonus",)},
)


@pytest.fixture
def length_bonus_op():
    register_op(LENGTH_BONUS)
    yield LENGTH_BONUS
    unregister_op(LENGTH_BONUS.name)
    assert "length_bonus" not in node_types() and "length_bonus" not in OPS


def test_a_registered_op_is_validated_like_a_built_in_one(length_bonus_op):
    builder = grpo().node("bonus", "length_bonus", model="reward", scale=0.5)
    graph = builder.build()
    node = graph.node("bonus")
    assert node.outputs == ("bonus",) and node.spec.options.scale == 0.5
    with pytest.raises(SpecError, match="cannot length_bonus"):
        grpo().node("bonus", "length_bonus", model="actor").build()
    with pytest.raises(SpecError, match=r"nodes\[5\].options.scale: Input should be a valid number"):
        grpo().node("bonus", "length_bonus", model="reward", scale="big").build()
    assert "length_bonus" in str(GraphSpec.model_json_schema())


def _worker_with_length_bonus():
    from hybridflow.workers.model_worker import ModelWorker

    class LengthBonusWorker(ModelWorker):
        def length_bonus(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
            lengths = batch[K.RESPONSE_MASK].sum(-1).float()
            bonus = node.spec.options.scale * lengths
            out = TensorDict({node.outputs[0]: bonus}, batch_size=batch.batch_size)
            return out, {"metrics": {"bonus/mean": float(bonus.mean())}}

    return LengthBonusWorker


@pytest.mark.slow
def test_a_new_op_defined_in_one_module_runs_in_a_graph_on_ray(ray_session, tmp_path, length_bonus_op):
    from ray import cloudpickle

    from hybridflow.controller.executor import run_nodes
    from hybridflow.data.datasets import collate_prompts
    from hybridflow.data.tasks import get_task
    from hybridflow.workers.pools import ResourcePool
    from hybridflow.workers.group import WorkerGroup

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import tests/
    graph = grpo(n=2).data(prompts_per_iteration=4).node(
        "bonus", "length_bonus", model="reward", inputs=["responses"], outputs=["bonus"], scale=0.5
    ).build()
    task = get_task("copy")
    tokenizer = task.tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    pool = ResourcePool("default", graph.pools["default"])
    pool.create()
    group = WorkerGroup(
        _worker_with_length_bonus(),
        pool,
        init_kwargs={
            "graph": graph,
            "models": graph.models_on("default"),
            "tokenizer_dir": str(tmp_path / "tokenizer"),
            "total_steps": 1,
        },
        name="default",
    )
    try:
        prompts = collate_prompts(task.make_prompts(4, seed=1), tokenizer, graph.spec.data.max_prompt_length)
        nodes = [graph.node("generate"), graph.node("bonus")]
        result = run_nodes(graph, nodes, {"default": group}, ShardedRef.put(prompts))
        rollout = result.outputs["generate"].data.fetch()
        bonus = result.outputs["bonus"].data.fetch()["bonus"]
    finally:
        group.shutdown()
        pool.remove()
    lengths = rollout[K.RESPONSE_MASK].sum(-1).float()
    assert bonus.shape == (8,) and torch.equal(bonus, 0.5 * lengths)
    assert len(result.outputs["bonus"].metas) == 2  # both data-parallel ranks ran the body
    assert result.metrics["bonus/mean"] == pytest.approx(float(0.5 * lengths.mean()))
    # What crossed the object store: the bonus ranks put 8 float32 values, and fetched the
    # rollout shards they read; the iteration's totals are the timeline's sums.
    put = {e["node"]: 0 for e in result.timeline}
    for event in result.timeline:
        put[event["node"]] += event["put_bytes"]
    assert put["bonus"] == 8 * 4 and put["generate"] > 0
    assert result.metrics["transfer/put_bytes"] == sum(put.values())
    assert result.metrics["transfer/fetched_bytes"] == sum(e["fetched_bytes"] for e in result.timeline) > 0

