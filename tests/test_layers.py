"""The layers of xpuctl/ (ARCHITECTURE.md), enforced from the import lines.

Every `import xpuctl...` / `from xpuctl... import` in a module, at any depth (the lazy ones
inside functions too), must point at a lower layer, at the module's own package, or at a
leaf. Also: typer only in cli/, rich only in cli/ and output/, and the optional heavy
libraries nowhere at module level (they run in child processes: see the import-trap test).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "xpuctl"

# lowest first; a module may import from its own layer or from any lower layer
LAYERS = [
    ("xpuctl", "xpuctl.errors"),
    ("xpuctl.parse",),
    ("xpuctl.core",),
    ("xpuctl.output",),
    ("xpuctl.host",),
    ("xpuctl.state",),
    ("xpuctl.actions", "xpuctl.probes"),
    ("xpuctl.diagnosis", "xpuctl.listing", "xpuctl.ray"),
    ("xpuctl.shutdown", "xpuctl.runlog", "xpuctl.archive", "xpuctl.node"),
    ("xpuctl.sweep", "xpuctl.rebind", "xpuctl.serve"),
    ("xpuctl.cli", "xpuctl.__main__"),
]
# pure leaves any layer may use: exit codes, the escaping of host text
LEAVES = ("xpuctl.errors", "xpuctl.output.safetext")
HEAVY = ("torch", "intel_extension_for_pytorch", "pyzes", "vllm", "ray")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def owner(name: str) -> tuple[int, str]:
    """(layer rank, the package or module that places `name` in it)."""
    best: tuple[int, str] | None = None
    for rank, members in enumerate(LAYERS):
        for m in members:
            if (name == m or name.startswith(m + ".")) and (best is None or len(m) > len(best[1])):
                best = (rank, m)
    assert best is not None, f"{name} is in no layer: add it to LAYERS and ARCHITECTURE.md"
    return best


def imports(tree: ast.AST, here: str) -> list[tuple[int, str, bool]]:
    """(line, module imported, at module level?) for every import in the file."""
    top = set(map(id, getattr(tree, "body", [])))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{here}:{node.lineno}: relative import (xpuctl uses absolute ones)"
            base = node.module or ""
            out.append((node.lineno, base, id(node) in top))
            # `from xpuctl.state import audit` imports the module xpuctl.state.audit
            out += [(node.lineno, f"{base}.{a.name}", id(node) in top) for a in node.names
                    if (SRC.parent / base.replace(".", "/") / f"{a.name}.py").exists()
                    or (SRC.parent / base.replace(".", "/") / a.name / "__init__.py").exists()]
    return out


def modules() -> list[tuple[Path, str, ast.AST]]:
    return [(p, module_name(p), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def test_lower_layers_never_import_higher_ones():
    problems = []
    for path, name, tree in modules():
        rank, pkg = owner(name)
        for line, target, _ in imports(tree, name):
            if not target.startswith("xpuctl") or target == "xpuctl" or target.startswith(LEAVES):
                continue
            t_rank, t_pkg = owner(target)
            if t_rank > rank:
                problems.append(f"{path.relative_to(SRC.parent)}:{line}: {name} ({pkg}) imports {target} ({t_pkg})")
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_typer_only_in_cli_rich_only_in_cli_and_output():
    problems = []
    for path, name, tree in modules():
        for line, target, _ in imports(tree, name):
            root = target.split(".")[0]
            if root == "typer" and not name.startswith("xpuctl.cli"):
                problems.append(f"{path.relative_to(SRC.parent)}:{line}: typer outside cli/")
            if root == "rich" and not name.startswith(("xpuctl.cli", "xpuctl.output")):
                problems.append(f"{path.relative_to(SRC.parent)}:{line}: rich outside cli/ and output/")
    assert not problems, "\n".join(problems)


def test_no_heavy_library_at_module_level():
    problems = [f"{path.relative_to(SRC.parent)}:{line}: {target}"
                for path, name, tree in modules()
                for line, target, top in imports(tree, name)
                if top and target.split(".")[0] in HEAVY]
    assert not problems, "\n".join(problems)


def test_every_package_is_a_layer():
    for _path, name, _ in modules():
        owner(name)


def test_the_layer_list_matches_architecture_md():
    text = (SRC.parent / "ARCHITECTURE.md").read_text()
    for members in LAYERS:
        for m in members:
            if m in ("xpuctl", "xpuctl.__main__"):
                continue
            shown = m.removeprefix("xpuctl.")
            assert f"`{shown}" in text, f"ARCHITECTURE.md does not name {shown}"


def test_the_checker_sees_a_violation(tmp_path):
    """The rule is live: a core module importing the CLI is caught."""
    tree = ast.parse("def f():\n    from xpuctl.cli.group import app\n")
    rank, _pkg = owner("xpuctl.core.checks")
    bad = [t for _, t, _ in imports(tree, "xpuctl.core.checks") if owner(t)[0] > rank]
    assert bad == ["xpuctl.cli.group", "xpuctl.cli.group.app"] or bad == ["xpuctl.cli.group"]


def import_graph(mods: list[tuple[Path, str, ast.AST]]) -> dict[str, set[str]]:
    """module -> the xpuctl modules it imports, at any depth (lazy imports included)."""
    names = {name for _, name, _ in mods}
    return {name: {t for _, t, _ in imports(tree, name) if t in names and t != name}
            for _, name, tree in mods}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module
    (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """No module imports, at any depth and however lazily, a module that imports it back
    (issue 32 §1: a pass posted ahead and host/scan.py were one)."""
    found = cycles(import_graph(modules()))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_checker_sees_a_lazy_circle():
    a = ast.parse("from xpuctl.host.scan import take_scan\n")
    b = ast.parse("def f():\n    from xpuctl.host.processes import scan_processes\n")
    c = ast.parse("import xpuctl.errors\n")
    graph = import_graph([(SRC / "host/processes.py", "xpuctl.host.processes", a),
                          (SRC / "host/scan.py", "xpuctl.host.scan", b),
                          (SRC / "errors.py", "xpuctl.errors", c)])
    assert cycles(graph) == [["xpuctl.host.processes", "xpuctl.host.scan"]]
