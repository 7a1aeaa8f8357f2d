"""Training a scalar model is a graph: ``pair_update`` on a reward or cost model reading
preference pairs (graphs/reward_model.yaml, graphs/cost_model.yaml), the graph checks around
it, LoRA on a value head, and ``hybridflow eval`` on such a graph."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    """Copy-task pairs written by the shipped command: reward and cost, train and held-out."""
    from hybridflow.data.preference_pairs import main as write_pairs

    tmp = tmp_path_factory.mktemp("pairs")
    write_pairs(["--out", str(tmp / "train.jsonl"), "--val-out", str(tmp / "val.jsonl"),
                 "--num-train", "200", "--num-val", "40"])
    write_pairs(["--kind", "cost", "--out", str(tmp / "ctrain.jsonl"), "--val-out", str(tmp / "cval.jsonl"),
                 "--num-train", "200", "--num-val", "40"])
    return tmp


def _pair_overrides(files: Path, cost: bool = False) -> list[str]:
    prefix = "c" if cost else ""
    return [f"data.train_files={files / (prefix + 'train.jsonl')}", f"data.val_files={files / (prefix + 'val.jsonl')}"]


@pytest.mark.parametrize("graph", ["graphs/reward_model.yaml", "graphs/cost_model.yaml",
                                   "graphs/grpo_learned_reward.yaml", "graphs/safe_rlhf_learned.yaml"])
def test_learned_reward_graphs_validate(graph, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["validate", graph]) == 0


def test_a_graph_without_actor_or_pairs_is_refused(tmp_path, capsys):
    graph = tmp_path / "g.yaml"
    graph.write_text(
        "name: g\nmodels:\n  reward: {role: reward, source: {config: {hidden_size: 16}}}\n"
        "nodes:\n  - {name: v, op: score, model: reward}\n"
    )
    assert main(["validate", str(graph)]) == 2
    assert "models: a graph needs one model with role actor" in capsys.readouterr().err


def test_pairs_and_prompts_in_one_graph_are_refused(tmp_path, monkeypatch, capsys):
    import yaml

    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / "graphs" / "grpo.yaml").read_text())
    raw["models"]["rm"] = {"role": "reward", "source": {"config": {"hidden_size": 16}}}
    raw["placement"]["rm"] = "default"
    raw["nodes"].append({"name": "rm", "op": "pair_update", "model": "rm", "inputs": ["pairs"]})
    graph = tmp_path / "mixed.yaml"
    graph.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(graph)]) == 2
    assert "read prompts and ['rm'] preference pairs" in capsys.readouterr().err


def test_a_bad_train_row_is_the_first_error_exit_2(pair_files, tmp_path, monkeypatch, capsys):
    """The train file is read and checked before any worker starts, and before the val file."""
    monkeypatch.chdir(ROOT)
    bad = tmp_path / "BAD.jsonl"
    bad.write_text(json.dumps({"prompt": "ab=", "chosen": "ab", "rejected": "ab"}) + "\n")
    run_dir = tmp_path / "run"
    code = main(["run", "graphs/reward_model.yaml", f"data.train_files={bad}", "data.val_files=missing.jsonl",
                 "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"error: graphs/reward_model.yaml: data.train_files: {bad}:1: rejected: the same as chosen; "
                   "expected two different responses\n")
    assert not run_dir.exists()


def test_cost_graph_refuses_reward_rows(pair_files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = main(["run", "graphs/cost_model.yaml", *_pair_overrides(pair_files), "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "1: safer_response_id: missing; cost pairs need PKU-SafeRLHF rows" in capsys.readouterr().err


def test_lora_on_a_value_head_trains_the_head_and_saves_a_plain_model(tmp_path):
    from transformers import AutoModelForTokenClassification

    from hybridflow.data.tasks import get_task
    from hybridflow.engines.lora import add_lora
    from hybridflow.engines.models import build_value_model
    from hybridflow.engines.scalar_model import save_scalar_model
    from hybridflow.spec.graph import LoraSpec, ModelSource

    tokenizer = get_task("copy").tokenizer()
    model = build_value_model(ModelSource(config={"hidden_size": 32, "num_hidden_layers": 1}), len(tokenizer),
                              tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    peft = add_lora(model, LoraSpec(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable), "the new head must train"
    assert any("lora_A" in n for n in trainable)
    assert not any("lora" in n and "score" in n for n in trainable), "no adapter on the head itself"
    ids = torch.tensor([[3, 4, 5, 6]])
    model(input_ids=ids).logits[0, -1, 0].backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    with torch.no_grad():
        expected = peft(input_ids=ids).logits[0, -1, 0]
    save_scalar_model(peft, tmp_path / "rm", tokenizer)
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits[0, -1, 0], expected, atol=1e-5)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_tiny_learned_reward_commands_in_order(ray_session, tmp_path, monkeypatch, capsys):
    """docs/learned-rewards.md's tiny commands in its order, with its run directories, on one Ray: pairs,
    the reward model (100 steps: it learns, is saved as a plain HF scalar model and `eval` reads
    it back), GRPO against it, cost pairs, the cost model and its eval, Safe-RLHF against both.
    The page's own run (tests/test_docs.py) leaves these to this test: each of its commands
    would start a Ray of its own."""
    from hybridflow.data.preference_pairs import main as write_pairs

    for name in ("graphs", "resource_pools"):  # the page's paths resolve here
        (tmp_path / name).symlink_to(ROOT / name)
    # The session's Ray workers run in the repository root, not here: the graphs' relative
    # runs/rm and runs/cm are found because the controller sends its workers absolute sources.
    monkeypatch.chdir(tmp_path)
    small = ["trainer.iterations=2", "data.prompts_per_iteration=4", "models.actor.rollout.n=4", "data.num_val=4"]

    write_pairs(["--task", "copy", "--num-train", "200", "--num-val", "40",
                 "--out", "runs/pairs/copy_train.jsonl", "--val-out", "runs/pairs/copy_val.jsonl"])
    assert main(["run", "graphs/reward_model.yaml", "--run-dir", "runs/rm", "trainer.iterations=100",
                 "trainer.val_interval=50", "data.num_val=160"]) == 0  # every held-out pair: 40 prompts x 4
    rows = _metrics(tmp_path / "runs/rm")
    assert all("rm/accuracy" in r and "rm/margin_mean" in r and "rm/chosen_mean" in r and "rm/rejected_mean" in r
               for r in rows)
    vals = [r["val/rm/accuracy"] for r in rows if "val/rm/accuracy" in r]
    assert len(vals) == 2
    # the run summary speaks of pairwise accuracy, not of a reward the graph has none of
    printed = capsys.readouterr().out
    assert "reward_last10" not in printed

    def shown(key: str) -> float:  # a value of the printed run summary (4 decimals)
        found = re.search(rf"^  {key} +([\d.]+)$", printed, re.M)
        assert found, (key, printed[-2000:])
        return float(found.group(1))

    assert shown("val_rm_accuracy_final") == pytest.approx(vals[-1], abs=1e-4)
    assert shown("rm_accuracy_last10") == pytest.approx(sum(r["rm/accuracy"] for r in rows[-10:]) / 10, abs=1e-4)
    # 100 steps of 32 pairs: well above chance on the held-out pairs (3600 steps reach 0.98)
    assert vals[-1] >= 0.7, vals
    saved = tmp_path / "runs/rm/reward"
    assert (saved / "config.json").is_file() and (saved / "tokenizer_config.json").is_file()

    assert main(["eval", "graphs/reward_model.yaml", "--actor", "runs/rm", "data.num_val=160",
                 "--json", "rm_eval.json"]) == 0
    assert "pairwise_accuracy" in capsys.readouterr().out
    summary = json.loads((tmp_path / "rm_eval.json").read_text())["summary"]
    assert summary["pairs"] == 160
    # the same model, pairs and score reading as the run's last validation
    assert summary["pairwise_accuracy"] == pytest.approx(vals[-1])

    assert main(["run", "graphs/grpo_learned_reward.yaml", "--run-dir", "runs/grpo-rm", *small]) == 0
    for row in _metrics(tmp_path / "runs/grpo-rm"):  # scored by runs/rm/reward; the rule logged beside it
        assert "reward/raw_mean" in row and 0.0 <= row["rule/reward_mean"] <= 1.0

    write_pairs(["--task", "copy", "--kind", "cost", "--num-train", "200", "--num-val", "40",
                 "--out", "runs/pairs/cost_train.jsonl", "--val-out", "runs/pairs/cost_val.jsonl"])
    assert main(["run", "graphs/cost_model.yaml", "--run-dir", "runs/cm", "trainer.iterations=2",
                 "trainer.val_interval=2", "data.num_val=8"]) == 0
    assert all("rm/accuracy" in r for r in _metrics(tmp_path / "runs/cm"))
    assert (tmp_path / "runs/cm/cost/config.json").is_file()
    assert main(["eval", "graphs/cost_model.yaml", "--actor", "runs/cm", "data.num_val=8"]) == 0
    assert "pairwise_accuracy" in capsys.readouterr().out

    assert main(["run", "graphs/safe_rlhf_learned.yaml", "--run-dir", "runs/safe-learned", *small]) == 0
    for row in _metrics(tmp_path / "runs/safe-learned"):
        assert "safety/lambda" in row and 0.0 <= row["rule/cost_mean"] <= 1.0 and "rule/reward_mean" in row


def test_eval_pairs_out_writes_ranked_pairs_a_pair_graph_reads(tmp_path, monkeypatch, capsys):
    """Pairs from the base actor's own samples, ranked by grpo.yaml's rule: each chosen scored
    above its rejected, and the file loads as the train files of graphs/reward_model.yaml."""
    from hybridflow.data.preferences import read_pairs
    from hybridflow.data.tasks import copy_reward

    monkeypatch.chdir(ROOT)
    out = tmp_path / "pairs.jsonl"
    assert main(["eval", "graphs/grpo.yaml", "--limit", "6", "--k", "8", "--pairs-out", str(out)]) == 0
    assert "pairs_written" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows, "an untrained actor's 8 samples differ in score for some prompt"
    for row in rows:
        assert set(row) == {"prompt", "chosen", "rejected"}
        truth = row["prompt"].rstrip("=")
        assert copy_reward(row["prompt"], row["chosen"], truth) > copy_reward(row["prompt"], row["rejected"], truth)
    assert len(read_pairs(str(out))) == len(rows)


def _rollout(tok, responses):
    """A rollout batch of the prompt ``ab=`` and these raw response tokens."""
    from tensordict import TensorDict

    from hybridflow.data import keys as K
    from hybridflow.data.batch import build_rollout_fields

    prompts = torch.tensor([tok("ab=", add_special_tokens=False)["input_ids"]] * len(responses))
    fields = build_rollout_fields(prompts, torch.ones_like(prompts), torch.tensor(responses), tok.eos_token_id,
                                  tok.pad_token_id)
    return TensorDict({K.PROMPT_IDS: prompts, K.PROMPT_MASK: torch.ones_like(prompts), **fields},
                      batch_size=[len(responses)])


def test_score_node_normalizes_a_learned_score_and_logs_only_without_outputs(monkeypatch):
    from types import SimpleNamespace as NS

    from hybridflow.algos.running_moments import RunningMoments
    from hybridflow.data.tasks import get_task
    from hybridflow.spec.graph import ScoreOptions
    from hybridflow.workers.ops.score import score

    tok = get_task("copy").tokenizer()
    raw = torch.tensor([1.0, 3.0, 5.0, 7.0])
    batch = _rollout(tok, [[3, tok.eos_token_id]] * 4)
    engine = NS(forward=lambda b: {"last_values": raw.clone()}, dp_group=None)
    spec = NS(models={"rm": NS(role="reward", source=NS(remote=None))}, data=NS(max_response_length=8))
    moments = RunningMoments()
    ctx = NS(spec=spec, rules={}, train_engines={"rm": engine}, tokenizer=tok, dp_group=lambda m: None,
             extra_state={"score_moments/reward": moments})

    def node(name, outputs, **opts):
        return NS(name=name, model="rm", outputs=outputs, spec=NS(options=ScoreOptions(**opts)))

    import hybridflow.workers.ops.score as score_module

    monkeypatch.setattr(score_module, "logged_samples", lambda *a, **k: [])  # sample rows: another test's
    out, meta = score(ctx, batch, node("reward", ("scores",), normalize=True))
    expected = (raw - raw.mean()) / raw.std()
    assert torch.allclose(out["scores"], expected)
    assert meta["metrics"]["reward/raw_mean"] == pytest.approx(4.0)
    out, meta = score(ctx, batch, node("rule", (), log_prefix="rule"))
    assert list(out.keys()) == []
    assert meta["metrics"]["rule/reward_mean"] == pytest.approx(4.0)


def test_score_node_squashes_a_learned_cost_to_a_probability_of_unsafe(monkeypatch):
    from types import SimpleNamespace as NS

    from hybridflow.data.tasks import get_task
    from hybridflow.spec.graph import ScoreOptions
    from hybridflow.workers.ops.score import score

    import hybridflow.workers.ops.score as score_module

    tok = get_task("copy").tokenizer()
    raw = torch.tensor([-3.0, 0.0, 2.0, -1.0])
    # the last response never ends: a cost model's ending rule (auto = keep) leaves it alone
    batch = _rollout(tok, [[3, tok.eos_token_id]] * 3 + [[3, 4]])
    engine = NS(forward=lambda b: {"last_values": raw.clone()})
    spec = NS(models={"cm": NS(role="cost", source=NS(remote=None))}, data=NS(max_response_length=8))
    ctx = NS(spec=spec, rules={}, train_engines={"cm": engine}, tokenizer=tok, dp_group=lambda m: None,
             extra_state={})
    node = NS(name="cost", model="cm", outputs=("costs",), spec=NS(options=ScoreOptions(squash="sigmoid")))
    monkeypatch.setattr(score_module, "logged_samples", lambda *a, **k: [])
    out, meta = score(ctx, batch, node)
    assert torch.allclose(out["costs"], 1 / (1 + torch.exp(-raw)))
    assert meta["metrics"]["cost/raw_mean"] == pytest.approx(-0.5)
    assert meta["metrics"]["cost/mean"] == pytest.approx(float(torch.sigmoid(raw).mean()))


@pytest.mark.parametrize("option, message", [
    ("squash=tanh", "nodes[4].options.squash: Input should be 'sigmoid' (got 'tanh')"),
    ("normalize=true", "nodes[4].options: normalize and squash exclude each other"),
])
def test_a_bad_squash_is_one_line(option, message, tmp_path, monkeypatch, capsys):
    import yaml

    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / "graphs" / "safe_rlhf_learned.yaml").read_text())
    cost = next(n for n in raw["nodes"] if n["name"] == "cost")
    key, value = option.split("=")
    cost["options"][key] = yaml.safe_load(value)
    graph = tmp_path / "bad_squash.yaml"
    graph.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(graph)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_an_odd_micro_batch_of_a_pair_model_is_refused(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["validate", "graphs/reward_model.yaml", "models.reward.train.micro_batch_size=3"]) == 2
    assert "models.reward.train.micro_batch_size: node 'train_reward' trains on pairs" in capsys.readouterr().err


def test_eval_of_a_learned_reward_graph_grades_with_the_rule_it_logs(tmp_path, monkeypatch, capsys):
    """grpo_learned_reward.yaml's first score node is the learned model: eval grades with the
    copy rule scored beside it instead, and needs no trained reward model to exist."""
    from hybridflow.data.tasks import copy_reward

    monkeypatch.chdir(tmp_path)  # no runs/rm here: the reward model's run is not read
    out = tmp_path / "eval.json"
    assert main(["eval", str(ROOT / "graphs" / "grpo_learned_reward.yaml"), "--limit", "4", "--k", "2",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["summary"]["prompts"] == 4
    for row in results["prompts"]:
        assert row["greedy_score"] == pytest.approx(copy_reward("", row["greedy"], row["ground_truth"]))


def test_graph_command_counts_a_pair_graphs_batch_in_pairs(tmp_path, monkeypatch, capsys):
    import yaml

    monkeypatch.chdir(ROOT)
    assert main(["graph", "graphs/reward_model.yaml"]) == 0
    out = capsys.readouterr().out
    assert "batch: 32 pairs/iteration (data.prompts_per_iteration)" in out and "samples/prompt" not in out
    # a node that leaves its inputs to its op's defaults reads pairs too
    raw = yaml.safe_load((ROOT / "graphs" / "reward_model.yaml").read_text())
    del raw["nodes"][0]["inputs"]
    raw["resources"] = str(ROOT / raw["resources"])
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(raw))
    assert main(["graph", str(tmp_path / "g.yaml")]) == 0
    assert "batch: 32 pairs/iteration" in capsys.readouterr().out
