"""Which area of celery_unique imports which, and any import cycle between modules.

    python scripts/import_graph.py        # the package importable from here (the checkout)

Areas are the subpackages and the top-level modules. Every import counts,
those inside functions and under ``TYPE_CHECKING`` too, as for `lint-imports`.
Exits 1 if the modules import each other in a cycle.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import grimp

PACKAGE = "celery_unique"


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package root)"


def cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(imports):
        if start in index:
            continue
        work = [(start, iter(sorted(imports[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def main() -> int:
    graph = grimp.build_graph(PACKAGE)
    imports = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    between: dict[str, set[str]] = defaultdict(set)
    for module, imported in imports.items():
        for other in imported:
            if area(module) != area(other):
                between[area(module)].add(area(other))
    print(f"{len(imports)} modules in {PACKAGE}; areas and the areas each imports:")
    for name in sorted(between):
        print(f"  {name:16} -> {', '.join(sorted(between[name]))}")
    groups = cycles(imports)
    for group in groups:
        print(f"cycle of {len(group)} modules: {' '.join(group)}")
    print(f"{len(groups)} import cycles")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())
