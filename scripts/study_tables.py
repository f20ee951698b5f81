"""Copy the study's tables from benchmarks/results/study/results.md into docs/study.md and README.md.

    python scripts/study_tables.py           # rewrite the marked tables from results.md
    python scripts/study_tables.py --check   # exit 1, naming the file and table, when one is out of date

`exgrpo study` writes results.md from the saved runs; the pages hold copies of its tables between the markers
``<!-- study:NAME -->`` and ``<!-- /study:NAME -->`` (invisible in the rendered page), NAME one of:

    sweep          the step-size sweep (ExGRPO minus GRPO, paired by seed)       docs/study.md
    sweep-short    its columns setting, step size, updates, differences, seeds   README.md
    regimes        the paper's run beside each setting                           docs/study.md
    paper-point    every arm at the paper-shaped point                           docs/study.md

Only the standard library is used.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "study" / "results.md"
PAPER_POINT = "countdown-paper-lr2.5e-5"  # exgrpo_trl.cli.study.PAPER_POINT (tests check they agree)
HEADINGS = {
    "sweep": "### Step-size sweep",
    "regimes": "### Regimes",
    "paper-point": f"### {PAPER_POINT}:",
}
PAGES = {"docs/study.md": ("sweep", "regimes", "paper-point"), "README.md": ("sweep-short",)}
SHORT = (0, 1, 3, 6, 7, 8)  # of the sweep table's columns: the README's front page keeps it under 1,000 words


def columns(table: str, keep: tuple[int, ...]) -> str:
    """The table with only the columns `keep` (0-based)."""
    header, _, *rows = table.splitlines()
    out = []
    for i, line in enumerate([header, *rows]):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out.append("| " + " | ".join(cells[k] for k in keep) + " |")
        if i == 0:
            out.append("|" + "---|" * len(keep))
    return "\n".join(out)


def table_after(report: str, heading: str) -> str:
    """The first markdown table after `heading` in results.md."""
    start = report.find(heading)
    if start < 0:
        raise SystemExit(f"study_tables: {RESULTS.name} has no section {heading!r} (run `exgrpo study` first)")
    section = report[start:]
    return section[section.index("\n| ") + 1 :].split("\n\n")[0].rstrip("\n")


def refresh(page: str, tables: dict[str, str], names: tuple[str, ...], where: str) -> str:
    for name in names:
        pattern = re.compile(rf"(<!-- study:{name} -->\n)(.*?)(<!-- /study:{name} -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"study_tables: {where} has no <!-- study:{name} --> ... <!-- /study:{name} --> markers")
        table = tables[name]
        page = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(3), page)
    return page


def main(argv: list[str]) -> int:
    check = "--check" in argv
    report = RESULTS.read_text()
    tables = {name: table_after(report, heading) for name, heading in HEADINGS.items()}
    tables["sweep-short"] = columns(tables["sweep"], SHORT)
    stale = []
    for rel, names in PAGES.items():
        path = ROOT / rel
        old = path.read_text()
        new = refresh(old, tables, names, rel)
        if new != old:
            stale.append(rel)
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"study_tables: {', '.join(stale)} out of date with {RESULTS.relative_to(ROOT)}: run "
              "python scripts/study_tables.py")  # fmt: skip
        return 1
    print(f"study_tables: {'rewrote ' + ', '.join(stale) if stale else 'all tables up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
