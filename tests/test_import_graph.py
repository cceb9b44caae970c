"""The packages' import graph, read from the source (nothing imported): no module imports itself
through others (a cycle), and no module imports a private name (``_x``) from another package.
Every import counts: inside functions and under ``if TYPE_CHECKING:`` too (a lazy import that
breaks a cycle at run time, or one only the type checker follows, still leaves the cycle in the
design). docs/ARCHITECTURE.md."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gpu_runtime", "layers")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's ``__init__``)."""
    mods = {}
    for package in PACKAGES:
        for f in sorted((ROOT / package).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the project's modules it imports, private names imported across packages)."""
    mods = _modules()

    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, (f, is_pkg) in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        here = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = []
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base)
                    home = target if target and mods[target][1] else target.rpartition(".")[0]
                    if a.name.startswith("_") and not a.name.startswith("__") and target and target != m:
                        if not (here + ".").startswith(home + "."):
                            private.append(f"{m} imports {a.name} from {target}")
                    targets.append(target)
            else:
                continue
            edges[m].update(t for t in targets if t and t != m)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycles_and_no_private_names_across_packages():
    edges, private = import_graph()
    assert len(edges) > 50 and sum(map(len, edges.values())) > 200  # the graph was read
    assert cycles(edges) == []
    assert private == []


def test_the_storage_tier_imports_nothing_of_the_model():
    """``layers.ngram_store`` sits below ``layers.ngram_embed`` (docs/ARCHITECTURE.md): importing
    the model from it would tie the packages in a circle through their ``__init__``."""
    edges, _ = import_graph()
    store = {m: deps for m, deps in edges.items() if m.startswith("layers.ngram_store")}
    assert len(store) >= 8
    assert [(m, d) for m, deps in store.items() for d in deps if d.startswith("layers.ngram_embed")] == []


def test_the_two_model_packages_import_nothing_of_each_other():
    """``layers.engram`` and ``layers.ngram_embed`` stand side by side: what both need lives below
    them (``layers.model_folder``, ``layers.ngram_store`` ...), so neither ties to the other."""
    edges, _ = import_graph()
    pairs = [("layers.engram", "layers.ngram_embed"), ("layers.ngram_embed", "layers.engram")]
    for a, b in pairs:
        mods = {m: deps for m, deps in edges.items() if m == a or m.startswith(a + ".")}
        assert len(mods) >= 2, a
        assert [(m, d) for m, deps in mods.items() for d in deps if d == b or d.startswith(b + ".")] == []


def test_type_checking_imports_count():
    """An import only the type checker follows ties its modules as any other does."""
    edges, _ = import_graph()
    assert "layers.backend_caps" in edges["layers.ngram_store.row_cache"]  # imported under TYPE_CHECKING there


def test_the_checks_see_a_cycle_and_a_private_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    edges, _ = import_graph()
    edges["gpu_runtime.errors"].add("layers.ops.gemm")  # layers.ops.gemm reaches gpu_runtime.errors
    assert any("gpu_runtime.errors" in group and "layers.ops.gemm" in group for group in cycles(edges))
