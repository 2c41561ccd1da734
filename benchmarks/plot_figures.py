"""Draw figures.png from figures.json: the figures benchmarks/README.md shows.

figures.json is written by benchmarks/standard.py: one panel per benchmark entry (a vision
entry has two: images/s and TTFT), each entry a backend's median and min-max with its dtype,
thread binding, model and concurrency, so that the README's tables and the plot come from one
place. Panels are laid out four to a row.

    .venv/bin/pip install matplotlib
    .venv/bin/python benchmarks/plot_figures.py [FIGURES.json [OUT.png]]
"""
import json
import math
import sys
from pathlib import Path

from common import cpu_tag

HERE = Path(__file__).resolve().parent
COLORS = {"accel": "#3b7dd8", "native-default-binding": "#cccccc"}


def bars(ax, title, unit, entries):
    names = [e["name"] for e in entries]
    values = [e["median"] for e in entries]
    low = [e["median"] - e.get("min", e["median"]) for e in entries]
    high = [e.get("max", e["median"]) - e["median"] for e in entries]
    colors = [COLORS["accel"] if n.startswith("accel") else COLORS.get(n, "#999999")
              for n in names]
    ax.bar(names, values, yerr=[low, high], capsize=4, color=colors)
    ax.set_title(title, fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.tick_params(axis="y", labelsize=7)


def main(argv):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source = Path(argv[0]) if argv else HERE / "figures.json"
    target = Path(argv[1]) if len(argv) > 1 else source.with_suffix(".png")
    figures = json.loads(source.read_text())
    panels = [p for p in figures["panels"] if p["entries"]]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.4 * rows), squeeze=False)
    several_machines = len(figures.get("machines", [])) > 1
    for ax, panel in zip(axes.flat, panels):
        title = panel["title"]
        if several_machines and panel.get("machine"):  # figures of two CPUs do not compare
            title += f"\n{panel['machine']['cpu']}{cpu_tag(panel)}"
        bars(ax, title, panel["unit"], panel["entries"])
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    # The caption 0.1 in below the top, the panels from 0.4 in down: in inches, as
    # suptitle's default place (a fraction of the height) moves into a tall figure's first row.
    height = fig.get_figheight()
    fig.suptitle(figures["caption"], fontsize=9, y=1 - 0.1 / height, va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / height))
    fig.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
