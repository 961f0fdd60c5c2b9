"""Checks the import direction of the `inflight` package (docs/architecture.md, "Layers").

Reads every module's AST (imports inside functions count too) and fails when
  - modules import each other in a cycle, or
  - a module imports a module of a higher layer, or of another package on its own layer.

The layers, top to bottom. A module may import modules of its own prefix (its package), of the
prefixes after its own in its layer, and of every lower layer; prefixes of a layer marked "peers"
must not import each other at all:
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

# (layer, module prefixes in their order, peers), top first. A module belongs to the longest prefix
# that matches it ("inflight" alone is the package's __init__).
LAYERS: list[tuple[str, tuple[str, ...], bool]] = [
    ("entry points", ("inflight.__main__", "inflight.cli", "inflight.perplexity", "inflight.serve"), False),
    ("LLM API", ("inflight", "inflight.llm", "inflight.request_handle", "inflight.detokenizer"), False),
    ("executor", ("inflight.executor",), False),
    ("configs", ("inflight.llm_args", "inflight.sampling_params", "inflight.outputs"), True),
    ("models and batch manager", ("inflight.models", "inflight.batch_manager"), True),
    ("layers", ("inflight.layers",), False),
    ("quantization", ("inflight.quantization",), False),
    ("ops", ("inflight.ops",), False),
    ("leaves", ("inflight.cuda", "inflight.utils", "inflight.parallel"), True),
    ("native modules", ("inflight._C", "inflight._C_cuda"), True),
]

__doc__ += (
    "\n".join(
        f"  {i}. {name}: {', '.join(prefixes)}{' (peers)' if peers else ''}"
        for i, (name, prefixes, peers) in enumerate(LAYERS)
    )
    + "\n"
)


def module_names(root: Path) -> dict[str, Path | None]:
    mods: dict[str, Path | None] = {"inflight._C": None, "inflight._C_cuda": None}
    for path in (root / "inflight").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def import_edges(mods: dict[str, Path | None]) -> dict[str, set[str]]:
    """module -> the inflight modules it imports (``from X import name``: X.name when that is a
    module, else X)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        if path is None:
            continue
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "inflight" and (dst := resolve(target)) and dst != mod:
                    edges[mod].add(dst)
    return edges


def cycles(edges: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer_of(mod: str) -> tuple[int, int]:
    """(layer index, index of the prefix that placed it within its layer)."""
    best, best_len = (-1, -1), -1
    for i, (_, prefixes, _) in enumerate(LAYERS):
        for j, p in enumerate(prefixes):
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = (i, j), len(p)
    if best[0] < 0:
        raise SystemExit(f"check_imports: module {mod} is in no layer; add it to LAYERS")
    return best


def allowed(src: tuple[int, int], dst: tuple[int, int]) -> bool:
    if dst[0] != src[0]:
        return dst[0] > src[0]
    if dst[1] == src[1]:
        return True
    peers = LAYERS[src[0]][2]
    return not peers and dst[1] > src[1]


def main(root: Path) -> int:
    mods = module_names(root)
    edges = import_edges(mods)
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges, sorted(mods))]
    for src in sorted(edges):
        ls = layer_of(src)
        for dst in sorted(edges[src]):
            ld = layer_of(dst)
            if not allowed(ls, ld):
                problems.append(
                    f"{src} ({LAYERS[ls[0]][0]}) imports {dst} ({LAYERS[ld[0]][0]}): against the layers"
                )
    for p in problems:
        print(p)
    n_edges = sum(len(v) for v in edges.values())
    print(f"check_imports: {len(mods)} modules, {n_edges} imports, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "python"))
