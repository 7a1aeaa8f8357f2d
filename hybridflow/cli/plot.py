"""``hybridflow plot RUN_DIR [RUN_DIR ...]``: a run's metrics over iterations, as one PNG.

Panels: reward (training mean, and greedy validation where logged), KL to the reference, actor
entropy, mean response length, and the wall time of every node. Several run directories overlay
in one figure (one colour per run) to compare them. Reads only ``metrics.jsonl``.

``--x wall`` puts wall-clock seconds since the run's first iteration began on the x axis
instead of the iteration (``timing/wall_s``; rows of runs logged before that metric existed fall
back to the sum of ``timing/iteration`` so far, which leaves out validation): two algorithms
compared by what they cost, not by their step counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.spec.loading import SpecError

# (panel title, [(metric, line style, label suffix)])
PANELS = [
    ("reward", [("reward/mean", "-", "train"), ("val/reward/mean", "--", "val (greedy)")]),
    ("KL(actor || ref)", [("actor/kl", "-", "")]),
    ("entropy", [("actor/entropy", "-", "")]),
    ("response length", [("response_length/mean", "-", "")]),
]
NODE_STYLES = ["-", "--", ":", "-."]
SKIPPED_TIMINGS = ("timing/iteration", "timing/wall_s")  # whole-iteration and run clocks, not nodes


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl``; SpecError (one line) when missing or empty."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SpecError(run_dir, "", "no metrics.jsonl here; give a run directory (see --run-dir)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise SpecError(path, f"line {number}", "not a JSON object") from None
    if not rows:
        raise SpecError(path, "", "no iterations logged yet")
    return rows


def _labels(run_dirs: list[Path]) -> list[str]:
    """Shortest distinct labels: the directory name, with its parent where names repeat."""
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in run_dirs]


X_AXES = {"iteration": "iteration", "wall": "wall time (s)"}


def _x_values(rows: list[dict], x: str) -> list[float]:
    if x == "iteration":
        return [int(row.get("iteration", i)) for i, row in enumerate(rows, start=1)]
    xs, elapsed = [], 0.0
    for row in rows:
        elapsed += float(row.get("timing/iteration", 0.0))
        xs.append(float(row.get("timing/wall_s", elapsed)))
    return xs


def _series(rows: list[dict], key: str, x: str = "iteration") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for x_value, row in zip(_x_values(rows, x), rows):
        if key in row:
            xs.append(x_value)
            ys.append(float(row[key]))
    return xs, ys


def plot_runs(run_dirs: list[str | Path], out: str | Path, x: str = "iteration") -> Path:
    """Draw the runs' metrics into ``out`` (PNG) against ``x`` (``X_AXES``); returns the path
    written."""
    if x not in X_AXES:
        raise SpecError("hybridflow plot", "--x", f"expected one of {sorted(X_AXES)}, got {x!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise SpecError("hybridflow plot", "", "matplotlib is not installed; pip install -e '.[plot]'") from None
    run_dirs = [Path(p) for p in run_dirs]
    runs = [read_metrics(p) for p in run_dirs]
    labels = _labels(run_dirs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (title, metrics) in zip(axes.flat, PANELS):
        for run_index, (rows, label) in enumerate(zip(runs, labels)):
            for key, style, suffix in metrics:
                xs, ys = _series(rows, key, x)
                if xs:
                    name = " ".join(part for part in (label, suffix) if part)
                    ax.plot(xs, ys, style, color=colours[run_index % len(colours)], label=name, marker="." if len(xs) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel(X_AXES[x])
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)

    timing = axes.flat[len(PANELS)]
    # One colour per node name across runs, one line style per run.
    all_nodes = sorted({k for rows in runs for row in rows for k in row if k.startswith("timing/")} - set(SKIPPED_TIMINGS))
    for run_index, (rows, label) in enumerate(zip(runs, labels)):
        nodes = sorted({k for row in rows for k in row if k in all_nodes})
        for key in nodes:
            xs, ys = _series(rows, key, x)
            timing.plot(
                xs, ys, NODE_STYLES[run_index % len(NODE_STYLES)], color=colours[all_nodes.index(key) % len(colours)],
                label=f"{label} {key.removeprefix('timing/')}" if len(runs) > 1 else key.removeprefix("timing/"),
            )
    timing.set_title("time per node (s)")
    timing.set_xlabel(X_AXES[x])
    if timing.lines:
        timing.legend(fontsize="x-small", ncol=2)

    if x == "iteration":
        for ax in axes.flat:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    summary = axes.flat[len(PANELS) + 1]
    summary.axis("off")
    text = []
    for rows, label in zip(runs, labels):
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        iteration_s = [r["timing/iteration"] for r in rows if "timing/iteration" in r]
        text.append(f"{label}: {len(rows)} iterations")
        if rewards:
            text.append(f"  reward first {rewards[0]:.3f}  last {rewards[-1]:.3f}  max {max(rewards):.3f}")
        if iteration_s:
            text.append(f"  {sum(iteration_s) / len(iteration_s):.2f} s per iteration")
    summary.text(0.0, 1.0, "\n".join(text), va="top", family="monospace", fontsize="small")

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def default_out(run_dirs: list[str | Path]) -> Path:
    """``RUN_DIR/plot.png`` for one run, ``compare.png`` here for several."""
    return Path(run_dirs[0]) / "plot.png" if len(run_dirs) == 1 else Path("compare.png")
