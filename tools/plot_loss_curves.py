"""Plots the loss curves of several runs into one PNG.

    python tools/plot_loss_curves.py runs/eager/metrics.jsonl runs/graphs/metrics.jsonl \\
        --labels eager graphs --output loss.png

Inputs are ``--metrics-file`` JSONL files or golden JSON files (see
``compare_loss_curves.py``). With two or more runs a second panel shows each run's
difference from the first, which is where "identical" and "almost identical" part.
Needs matplotlib (an optional dependency; the Agg backend, so no display is needed).
"""

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_loss_curves import DEFAULT_METRIC, load_curve  # noqa: E402


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "error: plot_loss_curves.py needs matplotlib, an optional dependency: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    return plt


def plot(paths: Sequence[str], output: str, *, labels: Sequence[str] | None = None, metric: str = DEFAULT_METRIC,
         title: str | None = None, log_y: bool = False) -> str:  # fmt: skip
    """Writes a PNG of ``metric`` for every run in ``paths``; returns ``output``.

    Raises:
        ValueError: Labels do not match the runs, or a file has no ``metric``.
    """
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels has {len(labels)} names for {len(paths)} runs.")
    labels = (
        list(labels)
        if labels is not None
        else [os.path.basename(os.path.dirname(os.path.abspath(p))) or p for p in paths]
    )
    curves = [load_curve(p, metric) for p in paths]
    plt = _pyplot()
    panels = 2 if len(curves) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 4.5 * panels), squeeze=False, sharex=True)
    ax = axes[0][0]
    for label, curve in zip(labels, curves):
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], label=label, linewidth=1.2)
    ax.set_ylabel(metric)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title or metric)
    ax.grid(alpha=0.3)
    ax.legend()
    if panels == 2:
        base = curves[0]
        diff_ax = axes[1][0]
        for label, curve in zip(labels[1:], curves[1:]):
            steps = sorted(set(base) & set(curve))
            diff_ax.plot(steps, [curve[s] - base[s] for s in steps], label=f"{label} - {labels[0]}", linewidth=1.0)
        diff_ax.axhline(0.0, color="black", linewidth=0.5)
        diff_ax.set_ylabel(f"difference from {labels[0]}")
        diff_ax.grid(alpha=0.3)
        diff_ax.legend()
    axes[-1][0].set_xlabel("iteration")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss curves of several runs into a PNG.")
    parser.add_argument("runs", nargs="+", help="--metrics-file JSONL or golden_values.json files.")
    parser.add_argument("--output", "-o", required=True, help="PNG file to write.")
    parser.add_argument("--labels", nargs="+", help="One label per run (default: the run's folder name).")
    parser.add_argument("--metric", default=DEFAULT_METRIC, help=f"Metric to plot (default {DEFAULT_METRIC!r}).")
    parser.add_argument("--title", help="Plot title (default: the metric).")
    parser.add_argument("--log-y", action="store_true", help="Logarithmic y axis.")
    args = parser.parse_args(argv)
    try:
        path = plot(args.runs, args.output, labels=args.labels, metric=args.metric, title=args.title, log_y=args.log_y)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
