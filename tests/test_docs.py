"""The user documentation stays readable and true to the repository: the README's size, the docs/
folder's size, no words about how the work was organised, and every repository path (and page
anchor) the README and docs/*.md cite exists. Reads files only; imports nothing of the package."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

README_MAX_LINES = 200
README_MAX_COLUMNS = 100
DOCS_MAX_BYTES = 150_000
# the README's test command, which .ci/run runs
TEST_COMMAND = ". .venv/bin/activate && python -m pytest -q -n 2 --dist loadfile --durations=25 tests"

PROCESS_WORDS = re.compile(r"stop [0-9]+", re.IGNORECASE)
# words about how the work was organised, in the user pages only (code says "session" of ONNX Runtime)
ORGANISATION_WORDS = re.compile(
    r"\bthis stop\b|\b(?:this|earlier|previous|next|later) session\b|\bthis try\b|\bfarm-bench\b",
    re.IGNORECASE,
)
EXTENSIONS = (".py", ".md", ".cc", ".h", ".json", ".jsonl", ".toml", ".png", ".svg", ".yml", ".safetensors")
SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache", "bundles"}


def tracked_files() -> list[Path]:
    """The repository's files: git's list where this is a checkout, else a walk that skips build outputs."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
        files = [ROOT / name for name in out.split("\0") if name]
        if files:
            return [path for path in files if path.exists()]
    except (OSError, subprocess.SubprocessError):
        pass
    found = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if path.is_file() and not SKIPPED_DIRS.intersection(parts) and not parts[0].endswith(".egg-info"):
            found.append(path)
    return found


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def top_level_folders() -> set[str]:
    return {path.relative_to(ROOT).parts[0] for path in tracked_files() if len(path.relative_to(ROOT).parts) > 1}


def test_readme_is_short_and_narrow() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > README_MAX_COLUMNS]
    assert not wide, f"README.md lines over {README_MAX_COLUMNS} columns (line, width): {wide}"


def test_readme_keeps_the_ci_test_command() -> None:
    text = README.read_text(encoding="utf-8")
    assert TEST_COMMAND in text.splitlines(), "README.md lost its test command (.ci/run runs it)"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    pytest_lines = [line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest")]
    assert pytest_lines and all(line in text for line in pytest_lines), ".ci/run's test command is not the README's"


def test_docs_folder_fits_its_budget() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): path.stat().st_size
        for path in DOCS.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert total <= DOCS_MAX_BYTES, f"docs/ holds {total} bytes, at most {DOCS_MAX_BYTES}; largest: {largest}"


def test_no_process_words() -> None:
    texts = [README, *(path for path in DOCS.rglob("*") if path.is_file() and path.suffix in {".md", ".py", ".svg"})]
    texts += [path for path in tracked_files() if path.suffix == ".py"]
    hits = []
    for path in dict.fromkeys(texts):
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    for path in pages():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ORGANISATION_WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    assert not hits, "words about how the work was organised:\n" + "\n".join(hits)


def strip_code_blocks(text: str) -> tuple[str, str]:
    """(prose, fenced code): paths in code blocks are checked as commands are, word by word."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        (code if inside else prose).append(line)
    return "\n".join(prose), "\n".join(code)


def looks_like_repo_path(word: str, folders: set[str]) -> bool:
    if not word or word.startswith(("/", "~", "http:", "https:")) or re.search(r"[<>{}|$=\\]", word):
        return False
    first = word.split("/", 1)[0]
    if "/" in word and first in folders:
        return True
    return "/" in word and word.endswith(EXTENSIONS) and not word.startswith("..")


def clean(word: str) -> str:
    word = word.strip().strip("`\"'").lstrip("([").rstrip(".,;:)]!?")
    word = word.split("::", 1)[0]
    return word.split("#", 1)[0]


def exists(citation: str, page: Path) -> bool:
    """Whether a cited path exists beside the page or under the root; `pkg/module.name` names a
    module's attribute: the module exists and holds the name."""
    bases = [ROOT] if page == README else [page.parent, ROOT]
    for base in bases:
        if any(ch in citation for ch in "*?["):
            if list(base.glob(citation)):
                return True
        elif (base / citation).exists():
            return True
        module, dot, name = citation.rpartition(".")
        if dot and module and name.isidentifier() and (base / f"{module}.py").is_file():
            return re.search(rf"\b{re.escape(name)}\b", (base / f"{module}.py").read_text(encoding="utf-8")) is not None
    return False


def cited_paths(page: Path, folders: set[str]) -> set[str]:
    prose, code = strip_code_blocks(page.read_text(encoding="utf-8"))
    words: list[str] = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        words += span.split()
    words += code.split()
    bare = re.sub(r"`[^`\n]+`", " ", prose)
    bare = re.sub(r"\]\([^)]*\)", "]", bare)
    words += re.findall(r"(?<![\w/.-])[\w.-]+/[\w./*-]+\.(?:" + "|".join(e[1:] for e in EXTENSIONS) + r")\b", bare)
    found = set()
    for word in words:
        word = clean(word)
        if looks_like_repo_path(word, folders):
            found.add(word)
    for module in re.findall(r"-m (benchmarks\.[a-z_]+)", prose + "\n" + code):
        found.add(module.replace(".", "/") + ".py")
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = strip_code_blocks(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in prose.splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(page: Path) -> list[str]:
    prose, _ = strip_code_blocks(page.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def test_cited_paths_exist() -> None:
    folders = top_level_folders()
    missing = []
    for page in pages():
        for citation in sorted(cited_paths(page, folders)):
            if not exists(citation, page):
                missing.append(f"{page.relative_to(ROOT)}: {citation}")
        for target in links(page):
            if target.startswith(("http:", "https:", "mailto:", "#")):
                continue
            path = clean(target)
            if path and not (page.parent / path).exists():  # a link resolves beside its page, as GitHub reads it
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_links_to_page_sections_name_a_heading() -> None:
    broken = []
    for page in pages():
        for target in links(page):
            if target.startswith(("http:", "https:", "mailto:")) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            linked = page.parent / path if path else page
            if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to a section no heading names:\n" + "\n".join(broken)


def test_the_path_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `runtimes/drafting/registry.py`, `tests/test_docs.py::test_x`, [a](docs/nowhere.md#x) and "
        "`python -m benchmarks.nowhere`.\n",
        encoding="utf-8",
    )
    folders = top_level_folders()
    cited = cited_paths(page, folders)
    assert {"runtimes/drafting/registry.py", "tests/test_docs.py", "benchmarks/nowhere.py"} <= cited
    assert not exists("runtimes/drafting/registry.py", page) and exists("tests/test_docs.py", page)
    assert links(page) == ["docs/nowhere.md#x"]
    assert slug("The `--mode auto` gate") == "the---mode-auto-gate"
    assert slug("Results (2026-11-28, Zen 4)") == "results-2026-11-28-zen-4"
