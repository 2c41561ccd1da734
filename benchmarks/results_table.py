#!/usr/bin/env python3
"""The headline results of benchmarks/figures.json as one markdown table.

figures.json (written by benchmarks/standard.py) holds one panel per standard-set entry and
machine record (the CPU's name, vector extensions, and family/model/stepping where recorded).
The headline rows are the standard set's text entries at their token-bucket concurrency
(tiny, medium and 128m, float32 and bfloat16; not the 128m-40 variant) and its full-size
vision tower entries (images/s), each against its headline peer (native: vLLM's CPU backend
at equal cores). For each entry and each CPU (its name and vector extensions, which decide
whether figures compare: standard.py's machines_of) the newest panel is taken; the machine
column names that panel's CPU with its family and model where recorded. --all prints every
panel instead (every machine record, every entry; TTFT panels left out).

    python benchmarks/results_table.py                      # print the table
    python benchmarks/results_table.py --check README.md    # compare with README.md's copy

--check compares the table between the lines `<!-- results:begin -->` and
`<!-- results:end -->` of the file with the one this script prints: exit 0 if equal, 1 if
they differ (a diff on stderr), 2 if the markers are missing. Standard library only.
"""
import argparse
import difflib
import json
import sys
from pathlib import Path

FIGURES = Path(__file__).resolve().parent / "figures.json"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# The standard set's headline entries, in its order (standard.py's entries()).
HEADLINE_ENTRIES = (
    "tiny-float32", "tiny-bfloat16", "medium-float32", "medium-bfloat16",
    "128m-float32", "128m-bfloat16",
    "vision-molmo-full", "vision-llava_next-full", "vision-qwen2_5_vl-full",
)
HEADER = ["workload", "dtype", "machine", "vllm-accel", "peer", "peer's figure",
          "ratio", "date"]


def is_ttft(panel):
    return panel.get("id", "").endswith("-ttft")


def cpu_kind(panel):
    """The CPU a panel's figures belong to: its name and vector extensions."""
    m = panel.get("machine") or {}
    return m.get("cpu", "unknown CPU"), m.get("isa", "")


def machine_label(panel):
    """'<cpu> (<widest extension>, family F model M)', or '..., model not recorded)'; the
    CPU's name without its trademarks and the word 'Processor'."""
    m = panel.get("machine") or {}
    cpu, isa = cpu_kind(panel)
    cpu = " ".join(cpu.replace("(R)", "").replace("(TM)", "").replace(" Processor", "").split())
    widest = isa.split(", ")[-1] if isa else "ISA not recorded"
    if "family" in m and "model" in m:
        ident = f"family {m['family']} model {m['model']}"
    else:
        ident = "model not recorded"
    return f"{cpu} ({widest}, {ident})"


def peer_of(panel):
    """The headline peer of a panel: the vision panels name it, throughput's is native."""
    return panel.get("headline_peer") or "native"


def medians(panel):
    return {e["name"]: e["median"] for e in panel.get("entries", []) if "median" in e}


def workload(panel):
    first = panel["title"].split("\n")[0]
    return first.removesuffix(f", {panel['dtype']}")


def newest(panels, key):
    """The newest panel for each key(panel), by date (a panel that records the CPU's family
    and model wins a tie), in first-seen order of the keys."""
    best = {}
    for p in panels:
        k = key(p)
        rank = (p.get("date", ""), "family" in (p.get("machine") or {}))
        if k not in best or rank > best[k][0]:
            best[k] = (rank, p)
    return [p for _, p in best.values()]


def select(figures, every=False):
    """The panels the table shows, grouped by CPU (newest CPU first), in the standard order."""
    panels = [p for p in figures.get("panels", []) if p.get("entry") and not is_ttft(p)
              and peer_of(p) in medians(p) and "accel" in medians(p)]
    if every:
        chosen = panels
        group = lambda p: (cpu_kind(p), machine_label(p))  # noqa: E731
    else:
        chosen = newest([p for p in panels if p["entry"] in HEADLINE_ENTRIES],
                        key=lambda p: (p["entry"], cpu_kind(p)))
        group = cpu_kind
    # the standard order (figures.json's, standard.py's entries())
    order = {}
    for p in figures["panels"]:
        order.setdefault(p["entry"], len(order))
    chosen = sorted(chosen, key=lambda p: order[p["entry"]])
    latest = {}
    for p in chosen:
        latest[group(p)] = max(latest.get(group(p), ""), p["date"])
    # stable: the standard order holds within each CPU
    return sorted(chosen, key=lambda p: (latest[group(p)], group(p)), reverse=True)


def number(value, unit):
    """A median as figures.json holds it: images/s to 2 decimals, the others to 1."""
    return f"{value:,.{2 if unit == 'images/s' else 1}f}"


def ratio(panel):
    """vllm-accel's median over its peer's (figures.json's ratio of medians)."""
    m = medians(panel)
    return m["accel"] / m[peer_of(panel)]


def table(figures, every=False):
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    for p in select(figures, every):
        m, peer = medians(p), peer_of(p)
        label = "native (equal cores)" if peer == "native" else peer
        lines.append("| " + " | ".join([
            workload(p), p["dtype"], machine_label(p), f"{number(m['accel'], p['unit'])} {p['unit']}",
            label, f"{number(m[peer], p['unit'])} {p['unit']}", f"{ratio(p):.2f}", p["date"][:10],
        ]) + " |")
    return "\n".join(lines) + "\n"


def between_markers(text):
    """The text between the markers, or None where either is missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0 or end < start:
        return None
    return text[start + len(BEGIN):end]


def normalise(block):
    return [line.rstrip() for line in block.strip().splitlines()]


def check(path, expected):
    found = between_markers(Path(path).read_text())
    if found is None:
        print(f"{path}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    have, want = normalise(found), normalise(expected)
    if have == want:
        return 0
    sys.stderr.writelines(line + "\n" for line in difflib.unified_diff(
        have, want, f"{path} (between the markers)", "benchmarks/results_table.py",
        lineterm=""))
    return 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--figures", default=str(FIGURES), help="figures JSON (standard.py's)")
    p.add_argument("--check", metavar="FILE",
                   help="exit 1 if FILE's table between the markers differs, 2 if no markers")
    p.add_argument("--all", action="store_true",
                   help="every panel of every machine record, not only the headline")
    opts = p.parse_args(argv)
    text = table(json.loads(Path(opts.figures).read_text()), every=opts.all)
    if opts.check:
        return check(opts.check, text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
