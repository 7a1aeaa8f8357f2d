"""Issue 20's foundation: rollout correction in the actor update, weight versions on every
sample, and the ``trainer.async`` spec.

Fast tests: the options and their one-line errors, the loss with IS weights, the staleness
statistic. Slow tests: short GRPO runs on real Ray, gloo and a transformers model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.graph.dag import load_graph
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"  # no old_log_prob node: one optimizer step per batch
# grpo.yaml with an old_log_prob node, a token TIS correction and one_step_off
ASYNC = ROOT / "graphs" / "grpo_async.yaml"
CORR = "nodes.update_actor.options.rollout_correction"
SHORT = [
    "trainer.val_interval=0", "trainer.progress=false", "trainer.save_final=false",
    "trainer.save_interval=0", "trainer.sample_interval=0",
]


# -- spec ------------------------------------------------------------------------------------


def test_correction_options_load_with_defaults():
    opts = load_graph(ASYNC, [f"{CORR}={{reject_level: token}}"]).node("update_actor").spec.options
    corr = opts.rollout_correction
    assert (corr.is_level, corr.is_cap, corr.reject_level, corr.reject_low, corr.reject_high) == ("token", 2.0, "token", 0.5, 2.0)
    assert opts.old_log_probs == "recomputed"
    assert load_graph(GRPO).node("update_actor").spec.options.rollout_correction is None


@pytest.mark.parametrize(
    "graph, overrides, field",
    [
        (ASYNC, [f"{CORR}.is_level=tok"], "nodes[5].options.rollout_correction.is_level"),
        (ASYNC, [f"{CORR}.reject_low=3"], "nodes[5].options.rollout_correction"),
        (ASYNC, ["nodes.update_actor.options.old_log_probs=rollout"], "nodes[5].options"),
        # pi_old must reach the update: no old_log_probs input, no correction
        (ASYNC, ["nodes.update_actor.inputs=[responses,ref_log_probs,advantages]"],
         "nodes[5].options.rollout_correction"),
        (GRPO, [f"{CORR}.is_cap=2"], "nodes[4].options.rollout_correction"),  # it has no old_log_prob node
    ],
)
def test_bad_correction_options_are_one_line(graph, overrides, field):
    with pytest.raises(SpecError) as info:
        load_graph(graph, overrides)
    message = str(info.value)
    assert "\n" not in message and f"{graph.name}: {field}:" in message


def test_old_log_probs_from_rollout_makes_the_recompute_redundant():
    rollout = [f"{CORR}=null", "nodes.update_actor.options.old_log_probs=rollout", "nodes.update_actor.options.mini_batches=2"]
    assert "old_log_prob" in load_graph(ASYNC, rollout).redundant_nodes()
    corrected = load_graph(ASYNC, ["nodes.update_actor.options.mini_batches=1"])
    assert "old_log_prob" not in corrected.redundant_nodes()  # the correction reads it up front


def test_rollout_records_every_log_prob_only_for_an_update_that_reads_them():
    """The vLLM rollout records a sample of log-probs for the consistency check
    (rollout.log_prob_check_samples), and every sample's when an update reads them."""
    assert load_graph(ASYNC).reads_rollout_log_probs("actor")  # rollout_correction
    rollout = [f"{CORR}=null", "nodes.update_actor.options.old_log_probs=rollout"]
    assert load_graph(ASYNC, rollout).reads_rollout_log_probs("actor")
    assert not load_graph(ASYNC, [f"{CORR}=null"]).reads_rollout_log_probs("actor")
    assert not load_graph(GRPO).reads_rollout_log_probs("actor")


def test_a_tolerance_without_checked_samples_is_one_line():
    """log_prob_tolerance with vLLM recording no log-probs would never check: refused."""
    vllm = ["models.actor.rollout.engine=vllm", "models.actor.rollout.log_prob_tolerance=0.001"]
    with pytest.raises(SpecError) as info:
        load_graph(GRPO, [*vllm, "models.actor.rollout.log_prob_check_samples=0"])
    message = str(info.value)
    assert "\n" not in message and "grpo.yaml: models.actor.rollout:" in message, message
    assert "log_prob_check_samples 0" in message
    load_graph(GRPO, [*vllm, "models.actor.rollout.log_prob_check_samples=null"])
    load_graph(GRPO, ["models.actor.rollout.log_prob_tolerance=0.001", "models.actor.rollout.log_prob_check_samples=0"])


# -- the loss --------------------------------------------------------------------------------


def _micro_batch(weights: torch.Tensor | None = None) -> tuple[TensorDict, dict]:
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    fields = {
        K.RESPONSE_MASK: torch.tensor([[1, 1], [1, 0]]),
        K.OLD_LOG_PROBS: log_probs.detach().clone(),
        K.ROLLOUT_LOG_PROBS: torch.tensor([[-1.5, -2.0], [-0.5, -9.0]]),
        K.ADVANTAGES: torch.tensor([[1.0, 1.0], [-2.0, -2.0]]),
    }
    if weights is not None:
        fields[K.ROLLOUT_IS_WEIGHTS] = weights
    out = {"log_probs": log_probs, "entropy": torch.zeros(2, 2),
           "num_global_tokens": torch.tensor(3.0), "num_global_seqs": torch.tensor(2.0)}
    return TensorDict(fields, batch_size=[2]), out


def test_consistency_check_reads_only_the_recorded_rows():
    """A row whose rollout log-probs were not recorded (zeros, ``rollout_log_probs_recorded``
    False) stays out of the rollout/training difference; the loss is unchanged."""
    from hybridflow.hybrid_engine.consistency import ConsistencyStats
    from hybridflow.spec.graph import UpdateOptions
    from hybridflow.algos.actor_loss import policy_loss_fn

    every, only_first = ConsistencyStats(), ConsistencyStats()
    mb, out = _micro_batch()
    loss_every, _ = policy_loss_fn(UpdateOptions(), every)(mb, out)
    mb[K.ROLLOUT_LOG_PROBS_RECORDED] = torch.tensor([True, False])
    mb[K.ROLLOUT_LOG_PROBS][1] = 0.0
    loss_first, _ = policy_loss_fn(UpdateOptions(), only_first)(mb, out)
    assert float(loss_first) == float(loss_every)
    assert every.reduce()["rollout_log_prob_diff_mean"] == pytest.approx(0.5 / 3)
    first = only_first.reduce()
    assert first["rollout_log_prob_diff_mean"] == pytest.approx(0.5 / 2)
    assert first["rollout_log_prob_diff_max"] == pytest.approx(0.5)


def test_is_weights_scale_the_policy_loss_per_token():
    from hybridflow.spec.graph import UpdateOptions
    from hybridflow.algos.actor_loss import policy_loss_fn

    loss_fn = policy_loss_fn(UpdateOptions())
    # ratio 1 everywhere (old = current): the ppo_clip loss of a token is -A.
    plain, _ = loss_fn(*_micro_batch())
    assert float(plain.detach()) == pytest.approx((-1 - 1 + 2) / 3)
    weighted, metrics = loss_fn(*_micro_batch(torch.tensor([[2.0, 0.5], [0.25, 0.0]])))
    assert float(weighted.detach()) == pytest.approx((-2 * 1 - 0.5 * 1 + 0.25 * 2) / 3)
    assert metrics["pg_loss"] == pytest.approx((-2 - 0.5 + 0.5) / 3)


def test_the_update_reports_the_entropy_when_no_log_prob_node_does():
    """A log_prob node on the actor reports actor/entropy; without one (no old_log_probs in the
    batch) the update reports its own forward's, over the valid tokens."""
    from hybridflow.spec.graph import UpdateOptions
    from hybridflow.algos.actor_loss import policy_loss_fn

    loss_fn = policy_loss_fn(UpdateOptions())
    mb, out = _micro_batch()
    out["entropy"] = torch.tensor([[1.0, 2.0], [3.0, 9.0]])  # 9: a padding token
    _, metrics = loss_fn(mb, out)
    assert "entropy" not in metrics
    _, metrics = loss_fn(mb.exclude(K.OLD_LOG_PROBS), out)
    assert metrics["entropy"] == pytest.approx((1.0 + 2.0 + 3.0) / 3)


def test_old_log_probs_rollout_puts_the_rollout_in_the_ratio():
    from hybridflow.spec.graph import UpdateOptions
    from hybridflow.algos.actor_loss import policy_loss_fn

    loss_fn = policy_loss_fn(UpdateOptions(old_log_probs="rollout", clip_ratio=10.0))
    _, metrics = loss_fn(*_micro_batch())
    # ratios pi / pi_rollout on the valid tokens: e^0.5, 1, 1 (the masked -9 is not counted)
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.5) + 2) / 3)


def test_apply_rollout_correction_writes_weights_and_narrows_the_mask():
    from hybridflow.spec.graph import UpdateOptions
    from hybridflow.workers.algo_steps import apply_rollout_correction

    batch, _ = _micro_batch()
    opts = UpdateOptions(rollout_correction={"is_level": "token", "is_cap": 2.0, "reject_level": "token",
                                             "reject_low": 0.5, "reject_high": 1.5})
    metrics = apply_rollout_correction(batch, opts)
    # ratios pi_old / pi_rollout: e^0.5 = 1.65 (rejected, > 1.5), 1, 1
    assert batch[K.RESPONSE_MASK].tolist() == [[0, 1], [1, 0]]
    assert batch[K.ROLLOUT_IS_WEIGHTS].tolist() == [[0.0, 1.0], [1.0, 0.0]]
    assert metrics == pytest.approx({
        "rollout_corr/is_weight_mean": 1.0, "rollout_corr/is_weight_max": 1.0, "rollout_corr/is_weight_min": 1.0,
        "rollout_corr/clipped_frac": 0.0, "rollout_corr/masked_frac": 1 / 3, "rollout_corr/rejected_seq_frac": 0.0,
    })


def test_staleness_statistic():
    from hybridflow.workers.algo_steps import staleness

    batch = TensorDict({K.WEIGHT_VERSION: torch.tensor([3, 3, 2, 1])}, batch_size=[4])
    assert staleness(batch, 3) == {
        "async/staleness_mean": 0.75, "async/staleness_max": 2.0, "async/staleness_last_mean": 0.75,
    }
    # partial rollouts: the last tokens of two samples came from newer weights
    batch[K.WEIGHT_VERSION_LAST] = torch.tensor([3, 3, 3, 2])
    assert staleness(batch, 3) == {
        "async/staleness_mean": 0.75, "async/staleness_max": 2.0, "async/staleness_last_mean": 0.25,
    }


# -- end to end ------------------------------------------------------------------------------


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- trainer.async ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "graph, overrides, field",
    [
        (GRPO, ["trainer.async.mode=stream"], "trainer.async.mode"),
        (GRPO, ["trainer.async.mode=one_step_off", "trainer.async.max_staleness=0"], "trainer.async"),
        (GRPO, ["trainer.async_.mode=sync"], "trainer.async_"),  # the file spells it async
        (ROOT / "graphs" / "dapo.yaml", ["trainer.async.mode=one_step_off"], "trainer.async.mode"),
    ],
)
def test_bad_async_settings_are_one_line(graph, overrides, field):
    with pytest.raises(SpecError) as info:
        load_graph(graph, overrides)
    message = str(info.value)
    assert "\n" not in message and f".yaml: {field}:" in message


@pytest.mark.slow
def test_streaming_at_max_staleness_0_is_the_synchronous_run_bit_for_bit(ray_session, tmp_path):
    """streaming with K = 0 keeps no generation ahead: it logs what trainer.async.mode sync logs,
    every non-timing metric equal (and the consistency check is on, as in sync)."""
    from test_resume import non_timing

    from hybridflow.controller.trainer import Trainer

    overrides = [*SHORT, "trainer.iterations=3", "trainer.save_interval=0"]
    streaming = load_graph(GRPO, [*overrides, "trainer.async.mode=streaming", "trainer.async.max_staleness=0"])
    assert streaming.spec.trainer.async_.synchronous and streaming.spec.trainer.async_.ahead == 0
    Trainer(load_graph(GRPO, [*overrides, "trainer.async.mode=sync"]), run_dir=str(tmp_path / "sync")).fit()
    Trainer(streaming, run_dir=str(tmp_path / "k0")).fit()

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [non_timing(json.loads(line)) for line in lines]

    assert [r["iteration"] for r in rows("sync")] == [1, 2, 3]
    assert rows("k0") == rows("sync")


def test_async_defaults_to_sync_and_is_written_as_async():
    spec = load_graph(GRPO, ["trainer.async.mode=one_step_off"]).spec
    assert load_graph(GRPO).spec.trainer.async_.mode == "sync"
    assert spec.trainer.model_dump(mode="json")["async"] == {"mode": "one_step_off", "max_staleness": 1, "partial_rollout": "off"}


def test_graph_picture_shows_the_generation_ahead():
    from hybridflow.graph.render import describe

    lines = describe(load_graph(ROOT / "graphs" / "grpo_async.yaml")).splitlines()
    ahead = [line for line in lines if "one_step_off: submitted for the next iteration" in line]
    assert [line.split()[0] for line in ahead] == ["generate"]
    assert not any("one_step_off" in line for line in describe(load_graph(GRPO)).splitlines())


@pytest.mark.slow
def test_one_step_off_with_rollout_correction_survives_a_worker_crash(ray_session, tmp_path):
    """One-step off-policy GRPO with rollout correction (token TIS capped at 2, geometric
    rejection outside [0.5, 2]); SIGKILL of a worker during iteration 4, checkpoint at 2:

    - generation k+1 goes before update k: samples are one update old, and the correction sees
      pi_old differ from the sampler (IS weights != 1, within (0, 2]);
    - at staleness 0 (iteration 1) pi_old = pi_rollout (the transformers rollout shares the
      actor's module): weights 1 to 1e-3, nothing clipped, masked or rejected;
    - the workers restart, the run goes back to iteration 2 and trains the generation saved
      with it (one update old, as before the crash): iteration i trains the dataset's i-th
      batch (its logged samples answer that batch's prompts).
    """
    from checkpoint_harness import assert_each_batch_trained_once, kill_worker_after

    from hybridflow.controller.trainer import Trainer

    # 8 x 16 samples: groups with differing rewards from the start, so each update moves the
    # weights (an all-zero-advantage update would leave pi_old equal to the sampler)
    overrides = [*SHORT, "data.prompts_per_iteration=8", "trainer.iterations=5", "trainer.save_interval=2",
                 "trainer.max_restarts=1", "trainer.sample_interval=1", "trainer.async.mode=one_step_off",
                 f"{CORR}.is_level=token", f"{CORR}.is_cap=2.0",
                 f"{CORR}.reject_level=geometric", f"{CORR}.reject_low=0.5", f"{CORR}.reject_high=2.0"]
    run_dir = tmp_path / "killed"
    trainer = Trainer(load_graph(ASYNC, overrides), run_dir=str(run_dir))
    trainer.callbacks.append(kill_worker_after(3, pool="default", rank=1))
    assert trainer.fit()["restarts"] == 1
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    # back at 2, the first iteration after the restore trains the generation saved at 2
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    for row in rows:
        w = row["rollout_corr/is_weight_mean"]
        assert 0.0 < row["rollout_corr/is_weight_min"] <= w <= row["rollout_corr/is_weight_max"] <= 2.0
        assert math.isfinite(row["actor/pg_loss"])
        if row["async/staleness_max"] == 1.0:  # sampled one update ago
            assert row["actor/rollout_log_prob_diff_mean"] > 1e-4, row["actor/rollout_log_prob_diff_mean"]
            assert w != 1.0
        else:
            assert row["actor/rollout_log_prob_diff_mean"] < 1e-4 and abs(w - 1.0) < 1e-3
            assert row["rollout_corr/clipped_frac"] == row["rollout_corr/masked_frac"] == 0.0
            assert row["rollout_corr/rejected_seq_frac"] == 0.0
    assert_each_batch_trained_once(trainer, run_dir, iterations=5, prompts_per_iteration=8)
