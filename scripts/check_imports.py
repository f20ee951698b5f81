"""Check the package's import graph: no circles, and every import goes down the layers.

    python scripts/check_imports.py            # exit 0 and one summary line, or exit 1 and one line per problem

Layers, bottom to top (a module may import its own layer and the layers below it):

    algorithm   exgrpo_trl/*.py         settings, config, buffer, replay, draw, loss, scoring, state_file,
                                        training_state, run, card, trainer
    utils       exgrpo_trl/utils/       helpers the applications share (tokenizer loading, Hub push, plots)
    tasks       exgrpo_trl/tasks/       training data and rewards (math), the CPU quick start's toy task
    eval        exgrpo_trl/eval/        benchmarks, grading, generators, reports, the in-training callback
    cli         exgrpo_trl/cli/         the `exgrpo` command and its subcommands

Also: the pure modules (`PURE`) import no trl, transformers or accelerate, directly or through the package; and the
package never imports the lab (`lab/`: the study, Countdown, the demo) or the repository's other folders
(`OUTSIDE`), which the wheel does not ship.
Every import statement counts, those inside functions too. Only the standard library is used.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = ("algorithm", "utils", "tasks", "eval", "cli")
PURE = (
    "exgrpo_trl.buffer", "exgrpo_trl.replay", "exgrpo_trl.sampler", "exgrpo_trl.offline", "exgrpo_trl.loss",
    "exgrpo_trl.scoring", "exgrpo_trl.state_file", "exgrpo_trl.checkpoints", "exgrpo_trl.run", "exgrpo_trl.settings",
    "exgrpo_trl.training_state", "exgrpo_trl.draw",
)  # fmt: skip
FRAMEWORKS = ("trl", "transformers", "accelerate")
OUTSIDE = ("lab", "tests", "benchmarks", "scripts")  # the repository's folders beside the package


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS else "algorithm"


def imports_of(path: Path, module: str, modules: set[str]) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level names of outside packages imported) by one file."""
    is_package = path.name == "__init__.py"
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg itself
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "exgrpo_trl":
                while target not in modules and "." in target:  # `import exgrpo_trl.x.y` names a module
                    target = target.rsplit(".", 1)[0]
                if target != module:
                    inside.add(target)
            else:
                outside.add(target.split(".")[0])
    return inside, outside


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def check(package_dir: Path) -> tuple[list[str], dict[str, set[str]]]:
    """Problems found (empty when the layout holds) and the package's import graph."""
    root = package_dir.parent
    files = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    graph, outside = {}, {}
    for module, path in files.items():
        graph[module], outside[module] = imports_of(path, module, set(files))
    problems = [f"import circle: {' <-> '.join(c)}" for c in find_cycles(graph)]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module)):
                problems.append(
                    f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)}): imports go down the layers"
                )
    for module in sorted(outside):
        for name in sorted(outside[module] & set(OUTSIDE)):
            problems.append(f"{module} imports {name}: the package never imports the repository's {name}/ folder")
    for pure in PURE:
        reached, todo = set(), [pure]
        while todo:
            current = todo.pop()
            if current in reached or current not in graph:
                continue
            reached.add(current)
            todo.extend(graph[current])
            for framework in sorted(outside[current] & set(FRAMEWORKS)):
                via = "" if current == pure else f" through {current}"
                problems.append(f"{pure} must not import {framework}{via}")
    return problems, graph


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "exgrpo_trl"
    problems, graph = check(package_dir)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    edges = sum(len(t) for t in graph.values())
    print(f"import graph: {len(graph)} modules, {edges} imports, no circles, every import goes down the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
