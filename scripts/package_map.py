"""The package map of CONTRIBUTING.md, drawn from the import contracts of pyproject.toml.

    python scripts/package_map.py           # print the map
    python scripts/package_map.py --write   # rewrite it in CONTRIBUTING.md
    python scripts/package_map.py --check   # exit 1 if CONTRIBUTING.md's map is stale,
                                            # or a module of the package is on no layer

Each area's line is the first line of its docstring, so the map changes with
the code and the contracts, never by hand.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_unique"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
BEGIN = "<!-- package map: scripts/package_map.py --write -->"
END = "<!-- end of package map -->"


def contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["contracts"])


def layers() -> list[list[str]]:
    (contract,) = (c for c in contracts() if c["type"] == "layers")
    return [[m.strip() for m in str(line).split("|")] for line in contract["layers"]]  # type: ignore[attr-defined]


def source_of(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = PACKAGE / relative / "__init__.py"
    return package if package.is_file() else PACKAGE / relative.with_suffix(".py")


def summary(module: str) -> str:
    docstring = ast.get_docstring(ast.parse(source_of(module).read_text())) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else "(no docstring)"


def short(module: str) -> str:
    return module.removeprefix("celery_unique.")


def draw() -> str:
    lines = [
        "| layer | area | what it holds |",
        "| --- | --- | --- |",
    ]
    for number, line in enumerate(layers(), start=1):
        for module in line:
            slash = "/" if source_of(module).name == "__init__.py" else ""
            area = f"`{short(module)}{slash}`"
            lines.append(f"| {number} | {area} | {summary(module)} |")
    lines += ["", "Forbidden besides:", ""]
    for contract in contracts():
        if contract["type"] == "forbidden":
            sources = ", ".join(f"`{short(str(m))}`" for m in contract["source_modules"])  # type: ignore[attr-defined]
            banned = ", ".join(f"`{m}`" for m in contract["forbidden_modules"])  # type: ignore[attr-defined]
            lines.append(f"* {sources} never imports {banned}: {contract['name']}.")
    return "\n".join(lines)


def unplaced() -> list[str]:
    """Modules and subpackages of the package that no layer names."""
    placed = {short(m) for line in layers() for m in line}
    found = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    found |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    return sorted(found - placed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    options = parser.parse_args()
    block = f"{BEGIN}\n\n{draw()}\n\n{END}"
    text = CONTRIBUTING.read_text()
    start, stop = text.find(BEGIN), text.find(END)
    if options.write:
        if start < 0 or stop < 0:
            print(f"{CONTRIBUTING.name} has no {BEGIN} ... {END} block", file=sys.stderr)
            return 1
        CONTRIBUTING.write_text(text[:start] + block + text[stop + len(END) :])
        return 0
    if options.check:
        problems = [f"{name}: on no layer of pyproject's layers contract" for name in unplaced()]
        if start < 0 or text[start : stop + len(END)] != block:
            problems.append(f"{CONTRIBUTING.name}: stale package map: run {__file__} --write")
        for problem in problems:
            print(problem, file=sys.stderr)
        if not problems:
            areas = sum(map(len, layers()))
            print(f"package map: {areas} areas on {len(layers())} layers, as drawn")
        return 1 if problems else 0
    print(draw())
    return 0


if __name__ == "__main__":
    sys.exit(main())
