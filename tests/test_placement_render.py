"""`hybridflow graph FILE --out dag.png`: the picture is drawn from the real graph object."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def _colours(path: Path) -> set[tuple[int, int, int]]:
    image = pytest.importorskip("matplotlib.image").imread(path)
    pixels = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(p) for p in pixels.tolist()}


def test_graph_out_draws_nodes_coloured_by_pool(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    split, single = tmp_path / "split.png", tmp_path / "single.png"
    assert main(["graph", str(ROOT / "graphs/grpo_split.yaml"), "--out", str(split)]) == 0
    assert main(["graph", str(ROOT / "graphs/grpo.yaml"), "--out", str(single)]) == 0
    assert f"wrote {split}" in capsys.readouterr().out
    assert split.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    blue, orange = (31, 119, 180), (255, 127, 14)  # tab10 colours of the first two pools
    assert {blue, orange} <= _colours(split)  # two pools, two colours
    assert blue in _colours(single) and orange not in _colours(single)


def test_graph_out_follows_overrides(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "dag.png"
    # Moving ref and reward onto the actor's pool leaves one pool, one colour.
    assert main(["graph", str(ROOT / "graphs/grpo_split.yaml"), "placement.reward=actor",
                 "placement.ref=actor", "--out", str(out)]) == 0
    assert (31, 119, 180) in _colours(out) and (255, 127, 14) not in _colours(out)
