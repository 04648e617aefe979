"""Everything a comment or a doc names is in the repository.

A path that looks like one of this repository's (it starts with a top-level entry: `xpuctl/`,
`tests/`, `docs/`, ...) must exist; names of files that were never in it (`DESIGN.md`,
`reference/*.md`) and the build machine's absolute paths (`/work/...`; a fake host's `/home/...`
is host text, not a path of ours) are always
wrong: a maintainer with a clone cannot open them. Markdown links are checked relative to the
page. Patterns and placeholders (`tests/test_*.py`, `xpuctl/cli/NAME.py`, `<pid>`) are not
paths and are skipped."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Directories scanned (every text file in them) and the Markdown files at any depth.
SCANNED_DIRS = ("xpuctl", "tests", "bench", "deploy", "docs", "completions", ".ci")
SKIPPED_PARTS = {"__pycache__", ".venv", ".git", "data"}  # data: golden samples, host text

# Names that were never in this repository, and a build machine's absolute paths.
FOREIGN = r"DESIGN\.md|reference/[\w./-]+|/work/[\w./@+-]+"
_START = r"(?<![\w./@~$-])"  # not the middle of a longer path, an URL or a variable
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PLACEHOLDER = re.compile(r"[*<>{}…\[\]]|/[A-Z][A-Z_]*(?:\.|/|$)|\.\.\.")


def _path_pattern(repo: Path) -> re.Pattern[str]:
    tops = sorted(p.name for p in repo.iterdir() if p.name not in SKIPPED_PARTS
                  and not p.name.endswith(".egg-info"))
    dirs = "|".join(re.escape(t) for t in tops if (repo / t).is_dir())
    return re.compile(rf"{_START}(?:(?P<foreign>{FOREIGN})|(?P<repo>(?:{dirs})/[\w./@+-]*))")


def dangling(text: str, repo: Path, page: Path | None = None) -> list[str]:
    """The repository-looking paths in text that do not exist in repo (page: the Markdown file
    the text is, for its relative links)."""
    found: list[str] = []
    for m in _path_pattern(repo).finditer(text):
        if m.group("foreign"):
            found.append(m.group("foreign"))
            continue
        path = m.group("repo").rstrip(".,:;")
        rest = text[m.end():m.end() + 1]
        if _PLACEHOLDER.search(path) or (rest and rest in "*<{[…"):
            continue
        last = path.rsplit("/", 1)[-1]
        if "." not in last and last != last.lower():
            continue  # "xpuctl/vLLM": words joined by a slash, not a path
        if not (repo / path).exists():
            found.append(path)
    if page is not None:
        # a page or a comment names modules by their path inside the package: `core/rules.py`
        # is xpuctl/core/rules.py (a module gone from the package, named so in two comments, was
        # once caught only in pages)
        packages = "|".join(sorted(p.name for p in (repo / "xpuctl").glob("*/") if p.is_dir()
                                   and p.name != "__pycache__"))
        if packages:
            for m in re.finditer(rf"{_START}(?:{packages})/[\w/]+\.py\b", text):
                if not _PLACEHOLDER.search(m.group(0)) and not (repo / "xpuctl" / m.group(0)).exists():
                    found.append(m.group(0))
    if page is not None and page.suffix == ".md":
        for m in _LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target) or _PLACEHOLDER.search(target):
                continue
            if not (page.parent / target).exists():
                found.append(target)
    return found


def _scanned_files(repo: Path) -> list[Path]:
    files = list(repo.glob("*.md"))
    for d in SCANNED_DIRS:
        for p in sorted((repo / d).rglob("*")):
            if p.is_file() and not SKIPPED_PARTS & set(p.relative_to(repo).parts) \
                    and p.suffix not in (".pyc", ".gz", ".so"):
                files.append(p)
    return files


def test_no_comment_or_doc_names_a_path_that_is_not_in_the_repository():
    problems = []
    for p in _scanned_files(REPO):
        if p == Path(__file__).resolve():
            continue  # this file names the bad examples on purpose
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for path in dangling(text, REPO, p):
            problems.append(f"{p.relative_to(REPO)}: {path}")
    assert not problems, "paths named but not in the repository:\n" + "\n".join(problems)


def test_the_check_finds_each_kind_of_dangling_path(tmp_path):
    """Self-test: the check above can fail."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    (tmp_path / "xpuctl" / "core").mkdir(parents=True)
    (tmp_path / "xpuctl" / "core" / "rules.py").write_text("")
    text = ("see DESIGN.md, reference/intel.md §2 and /work/shared/reference/ray.md; "
            "docs/gone.md and xpuctl/missing.py. docs/here.md exists, [a](here.md), [b](nope.md), "
            "xpuctl/cli/NAME.py and tests/test_*.py are patterns, /proc/<pid>/fd is the host's; "
            "core/rules.py is a module, core/gone.py is not.")
    assert dangling(text, tmp_path, tmp_path / "docs" / "page.md") == [
        "DESIGN.md", "reference/intel.md", "/work/shared/reference/ray.md", "docs/gone.md",
        "xpuctl/missing.py", "core/gone.py", "nope.md"]
    assert dangling("docs/here.md, xpuctl/ and /work/wt/x/y.py", tmp_path) == ["/work/wt/x/y.py"]
    # a comment in code names a module by its path inside the package too (issue 32 §4: two
    # comments named a module that had moved to host/); the name is built here, so that this
    # file names no path that is gone
    (tmp_path / "xpuctl" / "probes").mkdir()
    gone = "probes/" + "split.py"
    comment = f"# split over a forked helper ({gone}); rules in core/rules.py"
    seam = tmp_path / "xpuctl" / "host" / "seam.py"
    assert dangling(comment, tmp_path, seam) == [gone]
