"""The algorithm library: each algorithm's graph composed with the Python builder.

The shipped ``graphs/*.yaml`` files are the same graphs written as YAML; a test checks they are
equal, so either can be read as the reference.
"""

from __future__ import annotations

from hybridflow.graph.builder import GraphBuilder

TINY_SOURCE = {"config": {"hidden_size": 64, "num_hidden_layers": 2}}


def grpo(
    n: int = 16,
    kl_coef: float = 0.001,
    reward_fn: str = "hybridflow.data.tasks:copy_reward",
    source: dict | None = None,
) -> GraphBuilder:
    """GRPO: group-relative advantages over n samples per prompt, PPO-clip loss, KL loss term."""
    source = source or TINY_SOURCE
    g = GraphBuilder("grpo", resources="resource_pools/local_cpu.yaml")
    g.model(
        "actor",
        role="actor",
        source=source,
        train={"micro_batch_size": 64, "optim": {"lr": 0.001, "grad_clip": 1.0}},
        rollout={"engine": "hf", "n": n, "temperature": 1.0},
    )
    g.model("ref", role="ref", source=source)
    g.model("reward", role="reward", source={"rule": reward_fn})
    g.place({"actor": "default", "ref": "default", "reward": "default"})
    g.node("generate", "generate", model="actor", inputs=["prompts"], outputs=["responses"])
    g.node("old_log_prob", "log_prob", model="actor", inputs=["responses"], outputs=["old_log_probs"])
    g.node("ref_log_prob", "log_prob", model="ref", inputs=["responses"], outputs=["ref_log_probs"])
    g.node("reward", "score", model="reward", inputs=["responses"], outputs=["scores"])
    g.node(
        "advantage",
        "advantage",
        model="actor",
        inputs=["responses", "scores"],
        outputs=["advantages"],
        estimator="grpo",
        norm_by_std=True,
    )
    g.node(
        "update_actor",
        "update",
        model="actor",
        inputs=["responses", "old_log_probs", "ref_log_probs", "advantages"],
        outputs=[],
        clip_ratio=0.2,
        kl_coef=kl_coef,
        kl_estimator="k3",
        mini_batches=1,
    )
    g.data(source="builtin:copy", prompts_per_iteration=16, max_prompt_length=8, max_response_length=8)
    g.trainer(iterations=400, seed=0, val_interval=50)
    return g
