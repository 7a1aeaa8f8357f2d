"""Reading graph and pool files: YAML, dotted command-line overrides, one-line errors."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from hybridflow.data.echo import ECHO_CHARS, shorten
from hybridflow.spec.engines import engine_names
from hybridflow.spec.graph import OtherEngineOption, node_types
from hybridflow.spec.pool import PoolsFile

M = TypeVar("M", bound=BaseModel)


# A run of characters without a space this long in an error line is a user value nobody cut
# where it was quoted (a 10,000-character override, path or module name).
_LONG_WORD = re.compile(r"\S{%d,}" % (ECHO_CHARS + 20))


def bounded(text: str) -> str:
    """``text`` on one line with every over-long word cut to ``ECHO_CHARS`` (data/echo.py)."""
    return _LONG_WORD.sub(lambda m: shorten(m.group(0)), text.replace("\n", " "))


class SpecError(ValueError):
    """A user mistake in an input file: ``FILE: field.path: what was expected``, one line.

    Any word of it longer than about ``ECHO_CHARS`` is cut, so a value that reached the message
    uncut (the file name and field path included) still gives a line a terminal shows whole.
    """

    def __init__(self, file: str | Path, field: str, message: str):
        self.file, self.field, self.message = str(file), field, message
        where = f"{self.file}: {field}: " if field else f"{self.file}: "
        super().__init__(bounded(where + message))


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not os.path.isfile(path):  # False, not OSError, for a name too long for the filesystem
        raise SpecError(path, "", "file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        raise SpecError(path, where, f"invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise SpecError(path, "", f"expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def _step(container: Any, part: str, path: str, create: bool) -> Any:
    """Index one dotted-path part into a dict or a list (by position or by a node's name)."""
    if isinstance(container, dict):
        if part not in container:
            if not create:
                raise KeyError(path)
            container[part] = {}
        return part
    if isinstance(container, list):
        if part.isdigit() and int(part) < len(container):
            return int(part)
        for i, item in enumerate(container):
            if isinstance(item, dict) and item.get("name") == part:
                return i
        raise KeyError(path)
    raise KeyError(path)


def _unshared(raw: Any) -> Any:
    """A copy of parsed YAML in which no two places share an object. A YAML alias (``source:
    *tiny``) loads as the anchor's own dict, and ``copy.deepcopy`` keeps such sharing: an
    override of one model's source would change every model that names the anchor."""
    if isinstance(raw, dict):
        return {key: _unshared(value) for key, value in raw.items()}
    if isinstance(raw, list):
        return [_unshared(value) for value in raw]
    return copy.deepcopy(raw)


_INDEX = re.compile(r"\[(\d+)\]")  # nodes[4] -> nodes.4


def apply_overrides(raw: dict, overrides: list[str], file: str | Path) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a copy of ``raw``.

    List items can be named by index, as ``nodes.4`` or as errors print them, ``nodes[4]``,
    or, for ``nodes``, by node name: ``nodes.update.options.kl_coef=0.01``.
    """
    raw = _unshared(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SpecError(file, shorten(item), "an override must look like a.b.c=value")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        parts = _INDEX.sub(r".\1", key).split(".")
        node: Any = raw
        try:
            for depth, part in enumerate(parts[:-1]):
                index = _step(node, part, ".".join(parts[: depth + 1]), create=True)
                if node[index] is None:
                    node[index] = {}
                node = node[index]
            last = _step(node, parts[-1], key, create=True)
        except KeyError as exc:
            raise SpecError(file, shorten(key), f"override path {shorten(repr(exc.args[0]))} does not exist") from None
        node[last] = value
    return raw


def _field_path(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in node_types() or _engine_tag(loc, i):
            continue  # discriminated-union tag, not a field the user wrote
        else:
            out += f".{part}" if out else str(part)
    return out


ENGINE_KINDS = ("train", "rollout")  # the model fields that are unions over registered engines


def _engine_tag(loc: tuple, i: int) -> bool:
    """``loc[i]`` is the engine tag pydantic puts after ``models.<m>.train`` / ``.rollout``."""
    return i >= 3 and loc[i - 3] == "models" and loc[i - 1] in ENGINE_KINDS and loc[i] in engine_names(loc[i - 1])


def validate_model(model: type[M], raw: dict, file: str | Path) -> M:
    """Build a spec model, turning the first pydantic error into a one-line SpecError."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        more = len(exc.errors()) - 1
        field = _field_path(err["loc"])
        if isinstance(err.get("ctx", {}).get("error"), OtherEngineOption):
            field += f".{err['ctx']['error'].key}"
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        elif err["type"] == "missing":
            message = "field required"
        else:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], (dict, list)):
                message += f" (got {shorten(repr(err['input']))})"
        if err["type"] == "union_tag_invalid" and err["loc"][-1] in ENGINE_KINDS:
            field += ".engine"
            message = f"unknown {err['loc'][-1]} engine {shorten(repr(err['ctx']['tag']))}; known: {', '.join(engine_names(err['loc'][-1]))}"
        elif err["type"] == "union_tag_invalid":
            message = f"unknown op {shorten(repr(err['ctx']['tag']))}; expected one of {err['ctx']['expected_tags']}"
        if more:
            message += f" (+{more} more error{'s' if more > 1 else ''})"
        raise SpecError(file, field, message) from None


def load_pools(path: str | Path) -> PoolsFile:
    return validate_model(PoolsFile, read_yaml(path), path)


def resolve_relative(path: str, graph_file: str | Path | None) -> Path:
    """A path as given if it exists from the current directory, else next to the graph file.

    Shipped graphs name ``resource_pools/local_cpu.yaml``; that must work from the repository
    root and from anywhere the graph file is given by path.
    """
    # os.path.exists: False, not OSError, for a name too long for the filesystem.
    candidate = Path(path)
    if candidate.is_absolute() or os.path.exists(candidate) or graph_file is None:
        return candidate
    beside = Path(graph_file).resolve().parent / path
    if os.path.exists(beside):
        return beside
    above = Path(graph_file).resolve().parent.parent / path  # graphs/../resource_pools
    return above if os.path.exists(above) else candidate
