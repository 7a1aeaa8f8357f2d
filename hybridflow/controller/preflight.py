"""Checks of user inputs that need more than the graph file: optional engines installed, model
directories, tokenizers and reward functions. Run by the trainer before it writes or starts
anything; every failure is a one-line ``SpecError`` naming the file and the field."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection
from importlib.util import find_spec
from pathlib import Path

from hybridflow.graph.dag import Graph
from hybridflow.rewards.remote import score_function_paths
from hybridflow.rewards.rule import load_rule
from hybridflow.spec.engines import caps_of
from hybridflow.spec.graph import PRETRAINED_KINDS
from hybridflow.spec.loading import SpecError

LM_ROLES = ("actor", "ref", "critic", "reward", "cost", "teacher")



def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def check_engines_installed(graph: Graph) -> None:
    """An engine whose optional package (its record's ``caps.package``) is missing or that
    needs CUDA on a CPU pool, or a
    ``train.compile`` without the C++ compiler inductor builds its CPU kernels with, stops the
    run here, in one line, instead of as an error inside a worker."""
    for name, model in graph.spec.models.items():
        if model.train.compiles and not shutil.which("g++") and not shutil.which("c++"):
            raise SpecError(
                graph.file, f"models.{name}.train.compile",
                "torch.compile needs a C++ compiler for its CPU kernels and none is on PATH "
                "(apt install g++), or set it to false",
            )
        wanted = [(f"models.{name}.train.engine", model.train)]
        if model.rollout is not None:
            wanted.append((f"models.{name}.rollout.engine", model.rollout))
        for field, section in wanted:
            caps = caps_of(section)
            pool = graph.rollout_pools.get(name, graph.placement[name]) if field.endswith("rollout.engine") else graph.placement[name]
            if caps.needs_cuda and graph.pools[pool].device != "gpu":
                raise SpecError(graph.file, field, f"{section.engine!r} runs on CUDA devices only; pool {pool!r} is a {graph.pools[pool].device} pool")
            if caps.package is not None and not _installed(caps.package):
                raise SpecError(
                    graph.file, field,
                    f"{section.engine!r} needs {caps.package}, which is not installed: {caps.install or 'install it'}",
                )


def _source_field(name: str, source) -> str:
    kind = next(k for k in PRETRAINED_KINDS if getattr(source, k) is not None)
    return f"models.{name}.source.{kind}"


def resolved_model_dir(graph: Graph, name: str) -> Path:
    """The HF directory of a pretrained model of the graph; a GGUF source is converted here,
    on the controller, once (workers then find the converted copy in the cache)."""
    from hybridflow.engines.models import ModelSourceError, model_dir

    source = graph.spec.models[name].source
    try:
        return Path(model_dir(source))
    except ModelSourceError as exc:
        raise SpecError(graph.file, _source_field(name, source), str(exc)) from None


def resolved_tokenizer_dir(graph: Graph, name: str) -> Path:
    """The directory of a pretrained model's tokenizer (a run's model: the run's)."""
    from hybridflow.engines.models import ModelSourceError, tokenizer_dir

    source = graph.spec.models[name].source
    try:
        return Path(tokenizer_dir(source))
    except ModelSourceError as exc:
        raise SpecError(graph.file, _source_field(name, source), str(exc)) from None


def tokenizer_owner(graph: Graph) -> str:
    """The model whose tokenizer is the run's: the actor, or in a graph without one (it trains
    scalar models on pairs) its first trained model."""
    return graph.actor or next(n.model for n in graph.nodes if graph.op(n).trains)


def run_tokenizer(graph: Graph):
    """The run's tokenizer: the actor's own (pretrained source), else the built-in task's. A
    graph without an actor (it trains scalar models on pairs) takes its first trained model's."""
    from hybridflow.data.tasks import TASKS

    name = tokenizer_owner(graph)
    if graph.spec.models[name].source.is_pretrained:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolved_tokenizer_dir(graph, name), local_files_only=True)
    source = graph.spec.data.source
    task = source.removeprefix("builtin:") if source.startswith("builtin:") else "copy"
    if task not in TASKS:
        raise SpecError(
            graph.file, f"models.{name}.source",
            f"data.source {source!r} needs a pretrained actor (path, gguf, package or run) for its "
            "tokenizer; a config-built model has only the character tasks' tokenizers",
        )
    return TASKS[task].tokenizer()


def check_model_paths(graph: Graph, names: Collection[str] | None = None) -> None:
    """Every pretrained source (of ``names``' models, default all) names a directory holding a
    readable HF ``config.json`` (a GGUF file is converted to one first)."""
    for name, model in graph.spec.models.items():
        if not model.source.is_pretrained or (names is not None and name not in names):
            continue
        field = _source_field(name, model.source)
        path = resolved_model_dir(graph, name)
        if not os.path.isdir(path):  # False, not OSError, for a name too long
            raise SpecError(graph.file, field, f"model directory {str(path)!r} not found")
        config = path / "config.json"
        if not config.is_file():
            raise SpecError(graph.file, field, f"{str(path)!r} is not a HF model directory (no config.json)")
        try:
            json.loads(config.read_text())
        except ValueError:
            raise SpecError(graph.file, field, f"{config} is not valid JSON") from None


def check_environments(graph: Graph, tokenizer) -> None:
    """Every multi-turn node's environment imports and builds from its ``env_kwargs``."""
    from hybridflow.envs.base import env_factory

    for i, node in enumerate(graph.spec.nodes):
        if not graph.ops[node.op].multi_turn:
            continue
        opts = node.options
        try:
            env = env_factory(opts.env, opts.env_kwargs)()
            env.use_tokenizer(tokenizer)
        except Exception as exc:  # noqa: BLE001 - whatever user code raises, one line
            field = "env" if isinstance(exc, ValueError) and "environment" in str(exc) else "env_kwargs"
            raise SpecError(graph.file, f"nodes[{i}].options.{field}", f"{type(exc).__name__}: {exc}") from None


def check_inputs(graph: Graph, tokenizer) -> None:
    """Reward functions import; path models fit the run's tokenizer (the actor's); multi-turn
    environments build."""
    check_environments(graph, tokenizer)
    for name, model in graph.spec.models.items():
        source = model.source
        rules = [(f"models.{name}.source.rule", source.rule)] if source.rule else []
        rules += [
            (f"models.{name}.source.compute_score", path)
            for _, path, _ in score_function_paths(source)
        ]
        if source.remote is not None:
            rules += [
                (f"models.{name}.source.remote.components[{i}].rule", c.rule)
                for i, c in enumerate(source.remote.components)
                if c.rule is not None
            ]
        for field, rule in rules:
            try:
                load_rule(rule)
            except ValueError as exc:
                raise SpecError(graph.file, field, str(exc)) from None
        if source.is_pretrained and model.role in LM_ROLES and name != tokenizer_owner(graph):
            _check_tokenizer_fits(graph, name, tokenizer)


def _describe(graph: Graph, name: str) -> str:
    """A model as a user named it: ``teacher (run runs/grpo_teacher)``."""
    source = graph.spec.models[name].source
    kind = next((k for k in PRETRAINED_KINDS if getattr(source, k) is not None), None)
    return f"{name} ({kind} {getattr(source, kind)})" if kind else f"{name} (config-built)"


def _check_tokenizer_fits(graph: Graph, name: str, tokenizer) -> None:
    """A model scoring the actor's tokens must read them as the actor's tokenizer wrote them;
    the one-line refusal names both models."""
    field = _source_field(name, graph.spec.models[name].source)
    path, tok_path = resolved_model_dir(graph, name), resolved_tokenizer_dir(graph, name)
    actor = _describe(graph, tokenizer_owner(graph))
    vocab_size = json.loads((path / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab_size, int) and vocab_size < len(tokenizer):
        raise SpecError(
            graph.file, field,
            f"{_describe(graph, name)} has vocab_size {vocab_size} < the {len(tokenizer)} tokens of "
            f"the tokenizer of {actor}; expected a model trained with the actor's tokenizer",
        )
    if (tok_path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        own = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
        if own.get_vocab() != tokenizer.get_vocab():
            raise SpecError(
                graph.file, field,
                f"the tokenizer of {_describe(graph, name)}, {len(own)} tokens, differs from the one "
                f"of {actor}, {len(tokenizer)} tokens; expected the same tokenizer",
            )


def check_score_inputs(graph: Graph, rows: list[dict]) -> None:
    """A rule, compute_score or remote scorer compares responses with the rows' ground truth:
    a row without one would score 0 silently, so it stops the run (``DataError``) unless the
    score node says ``ground_truth: optional``."""
    from hybridflow.data.datasets import check_ground_truth

    for node in graph.nodes:
        if not graph.op(node).scores or getattr(node.spec.options, "ground_truth", None) == "optional":
            continue
        if graph.spec.models[node.model].source.is_scorer:
            check_ground_truth(rows, f"expected one for score node {node.name!r} (model {node.model!r}); "
                               f"nodes.{node.name}.options.ground_truth: optional is for a scorer that needs none")
