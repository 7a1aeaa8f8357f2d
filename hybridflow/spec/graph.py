"""Pydantic models of a graph file: models, placement, nodes, data and trainer settings.

Every setting has its default here and nowhere else. Models are frozen once loaded.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hybridflow.spec.layout import ParallelLayout

Role = Literal["actor", "critic", "ref", "reward", "cost"]


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- models -----------------------------------------------------------------------------------


class ModelSource(Spec):
    """Where a model's weights come from: exactly one of ``config``, ``path`` or ``rule``."""

    config: dict | None = Field(
        None,
        description="A tiny causal LM built from this HF config (overrides of the built-in "
        "tiny Qwen2 config, e.g. {hidden_size: 64}); random init from trainer.seed.",
    )
    path: str | None = Field(None, description="A local HF model directory (no hub download).")
    rule: str | None = Field(
        None, description="'module:function' rule scorer (reward/cost models only)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSource":
        given = [k for k in ("config", "path", "rule") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of config, path, rule (got {given or 'none'})")
        return self


class OptimSpec(Spec):
    """Optimiser and learning-rate schedule of a trained model (AdamW)."""

    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    grad_clip: float | None = Field(1.0, gt=0, description="Max global grad norm; null = off.")


class TrainEngineSpec(Spec):
    """The engine that holds a model's weights for forward passes and updates."""

    engine: Literal["torch", "megatron"] = Field("torch", description="Train engine.")
    layout: ParallelLayout = Field(default_factory=ParallelLayout, description="TP x PP x DP.")
    micro_batch_size: int = Field(
        16, ge=1, description="Samples per forward/backward on one device."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    optim: OptimSpec = Field(default_factory=OptimSpec, description="Used by update nodes.")


class RolloutSpec(Spec):
    """How the actor generates: engine, sampling and samples per prompt."""

    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine.")
    n: int = Field(8, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    layout: ParallelLayout = Field(
        default_factory=ParallelLayout, description="Generation layout (tg, pg)."
    )
    log_prob_tolerance: float | None = Field(
        None,
        gt=0,
        description="Stop the run if rollout and training log-probs differ by more than this "
        "(mean absolute difference); null = only report.",
    )


class ModelSpec(Spec):
    """A model node: its role, weights and engines."""

    role: Role = Field(description="actor, critic, ref, reward or cost.")
    source: ModelSource = Field(description="Where the weights come from.")
    train: TrainEngineSpec = Field(
        default_factory=TrainEngineSpec, description="Engine for forwards and updates."
    )
    rollout: RolloutSpec | None = Field(None, description="Generation settings (actor only).")

    @model_validator(mode="after")
    def _role_fits(self) -> "ModelSpec":
        if self.rollout is not None and self.role != "actor":
            raise ValueError(f"only an actor has rollout settings (role is {self.role})")
        if self.source.rule is not None and self.role not in ("reward", "cost"):
            raise ValueError(f"a rule source is for reward/cost models (role is {self.role})")
        return self


# -- nodes ------------------------------------------------------------------------------------


class NodeBase(Spec):
    name: str = Field(description="Unique node name.")
    model: str = Field(description="The model (key of `models`) whose workers run the node.")
    inputs: list[str] | None = Field(None, description="Data keys consumed; default per op.")
    outputs: list[str] | None = Field(None, description="Data keys produced; default per op.")


class GenerateOptions(Spec):
    greedy: bool = Field(False, description="Greedy decoding, one sample per prompt.")


class GenerateNode(NodeBase):
    op: Literal["generate"]
    options: GenerateOptions = Field(default_factory=GenerateOptions)


class NoOptions(Spec):
    pass


class LogProbNode(NodeBase):
    op: Literal["log_prob"]
    options: NoOptions = Field(default_factory=NoOptions)


class ValuesNode(NodeBase):
    op: Literal["values"]
    options: NoOptions = Field(default_factory=NoOptions)


class ScoreNode(NodeBase):
    op: Literal["score"]
    options: NoOptions = Field(default_factory=NoOptions)


class AdvantageOptions(Spec):
    estimator: str = Field("grpo", description="Registered advantage estimator name.")
    norm_by_std: bool = Field(True, description="GRPO: divide by the group's std (False = Dr.GRPO).")
    epsilon: float = Field(1e-6, gt=0, description="Added to the std before dividing.")


class AdvantageNode(NodeBase):
    op: Literal["advantage"]
    options: AdvantageOptions = Field(default_factory=AdvantageOptions)


class UpdateOptions(Spec):
    policy_loss: str = Field("ppo_clip", description="Registered policy loss name.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL(actor || ref) loss term.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from loss).")
    loss_agg: str = Field("token-mean", description="Registered loss aggregation mode.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per rollout batch (per epoch).")
    epochs: int = Field(1, ge=1, description="Passes over the rollout batch.")


class UpdateNode(NodeBase):
    op: Literal["update"]
    options: UpdateOptions = Field(default_factory=UpdateOptions)


NodeSpec = Annotated[
    Union[GenerateNode, LogProbNode, ValuesNode, ScoreNode, AdvantageNode, UpdateNode],
    Field(discriminator="op"),
]


# -- data and trainer -------------------------------------------------------------------------


class DataSpec(Spec):
    """Prompt source and batch shape."""

    source: str = Field(
        "builtin:copy",
        description="'builtin:NAME' for a built-in task, or a JSONL file of "
        '{"prompt": ..., "ground_truth": ...} rows (relative to the graph file).',
    )
    prompts_per_iteration: int = Field(16, ge=1, description="Prompts per iteration.")
    max_prompt_length: int = Field(16, ge=1, description="Prompt tokens; longer prompts fail.")
    max_response_length: int = Field(8, ge=1, description="Max generated tokens per sample.")
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch.")
    seed: int = Field(0, description="Seed of the task's prompts and the shuffle.")
    num_train: int = Field(2000, ge=1, description="Built-in task: training prompts.")
    num_val: int = Field(64, ge=0, description="Held-out prompts scored greedily.")


class TrainerSpec(Spec):
    iterations: int = Field(60, ge=1, description="Iterations (rollout + update) to run.")
    seed: int = Field(0, description="Seed of model init and sampling.")
    val_interval: int = Field(10, ge=0, description="Validate every N iterations; 0 = never.")
    save_dir: str = Field("runs/{name}", description="Run directory ({name} = graph name).")
    save_final: bool = Field(True, description="Save the final actor in HF format.")
    progress: bool = Field(True, description="Show a progress bar.")


class GraphSpec(Spec):
    """A whole graph file."""

    name: str = Field(description="Algorithm / run name.")
    resources: str = Field(
        "resource_pools/local_cpu.yaml",
        description="Pool file, relative to the current directory or the graph file.",
    )
    models: dict[str, ModelSpec] = Field(description="Model name -> model.")
    placement: dict[str, str] | Literal["auto"] = Field(
        "auto", description="Model name -> pool name, or 'auto'."
    )
    nodes: list[NodeSpec] = Field(description="Operations; edges are derived from data keys.")
    data: DataSpec = Field(default_factory=DataSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
