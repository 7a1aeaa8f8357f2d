"""Graph spec, validation rules, overrides and the Python builder (no Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.graph.dag import load_graph
from hybridflow.graph.library import ALGORITHMS
from hybridflow.graph.plugins import load_graph_spec
from hybridflow.spec.loading import SpecError, apply_overrides

from graph_variants import with_old_log_prob

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"


def write_variant(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(GRPO.read_text())
    raw["resources"] = str(ROOT / "resource_pools" / "local_cpu.yaml")
    edit(raw)
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def node(raw, name):
    return next(n for n in raw["nodes"] if n["name"] == name)


def test_shipped_graph_is_valid_and_ordered():
    graph = load_graph(GRPO)
    names = [n.name for n in graph.nodes]
    assert names[0] == "generate" and names[-1] == "update_actor"
    assert graph.producers(graph.node("update_actor")) == {
        "responses": "generate",
        "ref_log_probs": "ref_log_prob",
        "advantages": "advantage",
    }
    assert graph.layouts["actor"].dp == 2


@pytest.mark.parametrize(
    "edit, field, expected",
    [
        # cycle
        (lambda r: node(r, "generate").update(inputs=["prompts", "advantages"]), "nodes", "cycle"),
        # key nobody produces
        (lambda r: node(r, "advantage").update(inputs=["responses", "values"]), "nodes[3].inputs", "produced by no node"),
        # key produced twice
        (lambda r: node(r, "reward").update(outputs=["ref_log_probs"]), "nodes[2].outputs", "already produced"),
        # op the role cannot do
        (lambda r: node(r, "generate").update(model="ref"), "nodes[0].op", "a ref cannot generate"),
        (lambda r: r["nodes"].append({"name": "u", "op": "update", "model": "ref", "inputs": ["responses"]}), "nodes[5].op", "a ref cannot update"),
        # unknown field
        (lambda r: r["models"]["actor"]["rollout"].update(nn=3), "models.actor.rollout.nn", "unknown field"),
        (lambda r: node(r, "update_actor")["options"].update(clip=0.1), "nodes[4].options.clip", "unknown field"),
        # layout that does not divide its pool
        (lambda r: r["models"]["actor"]["train"].update(layout={"tp": 3}), "models.actor.train.layout", "does not divide"),
        (lambda r: r["models"]["actor"]["train"].update(layout={"dp": 4}), "models.actor.train.layout", "pool has 2 devices"),
        # other mistakes a user makes
        (lambda r: node(r, "generate").update(op="sample"), "nodes[0]", "unknown op 'sample'"),
        (lambda r: r["placement"].update(actor="gpus"), "placement.actor", "unknown pool 'gpus'"),
        (lambda r: node(r, "reward").update(model="rm"), "nodes[2].model", "unknown model 'rm'"),
        (lambda r: r["models"]["actor"].update(source={"config": {}, "path": "x"}), "models.actor.source", "exactly one"),
        (lambda r: r["models"]["actor"]["rollout"].update(temperature=-1), "models.actor.rollout.temperature", "greater than 0"),
    ],
)
def test_validation_errors_name_file_and_field(tmp_path, edit, field, expected):
    path = write_variant(tmp_path, edit)
    with pytest.raises(SpecError) as info:
        load_graph(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {field}"), message
    assert expected in message


def test_inputs_at_different_samples_per_prompt_are_refused():
    """ReMax's greedy baseline is one sample per prompt; with rollout.n=2 the advantage node would
    read 2 sampled rows against 1 baseline row per prompt."""
    path = ROOT / "graphs" / "remax.yaml"
    load_graph(path)  # n: 1 as shipped
    with pytest.raises(SpecError) as info:
        load_graph(path, ["models.actor.rollout.n=2"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: nodes[6].inputs: node 'advantage' reads inputs at different samples"), message
    assert "'baseline_scores' from 'baseline_reward': 1" in message and "'responses' from 'generate': 2" in message


def test_overrides_by_path_index_and_node_name():
    raw = yaml.safe_load(GRPO.read_text())
    out = apply_overrides(
        raw,
        ["trainer.iterations=20", "models.actor.rollout.n=4", "nodes.update_actor.options.kl_coef=0.01", "nodes.0.name=gen"],
        GRPO,
    )
    assert out["trainer"]["iterations"] == 20
    assert out["models"]["actor"]["rollout"]["n"] == 4
    assert node(out, "update_actor")["options"]["kl_coef"] == 0.01
    assert out["nodes"][0]["name"] == "gen"
    assert raw["trainer"]["iterations"] == 400  # the original is untouched
    with pytest.raises(SpecError, match="override path 'nodes.nope' does not exist"):
        apply_overrides(raw, ["nodes.nope.options.kl_coef=1"], GRPO)
    with pytest.raises(SpecError, match="a.b.c=value"):
        apply_overrides(raw, ["trainer.iterations"], GRPO)


def test_overridden_spec_is_validated():
    spec = load_graph_spec(GRPO, ["trainer.iterations=20", "models.actor.rollout.n=4"])
    assert spec.trainer.iterations == 20 and spec.models["actor"].rollout.n == 4
    with pytest.raises(SpecError, match="trainer.iterations"):
        load_graph_spec(GRPO, ["trainer.iterations=zero"])


def test_workers_get_the_sources_absolute_from_the_current_directory(tmp_path, monkeypatch):
    """Workers resolve a model's source where they run (with --address, another directory), so
    the controller sends relative local sources made absolute from where the user ran."""
    monkeypatch.chdir(tmp_path)
    graph = load_graph(ROOT / "graphs/safe_rlhf_learned.yaml", ["models.cost.source.run=/abs/cm"])
    sent = graph.with_absolute_sources()
    assert sent.spec.models["reward"].source.run == str(tmp_path / "runs/rm")  # as the graph gives it
    assert sent.spec.models["cost"].source.run == "/abs/cm"  # absolute stays
    assert sent.spec.models["cost"].source.model == graph.spec.models["cost"].source.model
    assert sent.spec.models["actor"] == graph.spec.models["actor"]  # a config-built actor: no path
    assert graph.spec.models["reward"].source.run == "runs/rm"  # the graph itself (saved, shown) unchanged
    assert [n.name for n in sent.nodes] == [n.name for n in graph.nodes]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_python_builder_equals_yaml(name):
    path = ROOT / "graphs" / f"{name}.yaml"
    builder = ALGORITHMS[name]
    assert builder().spec() == load_graph_spec(path)
    assert [n.name for n in builder().build().nodes] == [n.name for n in load_graph(path).nodes]
    assert builder(kl_coef=0.5).spec() != load_graph_spec(path)


def test_validate_cli_exit_codes(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "validate", *map(str, sorted((ROOT / "graphs").glob("*.yaml")))],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert ok.returncode == 0, ok.stderr
    bad = write_variant(tmp_path, lambda r: node(r, "advantage").update(inputs=["values"]))
    broken = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "validate", str(bad)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert broken.returncode == 2
    assert broken.stderr.count("\n") == 1 and "Traceback" not in broken.stderr
    assert f"{bad}: nodes[3].inputs" in broken.stderr
    yaml_error = tmp_path / "bad.yaml"
    yaml_error.write_text("name: [unclosed\n")
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "validate", str(yaml_error)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert out.returncode == 2 and "invalid YAML" in out.stderr and out.stderr.count("\n") == 1


def test_validation_imports_no_heavy_packages():
    code = (
        "import sys; from hybridflow.graph.dag import load_graph; "
        f"load_graph({str(GRPO)!r}); "
        "heavy = [m for m in ('ray', 'vllm', 'megatron', 'torch', 'transformers') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    heavy = eval(out.stdout.strip())
    assert not {"ray", "vllm", "megatron"} & set(heavy), heavy


def test_old_log_prob_node_is_flagged_redundant_only_at_one_step_per_batch():
    """An old_log_prob node feeding grpo.yaml's update of one mini-batch and one epoch is
    redundant (so the file leaves it out). More optimizer steps, or another reader of
    old_log_probs (KL in the reward), make it needed."""
    assert list(with_old_log_prob(GRPO).redundant_nodes()) == ["old_log_prob"]
    assert with_old_log_prob(GRPO, ["nodes.update_actor.options.mini_batches=2"]).redundant_nodes() == {}
    assert with_old_log_prob(GRPO, ["nodes.update_actor.options.epochs=2"]).redundant_nodes() == {}
    assert load_graph(ROOT / "graphs" / "ppo.yaml").redundant_nodes() == {}
    kl_in_reward = ["nodes.advantage.inputs=[responses, scores, old_log_probs, ref_log_probs]",
                    "nodes.advantage.options.kl_coef=0.01"]
    assert with_old_log_prob(GRPO, kl_in_reward).redundant_nodes() == {}


@pytest.mark.parametrize("path", sorted((ROOT / "graphs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_shipped_graph_has_a_redundant_node(path):
    """Where the update's own first forward gives pi_old, the shipped graphs leave the
    old_log_prob node out (a forward per iteration saved, the same numbers)."""
    assert load_graph(path).redundant_nodes() == {}


def test_the_updates_first_forward_gives_the_old_log_probs():
    """What makes the node redundant: the train step's own first forward of a batch equals the
    no-grad forward an old_log_prob node runs (same engine, same weights)."""
    import torch

    from hybridflow.data import keys as K
    from hybridflow.engines.base import SamplingParams
    from hybridflow.engines.hf_rollout import HFRolloutEngine
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.data.tasks import get_task
    from hybridflow.data.datasets import collate_prompts
    from hybridflow.spec.engines import TorchTrainSpec
    from hybridflow.spec.graph import ModelSource

    tokenizer = get_task("copy").tokenizer()
    model = build_causal_lm(ModelSource(config={"hidden_size": 64, "num_hidden_layers": 2}), len(tokenizer),
                            tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    prompts = collate_prompts([{"prompt": p} for p in ("abc=", "hgfe=")], tokenizer, max_prompt_length=8)
    torch.manual_seed(0)
    batch = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id).generate(
        prompts, SamplingParams(n=4, max_new_tokens=6))
    engine = TorchTrainEngine(model, TorchTrainSpec(micro_batch_size=4, optim={"lr": 0.1}))
    old = engine.forward(batch)["log_probs"]
    seen = []

    def loss_fn(mb, out):
        seen.append(out["log_probs"].detach())
        return -(out["log_probs"] * mb[K.RESPONSE_MASK]).sum() / out["num_global_tokens"], {}

    engine.train_step(batch, loss_fn)
    assert torch.allclose(torch.cat(seen), old, atol=1e-6, rtol=0)


def test_generation_tp_runs_on_vllm_over_the_training_tp_group(tmp_path):
    """rollout.layout.tp > 1: vLLM only, pp = 1, and equal to the training tp (vLLM's external
    launcher groups consecutive ranks; the generation groups are strided otherwise)."""
    megatron = ROOT / "graphs" / "grpo_megatron.yaml"
    graph = load_graph(megatron, ["models.actor.rollout.engine=vllm", "models.actor.rollout.layout.tp=2"])
    generate = next(n for n in graph.nodes if n.name == "generate")
    assert graph.dispatch_layout(generate).tp == 2  # both ranks of the TP group get the same prompts
    pools = tmp_path / "four.yaml"
    pools.write_text("pools:\n  default: {nodes: 1, devices_per_node: 4, device: cpu}\n")
    with pytest.raises(SpecError, match=r"models.actor.rollout.layout.tp: generation tp 2 must equal the training tp 4"):
        load_graph(
            megatron,
            ["models.actor.rollout.engine=vllm", "models.actor.rollout.layout.tp=2", "models.actor.train.layout.tp=4"],
            pools_file=pools,
        )


def test_generation_tp_2_under_training_tp_2_pp_2_is_accepted():
    """graphs/grpo_megatron_tg2.yaml (t = 2 x p = 2 -> tg = 2, pg = 1 on four ranks): the
    generation TP groups are the training TP groups of each stage, consecutive ranks as vLLM's
    external launcher forms them, and the generate node's chunks follow them; the micro-DP
    groups span the two stages. Generation pp > 1 is still refused, naming the field."""
    from hybridflow.hybrid_engine.groups import generation_tp_groups, micro_dp_groups
    from hybridflow.spec.layout import GenerationLayout

    tg2 = ROOT / "graphs" / "grpo_megatron_tg2.yaml"
    graph = load_graph(tg2)
    train = graph.layouts["actor"]
    assert (train.tp, train.pp, train.dp) == (2, 2, 1)
    gen = GenerationLayout(train=train, tp=2, pp=1)
    assert generation_tp_groups(gen) == [[0, 1], [2, 3]]
    assert micro_dp_groups(gen) == [[0, 2], [1, 3]]
    dispatch = graph.dispatch_layout(next(n for n in graph.nodes if n.name == "generate"))
    # one prompt chunk per generation replica, shared by that replica's TP group
    assert [[r for r in range(4) if dispatch.coords(r).dp_rank == d] for d in range(dispatch.dp)] == [[0, 1], [2, 3]]
    with pytest.raises(SpecError, match=r"models.actor.rollout.layout.pp: generation pp 2 is not available"):
        load_graph(tg2, ["models.actor.rollout.layout.pp=2"])
    with pytest.raises(SpecError, match=r"models.actor.rollout.layout.tp: generation tp 2 must equal the training tp 4"):
        load_graph(tg2, ["models.actor.train.layout={tp: 4, pp: 1}"])
