"""The numbers issue 28's review counted, measured on the source as it is: the longest functions, the parameters of the
round's helpers, string comparisons against algorithm names, and import circles between usd's modules.

    python scripts/seams_report.py [--top 8]

An import counts wherever it stands (module level, inside a function, under TYPE_CHECKING): each is a dependency.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from usd.algorithms import NAMES  # noqa: E402

ROUND_HELPERS = (
    "decoder.speculative_round",
    "tally.Tally.record",
    "schedule.Schedule.observe",
    "schedule.CostModel.observe",
)


def modules(package: str = "usd") -> dict[str, ast.Module]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def functions(tree: ast.Module, prefix: str):
    """(qualified name, node) of every function, methods as Class.method."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}.{node.name}", node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{prefix}.{node.name}.{item.name}", item


def parameters(node) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")])


def name_comparisons(tree: ast.Module) -> list[int]:
    """Lines comparing something with an algorithm's name written as a string (==, !=, in a literal tuple)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for op, right in zip(node.ops, node.comparators, strict=True):
            sides = [node.left, right]
            if isinstance(op, ast.In | ast.NotIn) and isinstance(right, ast.Tuple | ast.List | ast.Set):
                sides += right.elts
            if isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) and any(
                isinstance(s, ast.Constant) and s.value in NAMES and s.value != "auto" for s in sides
            ):
                lines.append(node.lineno)
    return lines


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    out = set()
    package = name if any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other, directly or through others (each pair once)."""
    reach = {m: set() for m in graph}
    for start in graph:
        stack = list(graph[start])
        while stack:
            m = stack.pop()
            if m not in reach[start]:
                reach[start].add(m)
                stack.extend(graph.get(m, ()))
    return sorted({tuple(sorted((a, b))) for a in graph for b in reach[a] if a != b and a in reach.get(b, ())})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    trees = modules()
    lengths = []
    params = {}
    for name, tree in trees.items():
        for qual, node in functions(tree, name.removeprefix("usd.")):
            lengths.append((node.end_lineno - node.lineno + 1, qual))
            params[qual] = parameters(node)
    print("longest functions (lines):")
    for n, qual in sorted(lengths, reverse=True)[: args.top]:
        print(f"  {n:4d}  {qual}")
    print("parameters of the round's helpers:")
    for qual in ROUND_HELPERS:
        print(f"  {params.get(qual, '?'):>4}  {qual}")
    compared = {n: name_comparisons(t) for n, t in trees.items()}
    app = {n: name_comparisons(t) for n, t in modules("app").items()}
    hits = {n: ls for n, ls in {**compared, **app}.items() if ls}
    print(f"string comparisons against algorithm names (usd and app): {sum(map(len, hits.values()))}")
    for n, ls in hits.items():
        print(f"  {n}: lines {', '.join(map(str, ls))}")
    graph = {n: imports(n, t, set(trees)) for n, t in trees.items()}
    found = cycles(graph)
    print(f"import circles between usd's modules: {len(found)}")
    for a, b in found:
        print(f"  {a} <-> {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
