"""benchmarks/results_table.py on the real benchmarks/figures.json: one markdown table of the
headline figures, and --check against a README's copy between the markers."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "results_table.py"
FIGURES = ROOT / "benchmarks" / "figures.json"


def load_script():
    spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed_table(rt, capsys):
    assert rt.main(["--figures", str(FIGURES)]) == 0
    return capsys.readouterr().out


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_table_has_a_header_a_row_per_machine_and_ratios_of_its_figures(capsys):
    rt = load_script()
    lines = printed_table(rt, capsys).splitlines()
    header = cells(lines[0])
    assert header == ["workload", "dtype", "machine", "vllm-accel", "peer", "peer's figure",
                      "ratio", "date"]
    assert set(lines[1].replace("|", "").split()) == {"---"}
    rows = [dict(zip(header, cells(line))) for line in lines[2:]]
    assert 1 <= len(rows) <= 18  # headline entries only

    # The newest panel of each headline entry on each CPU (name and vector extensions),
    # found here from the JSON directly: each is a row, so every machine of them has one.
    figures = json.loads(FIGURES.read_text())
    newest = {}
    for p in figures["panels"]:
        if p.get("entry") in rt.HEADLINE_ENTRIES and not p["id"].endswith("-ttft"):
            key = (p["entry"], p["machine"]["cpu"], p["machine"]["isa"])
            if key not in newest or p["date"] > newest[key]["date"]:
                newest[key] = p
    assert newest
    for p in newest.values():
        assert any(r["machine"] == rt.machine_label(p) and r["dtype"] == p["dtype"]
                   and r["date"] == p["date"][:10] for r in rows), p["id"]
    machines = {rt.machine_label(p) for p in newest.values()}
    assert machines <= {r["machine"] for r in rows}
    assert len({(p["machine"]["cpu"], p["machine"]["isa"]) for p in newest.values()}) >= 2

    for r in rows:
        ours = float(r["vllm-accel"].split()[0].replace(",", ""))
        peer = float(r["peer's figure"].split()[0].replace(",", ""))
        assert r["ratio"] == f"{ours / peer:.2f}", r
        assert r["peer"].startswith("native")


def test_check_compares_the_table_between_the_markers(capsys, tmp_path):
    rt = load_script()
    table = printed_table(rt, capsys)
    good = tmp_path / "README.md"
    good.write_text(f"# Results\n\n{rt.BEGIN}\n{table}{rt.END}\n\nMore text.\n")
    assert rt.main(["--figures", str(FIGURES), "--check", str(good)]) == 0

    row = table.splitlines()[2]
    ratio = cells(row)[6]
    tampered = tmp_path / "tampered.md"
    tampered.write_text(good.read_text().replace(
        row, row.replace(f"| {ratio} |", f"| {float(ratio) + 0.01:.2f} |")))
    assert tampered.read_text() != good.read_text()
    assert rt.main(["--figures", str(FIGURES), "--check", str(tampered)]) == 1

    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text(table)
    assert rt.main(["--figures", str(FIGURES), "--check", str(unmarked)]) == 2


def test_the_readmes_tables_are_current():
    """The root README's and the results page's tables are what the script
    makes of figures.json now: regenerate them when a figure lands."""
    rt = load_script()
    for readme in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        assert rt.main(["--figures", str(FIGURES), "--check", str(readme)]) == 0, readme
