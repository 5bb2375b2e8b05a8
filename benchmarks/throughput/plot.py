"""The PNG (docs/benchmarks.png), drawn with matplotlib (the ``bench`` extra)."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.throughput.stats import summarize
from benchmarks.throughput.targets import measured_modes
from benchmarks.throughput.workloads import LABELS, VARIANTS, VLLM_VARIANTS


def plot(results: dict, path: Path) -> None:
    """The PNG: throughput per model and mode (median, min-max whiskers), vLLM
    start-up per variant, and convert wall time per model type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "generated": "#2b8a3e",
        "native": "#1c7ed6",
        "transformers": "#f08c00",
        "hf": "#868e96",
    }
    models = [
        (k, {mode: mres for kk, mode, mres in measured_modes(results) if kk == k})
        for k in results.get("models", {})
    ]
    models = [(k, modes) for k, modes in models if modes]
    conv = (results.get("convert") or {}).get("types", {})
    ncols = max(2, len(models))
    fig, grid = plt.subplots(2, ncols, figsize=(6.4 * ncols, 9.0), squeeze=False)
    axes = list(grid[0][: len(models)]) + [grid[1][0], grid[1][1]]
    for ax in list(grid[0][len(models) :]) + list(grid[1][2:]):
        ax.axis("off")
    for ax, (key, modes) in zip(axes, models):
        width = 0.8 / len(VARIANTS)
        for i, n in enumerate(VARIANTS):
            xs, ys, lo, hi = [], [], [], []
            for j, mres in enumerate(modes.values()):
                s = mres["variants"].get(n, {}).get("throughput")
                if s and s.get("median") is not None:
                    xs.append(j + (i - (len(VARIANTS) - 1) / 2) * width)
                    ys.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            if xs:
                ax.bar(
                    xs,
                    ys,
                    width,
                    yerr=[lo, hi],
                    capsize=3,
                    label=LABELS[n],
                    color=colors[n],
                )
                for x, y in zip(xs, ys):
                    ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(list(modes))
        ax.set_ylabel("output tokens/s (median, min-max)")
        ax.set_title(f"{key}: throughput")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend
        ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax = axes[len(models)]
    labels, vals, cols = [], [], []
    for key, modes in models:
        for mode, mres in modes.items():
            for n in VLLM_VARIANTS:
                su = mres["variants"].get(n, {}).get("startup_s")
                if su:
                    labels.append(f"{key} {mode} {n}")
                    vals.append(statistics.median(su))
                    cols.append(colors[n])
    if vals:
        ax.barh(range(len(vals)), vals, color=cols)
        ax.set_yticks(range(len(vals)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
    ax.set_xlabel("LLM() start-up, s (median)")
    ax.set_title("vLLM start-up")
    if not conv:
        axes[-1].axis("off")
    else:
        ax = axes[-1]
        names = list(conv)
        meds = [summarize(conv[t]["samples"])["median"] or 0 for t in names]
        ax.barh(range(len(names)), meds, color="#2b8a3e")
        base = summarize(results["convert"].get("import_baseline_s", []))["median"]
        if base:
            ax.axvline(base, color="k", ls="--", lw=1)
            ax.text(base, len(names) - 0.5, " import torch,\n transformers", fontsize=7)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        for y, v in enumerate(meds):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
        ax.set_xlabel("hfrewrite convert wall time, s")
        ax.set_title("convert")
    quick = " (--quick smoke run)" if results.get("meta", {}).get("quick") else ""
    fig.suptitle("hfrewrite benchmarks" + quick, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
