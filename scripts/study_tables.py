"""Copy the study's tables from benchmarks/results/study/results.md into docs/study.md and README.md.

    python scripts/study_tables.py           # rewrite the marked tables from results.md
    python scripts/study_tables.py --check   # exit 1, naming the file and table, when one is out of date

`python -m lab.study` writes results.md from the saved runs; the pages hold copies of its tables between the markers
``<!-- study:NAME -->`` and ``<!-- /study:NAME -->`` (invisible in the rendered page), NAME one of:

    sweep          the step-size sweep (ExGRPO minus GRPO, paired by seed)       docs/study.md
    difficulty     the difficulty axis at the paper's step                       docs/study.md
    arm-pairs      the arms paired by seed at the paper-shaped point             docs/study.md
    hard-pairs     the same at the hard point                                    docs/study.md
    hard-diagnostics  what the hard point's generation batches were made of      docs/study.md
    noise          the evaluation noise of fixed models, one line                      docs/study.md
    regimes        the paper's run beside each setting                           docs/study.md
    paper-point    every arm at the paper-shaped point                           docs/study.md
    hard-point     every arm at the hard point                                   docs/study.md

and, from the registered study's benchmarks/results/confirm/analysis.md (`python -m lab.study --confirm
--report-only`):

    confirm-answer         the registered answer in the plan's words (not a table)    docs/study.md
    confirm-user           its answer for a user, both axes, Holm verdicts             docs/study.md, README.md
    confirm-primary        reuse_limit - grpo, the family of 8                        docs/study.md
    confirm-secondary      exgrpo - grpo and reuse_limit - exgrpo, the family of 16   docs/study.md
    confirm-concentration  exgrpo/replay/reuse per setting and arm                     docs/study.md
    confirm-reuse          what reuse can tell a user, read by the analysis's rule (one line)  docs/study.md

and, from the comparison of replay rules' benchmarks/results/policies/analysis.md (`python -m lab.study --policies
--report-only`), once the runs each one reads are in (analysis.json's complete_families):

    policies-answer        its registered answer, a family's bullets once its runs are in   docs/study.md
    policies-user          the recipe against GRPO for a user, both axes (primary)        docs/study.md
    policies-readme        the same as one row, a column a setting (primary)               README.md
    policies-primary       rollout_recipe - grpo, the family of 6                          docs/study.md
    policies-secondary     each rule alone - exgrpo at countdown-hard, the family of 4    docs/study.md
    policies-descriptive   AUC and rollout_recipe - exgrpo (all 39 runs)                  docs/study.md
    policies-profile       what was replayed: ages, groups, reuse (all 39 runs)           docs/study.md

A table whose runs are not in yet (the hard point's, while its runs train; the registered study's, until its
analysis is written) is copied as one line saying so.

Only the standard library is used.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "study" / "results.md"
CONFIRM = ROOT / "benchmarks" / "results" / "confirm" / "analysis.md"
PAPER_POINT = "countdown-paper-lr2.5e-5"  # lab.study.PAPER_POINT (tests check they agree)
HARD_POINT = "countdown-hard"  # lab.study.HARD_POINT
HEADINGS = {
    "sweep": "### Step-size sweep",
    "difficulty": "### Difficulty at the paper's step",
    "arm-pairs": f"### Arms paired by seed at {PAPER_POINT} ",
    "hard-pairs": f"### Arms paired by seed at {HARD_POINT} ",
    "hard-diagnostics": f"### Diagnostics at {HARD_POINT}:",
    "regimes": "### Regimes",
    "paper-point": f"### {PAPER_POINT}:",
    "hard-point": f"### {HARD_POINT}:",
}
NOISE = "Evaluation noise ("  # the line of results.md copied as "noise"
OPTIONAL = ("hard-pairs", "hard-diagnostics", "hard-point")  # their runs may not be in yet
NOT_YET = "_Not in yet: its runs are training._"
CONFIRM_ANSWER = "## The registered answer"  # a list of sentences, copied as it stands
CONFIRM_REUSE = "ExGRPO's `exgrpo/replay/reuse`, median"  # the line of analysis.md copied as "confirm-reuse"
CONFIRM_HEADINGS = {
    "confirm-user": "## For a user:",
    "confirm-primary": "## Primary:",
    "confirm-secondary": "## Secondary:",
    "confirm-concentration": "## Concentration of replay",
}
POLICIES = ROOT / "benchmarks" / "results" / "policies"
POLICIES_SECTIONS = {  # name: (analysis.md's heading, the families whose runs it needs)
    "policies-answer": ("## The registered answer", ("primary",)),
    "policies-user": ("## For a user:", ("primary",)),
    "policies-readme": ("## For the README: one row", ("primary",)),
    "policies-primary": ("## Primary:", ("primary",)),
    "policies-secondary": ("## Secondary, exploratory:", ("primary", "secondary")),
    "policies-descriptive": ("## Descriptive (no test):", ("primary", "secondary")),
    "policies-profile": ("## What was replayed", ("primary", "secondary")),
}
POLICIES_NOT_YET = "_Not in yet: the registered runs this reads are training._"
CONFIRM_NOT_YET = "_Not in yet: the registered runs are training; the analysis is written when all 60 are in._"
PAGES = {
    "docs/study.md": ("sweep", "noise", "difficulty", "arm-pairs", "hard-pairs", "hard-diagnostics", "regimes",
                      "paper-point", "hard-point", "confirm-answer", *CONFIRM_HEADINGS, "confirm-reuse",
                      *(n for n in POLICIES_SECTIONS if n != "policies-readme")),
    "README.md": ("user", "policies-readme"),  # confirm-user's table, the recipe's row
}  # fmt: skip


def table_after(report: str, heading: str, source: Path = RESULTS) -> str:
    """The first markdown table after `heading` in `source` (results.md, or the registered study's analysis.md)."""
    start = report.find(heading)
    if start < 0:
        raise SystemExit(f"study_tables: {source.name} has no section {heading!r} (run `python -m lab.study` first)")
    section = report[start:]
    return section[section.index("\n| ") + 1 :].split("\n\n")[0].rstrip("\n")


def section_after(report: str, heading: str, study: str = "--confirm") -> str:
    """The text of an analysis.md's section whose heading line starts with `heading`, up to the next "## "."""
    found = re.search(rf"^{re.escape(heading)}.*\n", report, re.M)
    if found is None:
        raise SystemExit(f"study_tables: the {study[2:]} analysis.md has no section {heading!r} (run `python -m "
                         f"lab.study {study} --report-only` first)")  # fmt: skip
    return report[found.end() :].split("\n## ")[0].strip("\n")


def policies_tables() -> dict[str, str]:
    """The comparison of replay rules' sections, each once the families whose runs it reads are complete."""
    analysis, payload = POLICIES / "analysis.md", POLICIES / "analysis.json"
    if not analysis.is_file() or not payload.is_file():
        return dict.fromkeys(POLICIES_SECTIONS, POLICIES_NOT_YET)
    report, done = analysis.read_text(), set(json.loads(payload.read_text()).get("complete_families", ()))
    tables = {}
    for name, (heading, needs) in POLICIES_SECTIONS.items():
        text = section_after(report, heading, "--policies")
        if name == "policies-answer":  # the bullets of the complete families, not the lines saying what comes later
            text = "\n".join(line for line in text.splitlines() if not line.startswith("- Written later"))
        elif name == "policies-user":  # the table, without the notes below it
            text = text.split("\n\n")[0]
        tables[name] = text if set(needs) <= done else POLICIES_NOT_YET
    return tables


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
    tables = {
        name: table_after(report, heading) if name not in OPTIONAL or heading in report else NOT_YET
        for name, heading in HEADINGS.items()
    }
    tables["noise"] = next(line for line in report.splitlines() if line.startswith(NOISE))
    confirm = CONFIRM.read_text() if CONFIRM.is_file() else None
    for name, heading in CONFIRM_HEADINGS.items():
        tables[name] = table_after(confirm, heading, CONFIRM) if confirm else CONFIRM_NOT_YET
    tables["confirm-answer"] = section_after(confirm, CONFIRM_ANSWER) if confirm else CONFIRM_NOT_YET
    reuse = [line for line in (confirm or "").splitlines() if line.startswith(CONFIRM_REUSE)]
    tables["confirm-reuse"] = reuse[0] if reuse else CONFIRM_NOT_YET
    tables["user"] = tables["confirm-user"]  # the README's answer for a user is the registered one
    tables.update(policies_tables())
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
