"""The gate: .ci/run runs exactly the README's test command, and that command lints and
type-checks before it tests."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    commands = [line for b in blocks for line in b.splitlines() if "pytest" in line]
    assert len(commands) == 1, commands
    return commands[0].strip()


def test_ci_runs_the_readme_test_command():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert _readme_test_command() in ci


def test_the_test_command_lints_and_type_checks_before_the_tests():
    cmd = _readme_test_command()
    assert cmd.index("ruff check") < cmd.index("mypy") < cmd.index("pytest")


def test_every_ignored_rule_says_why():
    """Each entry of ruff's ignore list has a comment above it (the reason)."""
    text = (REPO / "pyproject.toml").read_text()
    ignore = re.search(r"^ignore = \[\n(.*?)^\]", text, re.S | re.M)
    assert ignore, "pyproject has no [tool.ruff.lint] ignore list"
    lines = ignore.group(1).splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith('"'):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith(("#", '"')), f"no reason for {line.strip()}"
    assert lines[0].strip().startswith("#")


def test_every_inline_ignore_names_its_code():
    bare = []
    for path in [*REPO.glob("xpuctl/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("bench/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#\s*type:\s*ignore(?!\[)", line) or re.search(r"#\s*noqa(?!:)", line):
                bare.append(f"{path.relative_to(REPO)}:{n}")
    assert not bare, bare


# -- mypy: strict everywhere, the same verdict with or without the optional packages ------------

#: the packages the CLI process runs on (pyproject's `dependencies`)
RUNTIME = ("typer", "rich")


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> the files importing it, for every module xpuctl/ imports
    that is neither the standard library nor xpuctl itself (lazy imports included)."""
    import ast
    import sys

    out: dict[str, set[str]] = {}
    for path in sorted((REPO / "xpuctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root != "xpuctl" and root not in sys.stdlib_module_names:
                    out.setdefault(root, set()).add(str(path.relative_to(REPO)))
    return out


def test_mypy_is_strict_for_every_package():
    """`strict` at the top of [tool.mypy], not a list of packages a new one can miss."""
    mypy = _pyproject()["tool"]["mypy"]
    assert mypy.get("strict") is True
    assert mypy["files"] == ["xpuctl"]
    for override in mypy.get("overrides", []):
        modules = override["module"]
        modules = modules if isinstance(modules, list) else [modules]
        assert not [m for m in modules if m.startswith("xpuctl")], (
            "a per-package mypy override of xpuctl: every package keeps the same flags")


def test_mypy_config_lists_every_optional_module():
    """Every package xpuctl imports beyond the runtime deps is optional (run in a child
    process): the mypy config makes each of them Any, stubs included, so the verdict does not
    depend on whether it is installed. Derived from the import lines, so a new one (a probe
    of vllm, oneccl_bindings_for_pytorch) cannot be forgotten."""
    optional = {root for root in _third_party_imports() if root not in RUNTIME}
    assert optional >= {"torch", "ray", "pyzes", "intel_extension_for_pytorch"}
    skipped = [o for o in _pyproject()["tool"]["mypy"].get("overrides", [])
               if o.get("follow_imports") == "skip"]
    assert len(skipped) == 1, "one override for the optional packages"
    (override,) = skipped
    assert override.get("ignore_missing_imports") is True
    assert override.get("follow_imports_for_stubs") is True  # ray ships .pyi stubs: Any too
    assert set(override["module"]) == {m for root in optional for m in (root, f"{root}.*")}


def _venv_without_optional_packages(where: Path) -> Path:
    """A virtualenv holding only what the CLI process runs on (typer, rich and what they
    need, linked from this one): no torch, no ray, no pyzes, no IPEX. Its python."""
    import importlib.metadata as md
    import re
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   capture_output=True, timeout=120)
    python = where / "bin" / "python"
    where_packages = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(python), "-c", where_packages], check=True,
                               capture_output=True, text=True, timeout=60).stdout.strip())
    todo, seen = list(RUNTIME), set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a dependency for another platform (colorama)
        todo += [re.split(r"[\s<>=!~;\[(]", r.strip(), maxsplit=1)[0] for r in dist.requires or []
                 if "extra ==" not in r]
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return python


def test_mypy_gives_the_same_verdict_without_the_optional_packages(tmp_path):
    """The gate's mypy, run once with this virtualenv (torch and ray installed by the test
    extra) and once with a python that has none of the optional packages: the same output,
    and it is a pass (issue 32: without torch and ray it used to report 4 errors)."""
    import subprocess
    import sys

    bare = _venv_without_optional_packages(tmp_path / "bare")
    probe = ("import importlib.util as u; "
             "print([m for m in ('torch', 'ray', 'typer', 'rich') if u.find_spec(m)])")
    seen = subprocess.run([str(bare), "-c", probe], capture_output=True, text=True, timeout=60)
    assert seen.stdout.strip() == "['typer', 'rich']", seen  # the hiding works
    runs = [subprocess.Popen([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / name),
                              *extra], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for name, extra in (("full", []), ("without", ["--python-executable", str(bare)]))]
    try:
        (full, _), (without, _) = (r.communicate(timeout=600) for r in runs)
    finally:
        for r in runs:
            r.kill()
    assert without == full, f"with the optional packages:\n{full}\nwithout:\n{without}"
    assert full.startswith("Success: no issues found"), full


def test_output_renders_typed_records():
    """No `Any` in output/ (issue 32 §2): its renderers take the records themselves, or the
    shapes (output/shapes.py) of records that live in the layers above it, and return rich
    renderables or JSON documents by their types. mypy holds every call to them."""
    import ast
    import io
    import tokenize

    found = []
    for path in sorted((REPO / "xpuctl" / "output").glob("*.py")):
        text = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and tok.string == "Any":
                found.append(f"{path.relative_to(REPO)}:{tok.start[0]}")
        for node in ast.walk(ast.parse(text)):  # a type alias written as a string
            if (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                    and re.search(r"\bAny\b", node.value.value)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
