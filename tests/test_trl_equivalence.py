"""hybridflow's GRPO update is TRL 1.16's, exactly, at peers.py's settings.

One fixed batch (4 prompts x 4 samples of the copy task: answers that stop, stop with a wrong
letter and junk after the EOS, never stop, or put a pad before the EOS; one group never stops at
all), fixed initial weights. hybridflow runs its real path: a ``ModelWorker`` per rank on two
data-parallel gloo ranks (the layout peers.py runs) runs the ``reward``, ``advantage`` and
``update_actor`` nodes (``run_op``, as the controller does) of the graph peers.py builds (GRPO
with ``norm_by_std`` and ``epsilon: 1e-4``; PPO clip 0.2, ``token-mean``, no KL; AdamW betas
0.9/0.999, clip 1.0; here at sampling temperature 0.5 and clipping active), twice (each update
on-policy, so each is a "first" update of TRL's kind). The reference (``tests/trl_reference.py``)
is TRL's GRPOTrainer formula, ``loss_type="dapo"``, ``scale_rewards="group"``, ``beta=0``, one
update per batch, from the weights peers.py's TRL side builds, with TRL's reward (the task's rule
and the ending rule on ``completion_ids``).

Loss, pre-clip gradient norm and clipped gradients agree within 1e-5 (float32), weights after
each AdamW step within 5e-5. The negative cases change one normalisation on one side and assert
a difference at least ten times the tolerance.
"""

from __future__ import annotations

import copy
import importlib.util
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tensordict import NonTensorStack, TensorDict

import trl_reference as trl
from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields
from hybridflow.data.tasks import get_task

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
# Weights after AdamW steps: a gradient entry far below AdamW's eps (1e-8; some here are 1e-9)
# turns float noise of 1e-7 into a visible step, so the weights get 5% of one lr step.
WEIGHT_TOLERANCE = 5e-5
SPAWN_TIMEOUT_S = 600  # a rank stuck in the rendezvous (a port taken meanwhile) fails the test
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
SEED, LR, TEMPERATURE, NUM_STEPS = 3, 1e-3, 0.5, 2
PROMPTS = ["abc=", "hgfe=", "dd=", "cabba="]
NUM_GENERATIONS, MAX_NEW_TOKENS = 4, 8
TASK = get_task("copy")
TOKENIZER = TASK.tokenizer()
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
MODEL_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96}

# hybridflow-side changes that must break the equality: (advantage options, update options,
# AdamW hyper-parameters). The reference-side ones are in REFERENCE_VARIANTS.
HYBRIDFLOW_VARIANTS = {
    "equal": ({}, {}, {}),
    "std epsilon 1e-6 (hybridflow's default)": ({"epsilon": 1e-6}, {}, {}),
    "no std normalisation (Dr.GRPO)": ({"norm_by_std": False}, {}, {}),
    "batch-wide group": ({"scope": "batch"}, {}, {}),
    "sequence-mean loss": ({}, {"loss_agg": "seq-mean-token-mean"}, {}),
    "AdamW eps 1e-6": ({}, {}, {"eps": 1e-6}),
}
REFERENCE_VARIANTS = {
    "TRL with a biased std": {"biased_std": True},
    "TRL without the completion mask after EOS": {"mask_after_eos": False},
    "TRL loss_type grpo": {"loss_type": "grpo"},
    "TRL log-probs at temperature 1": {"temperature": 1.0},
}


def _peers():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _completions() -> list[list[int]]:
    """Raw generated tokens (MAX_NEW_TOKENS each), NUM_GENERATIONS per prompt, adjacent."""
    enc = lambda text: TOKENIZER(text)["input_ids"]  # noqa: E731
    rows = []
    for prompt in PROMPTS[:3]:
        answer = prompt[:-1]
        rows += [
            enc(answer) + [EOS],  # right, stops
            enc(answer[:-1] + "a") + [EOS] + enc("hh"),  # one letter wrong, junk after EOS
            enc(answer + answer),  # never stops: truncated
            enc(answer) + [PAD, EOS],  # a pad right before EOS: unfinished
        ]
    rows += [enc("abcdefgh")] * NUM_GENERATIONS  # a group that never stops: all scores 0
    return [(r + [PAD] * MAX_NEW_TOKENS)[:MAX_NEW_TOKENS] for r in rows]


def _batch() -> TensorDict:
    enc = TOKENIZER(PROMPTS, padding=True, return_tensors="pt")
    n = NUM_GENERATIONS
    prompt_ids = enc["input_ids"].repeat_interleave(n, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(n, 0)
    fields = build_rollout_fields(prompt_ids, prompt_mask, torch.tensor(_completions()), EOS, PAD)
    fields.update({K.PROMPT_IDS: prompt_ids, K.PROMPT_MASK: prompt_mask,
                   K.UID: torch.arange(len(PROMPTS)).repeat_interleave(n)})
    batch = TensorDict(fields, batch_size=[len(PROMPTS) * n])
    batch[K.PROMPT_TEXT] = NonTensorStack(*[p for p in PROMPTS for _ in range(n)])
    batch[K.GROUND_TRUTH] = NonTensorStack(*[p[:-1] for p in PROMPTS for _ in range(n)])
    return batch


def _graph():
    args = _peers().parse_args(
        ["--hidden-size", "64", "--layers", "2", "--intermediate-size", "96", "--heads", "2", "--kv-heads", "2",
         "--prompts", str(len(PROMPTS)), "--samples", str(NUM_GENERATIONS), "--max-new-tokens",
         str(MAX_NEW_TOKENS), "--lr", str(LR), "--temperature", str(TEMPERATURE), "--iterations", "10"]
    )
    return _peers().peers_graph(args, SEED)


def _run_op(worker, rank: int, batch: TensorDict, node: str, **kw):
    """``worker``'s node as the controller calls it, with this rank's coords in its layout."""
    layout = worker.graph.dispatch_layout(worker.graph.node(node))
    return worker.run_op(batch, node=node, coords=layout.coords(rank), **kw)


def _rank(rank: int, world_size: int, port: int, tokenizer_dir: str, out: str) -> None:
    from hybridflow.workers.model_worker import ModelWorker

    graph = _graph()
    worker = ModelWorker(rank, world_size, "127.0.0.1", port, 1, graph=graph, models=["actor", "reward"],
                         tokenizer_dir=tokenizer_dir, total_steps=NUM_STEPS)
    try:
        engine = worker.train_engines["actor"]
        settings = {k: engine.optimizer.param_groups[0][k] for k in ADAMW_KEYS}  # as the graph built it
        initial = copy.deepcopy(engine.state_dict())
        names = {id(p): name for name, p in engine.module.named_parameters()}
        captured: list[dict] = []
        engine.optimizer.register_step_pre_hook(
            lambda opt, *_: captured.append(
                {names[id(p)]: p.grad.clone() for group in opt.param_groups for p in group["params"]}
            )
        )
        per_rank = len(PROMPTS) * NUM_GENERATIONS // world_size
        local = _batch()[rank * per_rank : (rank + 1) * per_rank]
        scored, _ = _run_op(worker, rank, local, "reward")  # the ops as the controller runs them
        local.update(scored)
        results = {}
        for variant, (adv_options, update_options, adamw) in HYBRIDFLOW_VARIANTS.items():
            engine.load_state_dict(copy.deepcopy(initial))
            engine.optimizer.param_groups[0].update(adamw)
            captured.clear()
            advantage = graph.node("advantage").spec.options.model_copy(update=adv_options)
            adv, _ = _run_op(worker, rank, local, "advantage", options=advantage)
            batch = local.clone()
            batch.update(adv)
            update = graph.node("update_actor").spec.options.model_copy(update=update_options)
            steps = []
            for _ in range(NUM_STEPS):
                _, meta = _run_op(worker, rank, batch, "update_actor", options=update)
                steps.append({"loss": meta["metrics"]["actor/loss"], "grad_norm": meta["metrics"]["actor/grad_norm"],
                              "weights": {k: v.clone() for k, v in engine.named_weights()}})
            for step, grads in zip(steps, captured, strict=True):
                step["grads"] = grads
            results[variant] = {"steps": steps, "advantages": adv[K.ADVANTAGES], "scores": scored[K.SCORES]}
        if rank == 0:
            torch.save({"variants": results, "adamw": settings}, out)
    finally:
        worker.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(**switches) -> dict:
    """TRL's two updates on the batch, from peers.py's TRL-side initial weights."""
    peers = _peers()
    model = peers.trl_model(MODEL_CONFIG | {"num_attention_heads": 2, "num_key_value_heads": 2}, TOKENIZER, SEED)
    model.train()
    enc = TOKENIZER(PROMPTS, padding=True, return_tensors="pt")  # left-padded, as TRL pads
    prompt_ids = enc["input_ids"].repeat_interleave(NUM_GENERATIONS, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(NUM_GENERATIONS, 0)
    raw = torch.tensor(_completions())
    mask = trl.completion_mask(raw, [EOS])
    completion_ids = [row[m.bool()].tolist() for row, m in zip(raw, mask)]
    # TRL right-pads the cut completions back into a tensor and keeps their mask.
    ids = raw.masked_fill(mask == 0, PAD)
    texts = TOKENIZER.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [p for p in PROMPTS for _ in range(NUM_GENERATIONS)]
    scores, _ = peers.trl_scores(TASK, TOKENIZER, prompts, texts, [p[:-1] for p in prompts], completion_ids)
    advantages = trl.group_advantages(scores, NUM_GENERATIONS, biased_std=switches.get("biased_std", False))
    loss_mask = trl.completion_mask(raw, [EOS], mask_after_eos=switches.get("mask_after_eos", True))
    optimizer = trl.make_optimizer(model, LR)
    steps = []
    for _ in range(NUM_STEPS):
        loss = trl.grpo_loss(model, prompt_ids, prompt_mask, ids, loss_mask, advantages,
                             temperature=switches.get("temperature", TEMPERATURE),
                             loss_type=switches.get("loss_type", "dapo"))
        step = trl.train_step(model, optimizer, loss, max_grad_norm=1.0)
        step["weights"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        steps.append(step)
    return {"steps": steps, "advantages": advantages, "scores": scores}


def _max_diff(ours: dict, theirs: dict) -> dict[str, float]:
    """Largest absolute difference over both steps, per compared quantity."""
    out = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "weights": 0.0}
    for a, b in zip(ours["steps"], theirs["steps"], strict=True):
        out["loss"] = max(out["loss"], abs(a["loss"] - b["loss"]))
        out["grad_norm"] = max(out["grad_norm"], abs(a["grad_norm"] - b["grad_norm"]))
        for key in ("grads", "weights"):
            assert a[key].keys() == b[key].keys()
            out[key] = max(out[key], max((a[key][k] - b[key][k]).abs().max().item() for k in a[key]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("trl_equivalence")
    TOKENIZER.save_pretrained(tmp / "tokenizer")
    torch.set_num_threads(1)
    ranks = mp.spawn(_rank, args=(2, _free_port(), str(tmp / "tokenizer"), str(tmp / "hybridflow.pt")),
                     nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ranks.join(timeout=5):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the two hybridflow ranks did not finish within {SPAWN_TIMEOUT_S} s")
    hybridflow = torch.load(tmp / "hybridflow.pt")
    return {"hybridflow": hybridflow["variants"], "adamw": hybridflow["adamw"], "trl": _reference()}


def test_batch_covers_the_cases():
    batch = _batch()
    assert batch[K.TRUNCATED].sum() == 3 + NUM_GENERATIONS
    # junk after an EOS is outside the mask; the pad-before-EOS rows end at their EOS
    assert batch[K.RESPONSE_MASK].sum(-1).tolist()[:4] == [4, 4, 8, 5]


def test_rewards_and_advantages_equal_trl(runs):
    ours, theirs = runs["hybridflow"]["equal"], runs["trl"]
    scores = torch.cat([ours["scores"]])  # rank 0's half of the batch
    half = len(scores)
    assert torch.equal(scores, theirs["scores"][:half].float())
    assert set(theirs["scores"].tolist()) >= {0.0, 1.0}, "the batch must mix stopped and unfinished answers"
    adv = ours["advantages"][:, 0]  # every response token carries the sequence advantage
    assert (adv - theirs["advantages"][:half]).abs().max() < TOLERANCE


def test_update_equals_trl(runs):
    diff = _max_diff(runs["hybridflow"]["equal"], runs["trl"])
    print("hybridflow vs TRL, largest differences:", diff)  # shown with pytest -s
    assert max(diff["loss"], diff["grad_norm"], diff["grads"]) < TOLERANCE, diff
    assert diff["weights"] < WEIGHT_TOLERANCE, diff
    first = runs["trl"]["steps"][0]
    assert first["grad_norm"] > 1.0, "clipping at 1.0 must be active for the comparison to cover it"
    moved = max((runs["trl"]["steps"][-1]["weights"][k] - runs["trl"]["steps"][0]["weights"][k]).abs().max()
                for k in first["weights"])
    assert moved > 1e-4, "the second step must move the weights"


@pytest.mark.parametrize("variant", [v for v in HYBRIDFLOW_VARIANTS if v != "equal"])
def test_changed_hybridflow_normalisation_breaks_equality(runs, variant):
    diff = _max_diff(runs["hybridflow"][variant], runs["trl"])
    print(f"hybridflow {variant} vs TRL:", diff)
    assert max(diff["loss"], diff["grad_norm"], diff["grads"]) > 10 * TOLERANCE, (variant, diff)


@pytest.mark.parametrize("variant", list(REFERENCE_VARIANTS))
def test_changed_trl_normalisation_breaks_equality(runs, variant):
    diff = _max_diff(runs["hybridflow"]["equal"], _reference(**REFERENCE_VARIANTS[variant]))
    print(f"hybridflow vs {variant}:", diff)
    assert max(diff["loss"], diff["grad_norm"], diff["grads"]) > 10 * TOLERANCE, (variant, diff)


def test_adamw_settings_equal_trl(runs):
    """Two steps on one batch cannot show betas (both steps' gradients are nearly equal), so the
    optimizer's settings are compared as settings: all but TRL's fused kernel are equal."""
    reference = trl.make_optimizer(torch.nn.Linear(2, 2), LR).param_groups[0]
    assert runs["adamw"] == {k: reference[k] for k in ADAMW_KEYS}
    assert reference["fused"] is True  # hybridflow: torch's default (for-loop on CPU)

