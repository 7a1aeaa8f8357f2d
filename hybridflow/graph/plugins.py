"""A graph file's ``plugins``: modules imported before its nodes are read.

Importing a plugin registers its ops (``hybridflow.graph.ops.register_op``), so the graph's
nodes may name them and their options are validated like a built-in op's. A module is looked
for in the graph file's folder first, then on ``sys.path`` (``PYTHONPATH``), as
``compute_score`` functions are. The workers import the same modules, from the same folder,
before their first op (``hybridflow.workers.model_worker``).

Nothing here imports Ray, vLLM or megatron; a plugin that keeps its imports to the graph layer
(and torch) can be validated without them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from hybridflow.spec.graph import GraphSpec
from hybridflow.spec.loading import SpecError, apply_overrides, read_yaml, validate_model


def plugin_dir(graph_file: str | Path) -> str:
    """The folder a graph file's plugins are looked for in first ("" for a graph built in
    Python: its modules are found on ``sys.path`` only)."""
    path = Path(graph_file)
    return str(path.resolve().parent) if path.is_file() else ""


def import_plugins(modules: list[str], folder: str, file: str | Path = "<python graph>") -> None:
    """Import ``modules`` with ``folder`` first on ``sys.path``. A module that cannot be
    imported is a SpecError naming ``plugins[i]``."""
    if not modules:
        return
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    for i, name in enumerate(modules):
        if not isinstance(name, str) or not name or name.startswith("."):
            raise SpecError(file, f"plugins[{i}]", f"expected a module name, got {name!r}")
        try:
            importlib.import_module(name)
        except ImportError as exc:
            where = f"{folder} or PYTHONPATH" if folder else "PYTHONPATH"
            raise SpecError(file, f"plugins[{i}]", f"cannot import module {name!r} from {where} ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - the user's module: whatever it raises, one line
            raise SpecError(file, f"plugins[{i}]", f"importing {name!r} failed: {type(exc).__name__}: {exc}") from None


def load_graph_spec(path: str | Path, overrides: list[str] = ()) -> GraphSpec:
    """Read a graph file, apply ``overrides``, import its plugins and validate it (one-line
    SpecError on any mistake)."""
    raw = apply_overrides(read_yaml(path), list(overrides), path)
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list):
        raise SpecError(path, "plugins", f"expected a list of module names, got {type(plugins).__name__}")
    import_plugins(plugins, plugin_dir(path), path)
    return validate_model(GraphSpec, raw, path)
