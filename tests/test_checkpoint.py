"""Checkpoints and the NaN guard: what a checkpoint holds, that a non-finite weight never gets
into one, that a kill during a save leaves the previous one loadable, and the HF export."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint_harness import saved_state, saved_weights
from hybridflow.controller.checkpoint import complete_checkpoints, latest_checkpoint
from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"
SMALL = [
    "trainer.progress=false", "trainer.save_final=false", "data.prompts_per_iteration=4",
    "data.num_val=0", "models.actor.rollout.n=4", "trainer.val_interval=0",
]


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def inject(trainer, target: str, count: int = 1) -> None:
    import ray

    ray.get(trainer.groups["default"].call("inject_nonfinite", model="actor", target=target, count=count))


@pytest.mark.slow
def test_nan_guard_skips_counts_and_stops_after_k_in_a_row(ray_session, tmp_path):
    from fault_hooks import FaultyTrainer

    from hybridflow.controller.recovery import RunStopped

    overrides = [*SMALL, "trainer.iterations=8", "trainer.save_interval=1", "trainer.keep_last=10",
                 "trainer.nan_tolerance=2"]
    trainer = FaultyTrainer(load_graph(GRPO, overrides), run_dir=str(tmp_path / "run"))
    # A NaN loss in iteration 2 (alone: skipped, counted, run goes on), then in 4 and 5 (two in a
    # row = nan_tolerance: the run stops after 5).
    plan = {1: 1, 3: 2}
    trainer.callbacks.append(lambda t, it, m: inject(t, "loss", plan[it]) if it in plan else None)
    with pytest.raises(RunStopped, match=r"stopping at iteration 5: the update was skipped .* 2 "
                       r"iterations in a row \(trainer.nan_tolerance=2\)"):
        trainer.fit()

    rows = metric_rows(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["actor/skipped_step"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert [r["guard/skipped_updates"] for r in rows] == [0.0, 1.0, 1.0, 2.0, 3.0]
    assert not torch.isfinite(torch.tensor(rows[1]["actor/loss"]))
    # A skipped update leaves the weights as they were; a normal one changes them.
    ckpt = {p.name: p for p in complete_checkpoints(tmp_path / "run")}
    assert sorted(ckpt) == [f"iter_0000000{i}" for i in (1, 2, 3, 4)]  # none after the stop
    w1, w2, w3 = (saved_weights(ckpt[f"iter_0000000{i}"]) for i in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)


@pytest.mark.slow
def test_nonfinite_weight_is_never_checkpointed(ray_session, tmp_path):
    from fault_hooks import FaultyTrainer

    from hybridflow.controller.recovery import RunStopped

    overrides = [*SMALL, "trainer.iterations=4", "trainer.save_interval=1"]
    trainer = FaultyTrainer(load_graph(GRPO, overrides), run_dir=str(tmp_path / "run"))
    trainer.callbacks.append(lambda t, it, m: inject(t, "weight") if it == 2 else None)
    with pytest.raises(RunStopped, match=r"stopping at iteration 2: .*weight .* is not finite; not "
                       r"checkpointing it; last checkpoint: .*iter_00000001"):
        trainer.fit()
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["iter_00000001"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    assert all(torch.isfinite(w).all() for w in saved_weights(latest_checkpoint(tmp_path / "run")).values())


@pytest.mark.slow
def test_kill_during_checkpoint_save_leaves_previous_loadable(ray_session, tmp_path, monkeypatch, caplog):
    """SIGKILL the whole `hybridflow run` (controller, Ray, workers) while a checkpoint is being
    written: the newest complete checkpoint loads, and `--resume` finishes the run from it (in
    this process, on the session's Ray: a second Ray start would only cost time)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "run", str(GRPO), *SMALL,
           "trainer.iterations=40", "trainer.save_interval=1", "trainer.keep_last=3",
           "trainer.sample_interval=1", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    root = run_dir / "checkpoints"
    caught = None
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            temps = list(root.glob(".tmp-*")) if root.is_dir() else []
            # Only once two complete checkpoints exist: the point is that they survive.
            if temps and len(complete_checkpoints(run_dir)) >= 2 and any(temps[0].glob("pool_default/rank_*")):
                # Freeze everything first, then check the save is still half-written: on a busy
                # box it can finish between the glob and the kill. If it did, thaw and wait for
                # the next save (save_interval=1).
                os.killpg(proc.pid, signal.SIGSTOP)
                if temps[0].exists() and not (temps[0] / "meta.json").exists():
                    os.killpg(proc.pid, signal.SIGKILL)
                    caught = temps[0]
                    break
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert caught is not None, f"never saw a save in progress: {proc.stderr.read()[-2000:]!r}"
    assert caught.exists(), "the kill was meant to leave the half-written checkpoint behind"
    assert not (caught / "meta.json").exists()

    previous = latest_checkpoint(run_dir)
    assert previous is not None
    meta = json.loads((previous / "meta.json").read_text())
    controller = torch.load(previous / "controller.pt", weights_only=False)
    assert controller["iteration"] == meta["iteration"] == int(previous.name.split("_")[1])
    assert [p.name for p in (previous / "models").iterdir()] == ["actor"]  # trained models only
    state = saved_state(previous)
    assert set(state) == {"model", "optim", "schedule"}
    assert any(key.endswith(".exp_avg") for key in state["optim"])
    for rank in (0, 1):
        assert "torch_rng" in torch.load(previous / "pool_default" / f"rank_{rank:05d}.pt", weights_only=False)

    # The newest complete checkpoint damaged as well (a truncated file): the resume falls back
    # to the one before it, with a warning naming the one it skipped.
    done = meta["iteration"]
    older = complete_checkpoints(run_dir)[:-1]
    damaged = previous / "controller.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    from hybridflow.cli.main import main

    monkeypatch.chdir(ROOT)
    with caplog.at_level(logging.WARNING):
        code = main([*cmd[3:-2], "trainer.iterations=" + str(done + 1), "--run-dir", str(run_dir), "--resume"])
    assert code == 0, caplog.text[-3000:]
    assert f"skipping damaged checkpoint {previous}: controller.pt has" in caplog.text
    assert f"from {older[-1]} (iteration {done - 1})" in caplog.text, caplog.text[-3000:]
    assert [r["iteration"] for r in metric_rows(run_dir)] == list(range(1, done + 2))
    # samples.jsonl was cut back with metrics.jsonl: every iteration's samples once
    samples = [json.loads(line)["iteration"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    per_iteration = samples.count(1)
    assert per_iteration and samples == [i for i in range(1, done + 2) for _ in range(per_iteration)]
    assert not list(root.glob(".tmp-*"))  # the next save swept it


def test_exported_actor_reloads_with_logits_equal_to_the_train_engine(tmp_path):
    """save_hf after a real optimizer step; from_pretrained's logits match within 1e-5."""
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from hybridflow.data import keys as K
    from hybridflow.data.tasks import get_task
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.spec.engines import TorchTrainSpec
    from hybridflow.spec.graph import ModelSource

    tokenizer = get_task("copy").tokenizer()
    module = build_causal_lm(ModelSource(config={"hidden_size": 64}), len(tokenizer),
                             tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    engine = TorchTrainEngine(module, TorchTrainSpec())
    gen = torch.Generator().manual_seed(0)
    num, prompt_len, resp_len = 4, 5, 6
    ids = torch.randint(3, len(tokenizer), (num, prompt_len + resp_len), generator=gen)
    batch = TensorDict({
        K.INPUT_IDS: ids, K.ATTENTION_MASK: torch.ones_like(ids),
        K.POSITION_IDS: torch.arange(prompt_len + resp_len).expand(num, -1),
        K.RESPONSES: ids[:, prompt_len:], K.RESPONSE_MASK: torch.ones(num, resp_len, dtype=torch.int64),
    }, batch_size=[num])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    metrics = engine.train_step(batch, lambda mb, out: (-(out["log_probs"].sum()) / out["num_global_tokens"], {}))
    assert metrics["skipped_step"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in module.state_dict().items())

    engine.save_hf(str(tmp_path / "actor"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "actor").eval()
    module.eval()
    with torch.no_grad():
        expected = module(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    assert (expected - got).abs().max().item() <= 1e-5
    log_probs = engine.forward(batch)["log_probs"]
    from_hf = torch.log_softmax(got[:, prompt_len - 1 : -1].float(), -1).gather(-1, ids[:, prompt_len:, None])[..., 0]
    assert (log_probs - from_hf).abs().max().item() <= 1e-5


def test_damaged_checkpoints_are_skipped_newest_first(tmp_path, caplog):
    """Sizes and CRC-32s in meta.json: a truncated, a flipped or a missing file makes a
    checkpoint damaged; the newest intact one is what a resume or a recovery loads."""
    import logging

    from hybridflow.controller.checkpoint import META, checkpoint_dir, file_digests, latest_intact_checkpoint

    def fake(iteration: int) -> Path:
        path = checkpoint_dir(tmp_path, iteration)
        (path / "models" / "actor").mkdir(parents=True)
        (path / "controller.pt").write_bytes(bytes(range(200)))
        (path / "models" / "actor" / "data.distcp").write_bytes(b"w" * 1000)
        (path / META).write_text(json.dumps({"iteration": iteration, "files": file_digests(path)}))
        return path

    first, second, third, fourth = (fake(i) for i in (1, 2, 3, 4))
    assert latest_intact_checkpoint(tmp_path) == fourth
    (fourth / "models" / "actor" / "data.distcp").write_bytes(b"w" * 999 + b"x")  # same size
    (third / "controller.pt").write_bytes(bytes(range(100)))  # truncated
    (second / "models" / "actor" / "data.distcp").unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_intact_checkpoint(tmp_path) == first
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hybridflow")] == [
        f"skipping damaged checkpoint {fourth}: models/actor/data.distcp does not match its checksum",
        f"skipping damaged checkpoint {third}: controller.pt has 100 bytes, 200 were written",
        f"skipping damaged checkpoint {second}: models/actor/data.distcp is missing",
    ]
    (first / META).write_text("{not json")
    assert latest_intact_checkpoint(tmp_path) is None


def test_storage_errors_are_found_wherever_they_are_wrapped():
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from hybridflow.controller.recovery import storage_error

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/r/checkpoints/.tmp-iter_00000002/x")
    assert storage_error(full).startswith("/runs/r/checkpoints/.tmp-iter_00000002/x: No space left on device (ENOSPC);")
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as chained:
        assert "(ENOSPC)" in storage_error(chained)
    ranks = CheckpointException("dcp", {0: (OSError(errno.EROFS, "Read-only file system", "/ro"), None)})
    assert storage_error(ranks).startswith("/ro: Read-only file system (EROFS)")
    assert "is the disk full?" in storage_error(RuntimeError("basic_ios::clear: iostream error"))
    assert storage_error(OSError(errno.ENOENT, "No such file or directory", "/x")) is None
    assert storage_error(ValueError("a bug")) is None


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(
    ray_session, tmp_path, monkeypatch, capsys
):
    """The controller's write of the second checkpoint fails with ENOSPC (simulated): exit 1,
    one line naming the file and the cause, the first checkpoint complete and intact."""
    import errno

    import hybridflow.controller.checkpoint as checkpoint
    from hybridflow.cli.main import main
    from hybridflow.controller.checkpoint import latest_intact_checkpoint

    real_save, calls = torch.save, []

    def save(obj, path, *args, **kwargs):
        if str(path).endswith("controller.pt"):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    run_dir = tmp_path / "run"
    code = main(["run", str(GRPO), *SMALL, "trainer.iterations=3", "trainer.save_interval=1", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith(f"stopped: {calls[1]}: No space left on device (ENOSPC);"), err[-3:]
    assert latest_intact_checkpoint(run_dir).name == "iter_00000001"
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_the_stop_message_says_died_again_only_after_a_recovery(tmp_path):
    from hybridflow.controller.recovery import Recovery, RunStopped

    with pytest.raises(RunStopped) as first:
        Recovery(tmp_path / "events.jsonl", max_restarts=0).begin(RuntimeError("actor gone"), None)
    assert str(first.value) == "a worker died (actor gone); trainer.max_restarts=0, so the run does not recover"
    recovery = Recovery(tmp_path / "events.jsonl", max_restarts=1)
    recovery.begin(RuntimeError("actor gone"), None)
    with pytest.raises(RunStopped, match=r"^a worker died again \(actor gone\); trainer.max_restarts=1 recoveries used up$"):
        recovery.begin(RuntimeError("actor gone"), None)


def test_truncate_metrics_keeps_whole_rows_and_never_grows_the_file(tmp_path, caplog):
    """The checkpoint's offset past a file cut by hand, a half-written last row and a broken
    row in the middle: only whole rows stay, and no NUL byte is ever written."""
    from hybridflow.controller.checkpoint import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"iteration": i, "reward/mean": i / 10} for i in range(1, 7)]
    whole = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    offset = len(whole)
    path.write_bytes(whole[: offset - 12])  # the last row cut in half, the offset beyond the end
    with caplog.at_level(logging.WARNING):
        assert truncate_metrics(path, offset) == rows[:5]
    assert path.read_bytes() == whole[: whole.rfind(b"{")]
    assert "dropped 1 cut or unreadable line" in caplog.text

    path.write_bytes(whole + b'{"iteration": 7, "rew')  # a row cut after the checkpoint
    assert truncate_metrics(path, offset) == rows and path.read_bytes() == whole

    lines = whole.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) + b'{"iteration": 3\n' + b"".join(lines[3:]))
    assert truncate_metrics(path, path.stat().st_size) == rows[:2] + rows[3:]
    assert b"\0" not in path.read_bytes() and [json.loads(x) for x in path.read_text().splitlines()] == rows[:2] + rows[3:]
