"""The package import graph is layered: no import cycles between units, no forbidden arrows.

Walks the source of `composer` (plus `composer.zoo` = zoo/ and `composer.convert` =
tools/convert/) with `ast`, without importing anything. Every import counts, including those
inside functions and `if TYPE_CHECKING:` blocks. A unit is a module's first two dotted
components (`composer.blocks.moe` -> `composer.blocks`); the root `composer/__init__.py`, which
re-exports the public API, is the unit `composer`. This proves: only the root and `__main__`
import the root; blocks, parallel, pattern and kernels stay below the layers that use them;
and the unit graph (root excluded) is acyclic.
"""

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"composer": REPO / "composer", "composer.zoo": REPO / "zoo",
         "composer.convert": REPO / "tools" / "convert"}


def _is_module(dotted):
    for pkg, root in sorted(ROOTS.items(), key=lambda kv: -len(kv[0])):
        if dotted == pkg or dotted.startswith(pkg + "."):
            rel = root.joinpath(*dotted[len(pkg):].split(".")[1:])
            return rel.is_dir() or rel.with_suffix(".py").is_file()
    return False


def _unit(dotted):
    return ".".join(dotted.split(".")[:2])


def _scan():
    """Return (modules scanned, {(src unit, dst unit): ["file:line: import ..."]})."""
    modules, edges = [], defaultdict(list)
    for pkg, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = [pkg, *path.relative_to(root).with_suffix("").parts]
            is_init = parts[-1] == "__init__"
            mod = ".".join(parts[:-1] if is_init else parts)
            package = mod if is_init else mod.rpartition(".")[0]
            modules.append(mod)
            src = "composer" if mod == "composer" else _unit(mod)
            where = path.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                               for a in node.names]
                else:
                    continue
                for t in targets:
                    if t == "composer" or t.startswith("composer."):
                        dst = "composer" if t == "composer" else _unit(t)
                        if dst != src:
                            edges[src, dst].append(
                                f"{where}:{node.lineno}: {ast.unparse(node)}  [{mod} -> {t}]")
    return modules, edges


MODULES, EDGES = _scan()


def _violations(src, forbidden):  # forbidden=None: any composer import is a violation
    return [e for (s, d), ev in EDGES.items()
            if s == src and (forbidden is None or d in forbidden) for e in ev]


def test_walker_is_not_vacuous():
    assert len(MODULES) >= 10, MODULES
    assert ("composer.build", "composer.blocks") in EDGES, sorted(EDGES)


def test_only_root_and_main_import_root():
    bad = [e for (s, d), ev in EDGES.items()
           if d == "composer" and s != "composer.__main__" for e in ev]
    assert not bad, "modules import the root `composer` (which imports everything):\n" + \
        "\n".join(bad)


LOW = {"composer.cli", "composer.convert", "composer.zoo", "composer.run"}


def test_forbidden_arrows():
    rules = {"composer.blocks": LOW | {"composer.parallel", "composer.build"},
             "composer.parallel": LOW | {"composer.build"},
             "composer.pattern": None,
             "composer.kernels": {"composer.blocks", "composer.build", "composer.parallel"}}
    bad = [f"{src} must not import {', '.join(sorted(f)) if f else 'anything'}:\n  "
           + "\n  ".join(v)
           for src, f in rules.items() if (v := _violations(src, f))]
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_unit_graph_is_acyclic():
    graph = defaultdict(set)
    for s, d in EDGES:
        if "composer" not in (s, d):
            graph[s].add(d)
    state, stack, cycles = {}, [], []

    def dfs(n):  # colour DFS: a back edge to a node on the stack closes a cycle
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cyc = stack[stack.index(m):] + [m]
                cycles.append(" -> ".join(cyc) + "\n    " + "\n    ".join(
                    EDGES[a, b][0] for a, b in zip(cyc, cyc[1:], strict=False)))
            elif m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            dfs(n)
    assert not cycles, "import cycles between units:\n" + "\n".join(cycles)
