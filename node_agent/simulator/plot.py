"""The figure: GPUs held over time per policy, beside the GPUs in use (matplotlib, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from node_agent.simulator.metrics import Result


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _steps(result: Result, index: int) -> tuple[list[float], list[float]]:
    hours = [(t - result.start) / 3600 for t, *_ in result.series]
    values = [float(point[index]) for point in result.series]
    # Extend the last step to the end of the horizon.
    return [*hours, result.hours], [*values, values[-1]]


def write_plot(panels: Sequence[tuple[str, Sequence[Result]]], path: Path) -> Path:
    """One panel per (title, results); each a step line of GPUs held per result, and the GPUs
    that the first result's cells and jobs used, dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "the figure needs matplotlib, which is not installed: pip install matplotlib "
            "(or pass --no-plot)") from None
    panels = [(title, results) for title, results in panels if results]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
    for ax, (title, results) in zip(axes[:, 0], panels, strict=True):
        for n, result in enumerate(results):
            if result.series:
                # Earlier lines thicker: policies that hold the same GPUs stay visible on each other.
                width = 1.0 + 0.6 * (len(results) - 1 - n)
                ax.step(*_steps(result, 1), where="post", label=result.policy, linewidth=width)
        first = next((r for r in results if r.series), None)
        if first is not None:
            ax.step(*_steps(first, 2), where="post", label=f"in use ({first.policy})", color="black",
                    linestyle="--", linewidth=1.0)
        ax.set_title(title)
        ax.set_xlabel("hours since the first session")
        ax.set_ylabel("GPUs held")
        ax.set_xlim(0, max(r.hours for r in results))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=3, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
