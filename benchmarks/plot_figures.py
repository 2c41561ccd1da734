"""Draw figures.png from figures.json: the figures benchmarks/README.md shows.

figures.json holds the medians and min-max that the benchmark runs printed
(copied by hand from their output, with the date and command of each run), so
that the README's tables and the plot come from one place.

    .venv/bin/pip install matplotlib
    .venv/bin/python benchmarks/plot_figures.py
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def bars(ax, title, unit, entries):
    names = [e["name"] for e in entries]
    values = [e["median"] for e in entries]
    low = [e["median"] - e.get("min", e["median"]) for e in entries]
    high = [e.get("max", e["median"]) - e["median"] for e in entries]
    colors = ["#3b7dd8" if n.startswith("accel") else "#999999" for n in names]
    ax.bar(names, values, yerr=[low, high], capsize=4, color=colors)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.tick_params(axis="y", labelsize=7)


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = json.loads((HERE / "figures.json").read_text())
    panels = figures["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4))
    for ax, panel in zip(axes, panels):
        bars(ax, panel["title"], panel["unit"], panel["entries"])
    fig.suptitle(figures["caption"], fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "figures.png", dpi=110)
    print(f"wrote {HERE / 'figures.png'}")


if __name__ == "__main__":
    main()
