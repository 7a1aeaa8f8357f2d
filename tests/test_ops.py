"""Op records: one place per op. A new op defined in this module alone runs in a graph on Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import Field
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.graph.dag import Node, load_graph
from hybridflow.graph.library import grpo, ppo
from hybridflow.graph.ops import OPS, Op, graph_keys, register_op, unregister_op
from hybridflow.spec.graph import GraphSpec, Spec, node_types
from hybridflow.spec.loading import SpecError
from hybridflow.workers.sharded import ShardedRef

# -- the built-in records ------------------------------------------------------------------------


def test_each_record_is_its_node_model_and_its_body():
    nodes = node_types()
    assert set(nodes) == set(OPS)
    for name, op in OPS.items():
        assert nodes[name].model_fields["options"].annotation is op.options, name
        for role in op.roles:
            assert op.body_for(role).startswith("hybridflow.workers.ops."), (name, role)
            assert callable(op.load_body(role)), (name, role)
            for slot in op.slots_for(role).values():
                assert set(slot.keys) <= set(graph_keys()), (name, slot)


def test_no_node_class_is_written_by_hand_in_the_spec():
    """Every op's node model is generated from its record, the built-in ones included."""
    import ast
    from pathlib import Path

    import hybridflow.spec

    for path in Path(hybridflow.spec.__file__).parent.glob("*.py"):
        classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
        assert [c.name for c in classes if any(getattr(b, "id", "") == "NodeBase" for b in c.bases)] == [], path
    for name, cls in node_types().items():
        assert cls.model_fields["op"].annotation.__args__ == (name,)


def test_records_flag_what_the_code_asks_about():
    flagged = {flag: {name for name, op in OPS.items() if getattr(op, flag)}
               for flag in ("generates", "multi_turn", "judges", "trains", "scores", "forward", "refills", "text")}
    assert flagged == {
        "generates": {"generate", "multi_turn_generate"},
        "multi_turn": {"multi_turn_generate"},
        "judges": {"judge"},
        "trains": {"update", "pair_update"},
        "scores": {"score", "judge"},
        "forward": {"log_prob", "values", "score"},
        "refills": {"filter"},
        "text": {"generate", "multi_turn_generate", "score", "judge", "filter"},
    }


def test_a_body_that_is_not_module_function_is_refused_at_registration():
    with pytest.raises(ValueError, match="body must be 'module:function'"):
        Op("bad", roles=frozenset({"actor"}), options=Spec, body="no_colon")
    with pytest.raises(ValueError, match="a body per role needs one for each"):
        Op("bad", roles=frozenset({"actor", "critic"}), options=Spec, body={"actor": "m:f"})


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
    assert graph.op(graph.node("update_actor")).body_for("actor") == "hybridflow.workers.ops.update:update_policy"
    assert set(graph.ops) == {"generate", "log_prob", "score", "advantage", "update"}


# -- a new op, defined here only ---------------------------------------------------------------


class LengthBonusOptions(Spec):
    scale: float = Field(1.0, description="Bonus per response token.")


def length_bonus(ctx, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    lengths = batch[K.RESPONSE_MASK].sum(-1).float()
    bonus = node.spec.options.scale * lengths
    out = TensorDict({node.outputs[0]: bonus}, batch_size=batch.batch_size)
    return out, {"metrics": {"bonus/mean": float(bonus.mean())}}


LENGTH_BONUS = Op(
    "length_bonus",
    roles=frozenset({"reward"}),
    options=LengthBonusOptions,
    body=f"{__name__}:length_bonus",
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


ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "tests" / "plugins"  # a user's ops, outside hybridflow/
PLUGIN_GRAPH = PLUGINS / "grpo_length_bonus.yaml"


@pytest.fixture
def plugin_op():
    """The plugin's op is registered by loading its graph; forgotten afterwards, so that the
    other tests see the built-in ops only."""
    yield PLUGIN_GRAPH
    if "length_bonus" in OPS:
        unregister_op("length_bonus")
    sys.modules.pop("length_bonus", None)


def test_a_graph_file_names_its_plugins_and_their_ops_validate(plugin_op):
    graph = load_graph(plugin_op)
    node = graph.node("bonus")
    assert graph.op(node).body_for("reward") == "length_bonus:length_bonus"
    assert node.outputs == ("bonus",) and node.spec.options.scale == 0.5
    assert graph.plugin_dir == str(PLUGINS)
    with pytest.raises(SpecError, match=r"grpo_length_bonus.yaml: plugins\[0\]: cannot import module 'no_such_plugin'"):
        load_graph(plugin_op, ["plugins=[no_such_plugin]"])


def test_a_graph_with_plugins_imports_them_when_it_is_unpickled(plugin_op):
    """A worker process gets the graph pickled: the plugin must be imported there before its
    nodes' classes are looked up."""
    import pickle

    graph = load_graph(plugin_op)
    data = pickle.dumps(graph)
    unregister_op("length_bonus")
    del sys.modules["length_bonus"]
    copy = pickle.loads(data)
    assert "length_bonus" in OPS and copy.node("bonus").spec.options.scale == 0.5


@pytest.mark.slow
def test_a_new_op_defined_in_one_module_runs_in_a_graph_on_ray(ray_session, tmp_path, plugin_op):
    from hybridflow.controller.executor import run_nodes
    from hybridflow.data.datasets import collate_prompts
    from hybridflow.data.tasks import get_task
    from hybridflow.workers.pools import ResourcePool
    from hybridflow.workers.group import WorkerGroup
    from hybridflow.workers.model_worker import ModelWorker

    graph = load_graph(plugin_op, ["models.actor.rollout.n=2"])  # the workers import the plugin too
    task = get_task("copy")
    tokenizer = task.tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    pool = ResourcePool("default", graph.pools["default"])
    pool.create()
    group = WorkerGroup(
        ModelWorker,
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



def test_no_code_compares_an_op_name_where_a_record_flag_would_do():
    """Which models train, which nodes score, which rollouts are multi-turn: the records say
    (``Op.trains``, ``Op.scores``, ...); only graph/ops.py names ops."""
    import ast

    import hybridflow

    root = Path(hybridflow.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path == root / "graph" / "ops.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names_op = any(isinstance(s, ast.Attribute) and s.attr == "op" or isinstance(s, ast.Name) and s.id == "op"
                           for s in sides)
            strings = any(isinstance(s, ast.Constant) and isinstance(s.value, str)
                          or isinstance(s, (ast.Tuple, ast.List, ast.Set)) and s.elts
                          and all(isinstance(e, ast.Constant) for e in s.elts) for s in sides)
            if names_op and strings:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


# -- a user's op through the CLI ------------------------------------------------------------------

_VALIDATE_IN_A_FRESH_INTERPRETER = """
import sys
from hybridflow.cli.main import main
rc = main(["validate", *sys.argv[1:]])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"ray", "vllm", "megatron"})
print("heavy modules:", heavy)
sys.exit(rc)
"""


def _validate(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", _VALIDATE_IN_A_FRESH_INTERPRETER, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_validate_takes_a_plugin_op_and_refuses_its_bad_option_in_one_line_without_ray():
    graph = str(PLUGIN_GRAPH.relative_to(ROOT))
    done = _validate(graph)
    assert done.returncode == 0, done.stderr
    assert f"{graph}: ok (6 nodes, 3 models)" in done.stdout
    assert "heavy modules: []" in done.stdout
    done = _validate(graph, "nodes.bonus.options.scale=-1")
    assert done.returncode == 2
    assert done.stderr == f"error: {graph}: nodes[5].options.scale: Input should be greater than 0 (got -1)\n"
    assert "heavy modules: []" in done.stdout


def test_the_shipped_plugin_example_validates():
    done = _validate("examples/plugin_op/grpo_diversity.yaml", "nodes.diversity.options.prefix_tokens=-2")
    assert done.returncode == 2 and "nodes[3].options.prefix_tokens: Input should be greater than or equal to 0" in done.stderr
    done = _validate("examples/plugin_op/grpo_diversity.yaml")
    assert done.returncode == 0 and "heavy modules: []" in done.stdout, done.stderr


@pytest.mark.slow
def test_hybridflow_run_runs_a_plugin_op_and_logs_its_metric(ray_session, tmp_path, plugin_op):
    from hybridflow.cli.main import main

    run_dir = tmp_path / "run"
    assert main(["run", str(plugin_op), "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    # scale 0.5 x response length (1..8 tokens), averaged over the ranks
    assert all(0.5 <= r["bonus/mean"] <= 4.0 for r in rows)
    assert all(r["bonus/mean"] == pytest.approx(0.5 * r["response_length/mean"]) for r in rows)


# -- the worker is a host ----------------------------------------------------------------------


def test_the_worker_host_stays_small_and_has_no_test_hooks():
    import hybridflow.workers.model_worker as host

    assert len(Path(host.__file__).read_text().splitlines()) <= 250
    hooks = [name for name in dir(host.ModelWorker) if name.startswith("inject")]
    assert hooks == []  # tests/fault_hooks.py installs them


def test_the_checkpointer_imports_the_error_type_not_the_worker_host():
    code = ("import sys, hybridflow.controller.checkpoint; "
            "print('hybridflow.workers.model_worker' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_describe_says_what_a_node_without_outputs_does():
    from hybridflow.graph.render import describe

    try:
        text = describe(load_graph(ROOT / "examples" / "plugin_op" / "grpo_diversity.yaml"))
    finally:
        if "distinct_responses" in OPS:
            unregister_op("distinct_responses")
        sys.modules.pop("diversity", None)
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.startswith("  ")}
    assert "responses -> (metrics only)" in lines["diversity"]
    assert "-> (update)" in lines["update_actor"]


def test_a_python_graph_names_its_plugins_like_a_file(plugin_op, monkeypatch):
    import pickle

    monkeypatch.syspath_prepend(str(PLUGINS))  # the Python API finds plugins on PYTHONPATH
    graph = grpo().plugins("length_bonus").node("bonus", "length_bonus", model="reward", scale=2.0).build()
    assert graph.spec.plugins == ["length_bonus"] and graph.node("bonus").spec.options.scale == 2.0
    data = pickle.dumps(graph)
    unregister_op("length_bonus")  # as in a fresh worker process
    del sys.modules["length_bonus"]
    assert pickle.loads(data).node("bonus").spec.options.scale == 2.0
    assert "length_bonus" in OPS  # imported again where the graph was unpickled
