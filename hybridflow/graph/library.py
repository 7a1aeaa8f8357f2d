"""The algorithm library: each algorithm's graph composed with the Python builder.

The shipped ``graphs/*.yaml`` files are the same graphs written as YAML; a test checks they are
equal, so either can be read as the reference. Every builder takes the few knobs a user changes
most (samples per prompt, KL weight, reward rule, model source); everything else can be changed
on the returned builder or with overrides.

Batch sizes, one set of names everywhere: ``data.prompts_per_iteration`` prompts x
``rollout.n`` samples = the rollout batch; an update node splits it into ``mini_batches``
disjoint mini-batches (one optimizer step each, ``epochs`` passes); each rank runs a mini-batch
in forward/backward passes of ``train.micro_batch_size`` samples.
"""

from __future__ import annotations

from hybridflow.graph.builder import GraphBuilder

TINY_SOURCE = {"config": {"hidden_size": 64, "num_hidden_layers": 2}}
COPY_REWARD = "hybridflow.data.tasks:copy_reward"
LETTER_COST = "hybridflow.data.tasks:letter_cost"
ACTOR_TRAIN = {"micro_batch_size": 64, "optim": {"lr": 0.001, "grad_clip": 1.0}}
CRITIC_TRAIN = {"micro_batch_size": 64, "optim": {"lr": 0.001, "grad_clip": 1.0}}
REF_TRAIN = {"micro_batch_size": 64}
POOL_FILE = "resource_pools/local_cpu.yaml"


def _policy_models(g: GraphBuilder, source: dict, n: int, reward_fn: str) -> None:
    g.model("actor", role="actor", source=source, train=ACTOR_TRAIN,
            rollout={"engine": "hf", "n": n, "temperature": 1.0})
    g.model("ref", role="ref", source=source, train=REF_TRAIN)
    g.model("reward", role="reward", source={"rule": reward_fn})


def _rollout_nodes(g: GraphBuilder, old_log_prob: bool = True) -> None:
    g.node("generate", "generate", model="actor", inputs=["prompts"], outputs=["responses"])
    if old_log_prob:
        g.node("old_log_prob", "log_prob", model="actor", inputs=["responses"], outputs=["old_log_probs"])
    g.node("ref_log_prob", "log_prob", model="ref", inputs=["responses"], outputs=["ref_log_probs"])
    g.node("reward", "score", model="reward", inputs=["responses"], outputs=["scores"])


def _copy_data(g: GraphBuilder, prompts_per_iteration: int) -> None:
    g.data(source="builtin:copy", prompts_per_iteration=prompts_per_iteration,
           max_prompt_length=8, max_response_length=8)


def _group_relative(name: str, estimator: str, n: int, kl_coef: float, reward_fn: str,
                    source: dict | None, **estimator_options) -> GraphBuilder:
    g = GraphBuilder(name, resources=POOL_FILE)
    _policy_models(g, source or TINY_SOURCE, n, reward_fn)
    g.place({"actor": "default", "ref": "default", "reward": "default"})
    # No old_log_prob node: one optimizer step per batch, so the update's own first forward is pi_old.
    _rollout_nodes(g, old_log_prob=False)
    g.node("advantage", "advantage", model="actor", inputs=["responses", "scores"],
           outputs=["advantages"], estimator=estimator, **estimator_options)
    g.node("update_actor", "update", model="actor",
           inputs=["responses", "ref_log_probs", "advantages"], outputs=[],
           clip_ratio=0.2, kl_coef=kl_coef, kl_estimator="k3", mini_batches=1)
    _copy_data(g, 16)
    return g


def grpo(
    n: int = 16,
    kl_coef: float = 0.001,
    reward_fn: str = COPY_REWARD,
    source: dict | None = None,
) -> GraphBuilder:
    """GRPO: group-relative advantages over n samples per prompt, PPO-clip loss, KL loss term."""
    g = _group_relative("grpo", "grpo", n, kl_coef, reward_fn, source, norm_by_std=True)
    g.trainer(iterations=400, seed=0, val_interval=50)
    return g


def rloo(
    n: int = 16,
    kl_coef: float = 0.001,
    reward_fn: str = COPY_REWARD,
    source: dict | None = None,
) -> GraphBuilder:
    """RLOO: each sample's reward against the mean of the other n - 1 samples of its prompt."""
    g = _group_relative("rloo", "rloo", n, kl_coef, reward_fn, source)
    g.trainer(iterations=150, seed=0, val_interval=50)
    return g


def remax(
    prompts_per_iteration: int = 256,
    kl_coef: float = 0.001,
    reward_fn: str = COPY_REWARD,
    source: dict | None = None,
) -> GraphBuilder:
    """ReMax: one sample per prompt; the reward of the actor's greedy answer is the baseline.

    The greedy generation is its own node (``greedy_generate``), scored by the same reward model
    under its own key (``baseline_scores``).
    """
    g = GraphBuilder("remax", resources=POOL_FILE)
    _policy_models(g, source or TINY_SOURCE, 1, reward_fn)
    g.place({"actor": "default", "ref": "default", "reward": "default"})
    _rollout_nodes(g)
    g.node("greedy_generate", "generate", model="actor", inputs=["prompts"],
           outputs=["greedy_responses"], greedy=True)
    g.node("baseline_reward", "score", model="reward", inputs=["greedy_responses"],
           outputs=["baseline_scores"])
    g.node("advantage", "advantage", model="actor", inputs=["responses", "scores", "baseline_scores"],
           outputs=["advantages"], estimator="remax")
    # One sample per prompt: many prompts and two optimizer steps make up for the missing group.
    g.node("update_actor", "update", model="actor",
           inputs=["responses", "old_log_probs", "ref_log_probs", "advantages"], outputs=[],
           clip_ratio=0.2, kl_coef=kl_coef, kl_estimator="k3", mini_batches=2)
    _copy_data(g, prompts_per_iteration)
    g.trainer(iterations=100, seed=0, val_interval=50)
    return g


def _ppo_core(g: GraphBuilder, kl_coef: float, mini_batches: int) -> None:
    g.node("values", "values", model="critic", inputs=["responses"], outputs=["values"])
    g.node("advantage", "advantage", model="actor",
           inputs=["responses", "scores", "values", "old_log_probs", "ref_log_probs"],
           outputs=["advantages"], estimator="gae", gamma=1.0, gae_lambda=0.95, whiten=True,
           kl_coef=kl_coef, kl_estimator="k1")
    g.node("update_critic", "update", model="critic", inputs=["responses", "values", "advantages"],
           outputs=[], value_clip=0.2, mini_batches=mini_batches)


def ppo(
    n: int = 4,
    kl_coef: float = 0.001,
    reward_fn: str = COPY_REWARD,
    source: dict | None = None,
) -> GraphBuilder:
    """PPO: a critic (value head on the same tiny LM), GAE, KL to the reference in the reward."""
    source = source or TINY_SOURCE
    g = GraphBuilder("ppo", resources=POOL_FILE)
    _policy_models(g, source, n, reward_fn)
    g.model("critic", role="critic", source=source, train=CRITIC_TRAIN)
    g.place({"actor": "default", "critic": "default", "ref": "default", "reward": "default"})
    _rollout_nodes(g)
    _ppo_core(g, kl_coef, mini_batches=2)
    g.node("update_actor", "update", model="actor",
           inputs=["responses", "old_log_probs", "advantages"], outputs=[],
           clip_ratio=0.2, mini_batches=2)
    _copy_data(g, 32)
    g.trainer(iterations=150, seed=0, val_interval=50)
    return g


def safe_rlhf(
    n: int = 4,
    kl_coef: float = 0.001,
    cost_threshold: float = 0.1,
    reward_fn: str = COPY_REWARD,
    cost_fn: str = LETTER_COST,
    source: dict | None = None,
) -> GraphBuilder:
    """Safe-RLHF: PPO on reward and cost with two critics and a Lagrange multiplier.

    The actor maximises the reward advantage minus lambda times the cost advantage (normalised
    by 1 + lambda); lambda rises while the mean episode cost is above ``cost_threshold``.
    """
    source = source or TINY_SOURCE
    g = GraphBuilder("safe_rlhf", resources=POOL_FILE)
    _policy_models(g, source, n, reward_fn)
    g.model("critic", role="critic", source=source, train=CRITIC_TRAIN)
    g.model("cost", role="cost", source={"rule": cost_fn})
    g.model("cost_critic", role="critic", source=source, train=CRITIC_TRAIN)
    g.place({name: "default" for name in ("actor", "critic", "ref", "reward", "cost", "cost_critic")})
    _rollout_nodes(g)
    g.node("cost", "score", model="cost", inputs=["responses"], outputs=["costs"])
    g.node("cost_values", "values", model="cost_critic", inputs=["responses"], outputs=["cost_values"])
    _ppo_core(g, kl_coef, mini_batches=2)
    # KL stays in the reward only: a cost needs no pull towards the reference.
    g.node("cost_advantage", "advantage", model="actor", inputs=["responses", "costs", "cost_values"],
           outputs=["cost_advantages"], estimator="gae", gamma=1.0, gae_lambda=0.95, whiten=True)
    g.node("update_cost_critic", "update", model="cost_critic",
           inputs=["responses", "cost_values", "cost_advantages"], outputs=[], value_clip=0.2,
           mini_batches=2)
    g.node("update_actor", "update", model="actor",
           inputs=["responses", "old_log_probs", "advantages", "cost_advantages", "costs"], outputs=[],
           clip_ratio=0.2, mini_batches=2,
           safety={"cost_threshold": cost_threshold, "lambda_init": 0.0, "lambda_lr": 0.5})
    _copy_data(g, 32)
    g.trainer(iterations=150, seed=0, val_interval=50)
    return g


ALGORITHMS = {"grpo": grpo, "ppo": ppo, "remax": remax, "rloo": rloo, "safe_rlhf": safe_rlhf}
