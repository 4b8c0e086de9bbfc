"""The docs stay readable and true to the tree (README.md, tools/README.md and every docs/*.md):

- no table cell is longer than CELL_MAX characters: a long cell is a paragraph, so the table gets a short row and
  a subsection below it holds the detail;
- every path of this repository they name (`kconvert/…/x.py`, `tests/…/test_x.py`, `docs/X.md`, a glob such as
  `tests/faults/test_fault_injection*.py`) exists, so a moved module leaves no stale path behind; so does every
  relative link's target and its #anchor;
- docs/README.md, the index, links every doc in docs/, and the README links the index.

The README's length and its tour are checked in tests/tree/test_readme.py."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT

CELL_MAX = 400  # characters in one table cell

# a path this repository holds: from one of its top folders, or from a stage folder of kconvert/ or engine/ (as
# ARCHITECTURE.md's lists name them); not preceded by a path character, so `vllm/models/x.py` is not `models/x.py`
TOP = ("kconvert", "engine", "cli", "bench", "tools", "tests", "manifests", "docs")
UNDER = {"kconvert": ("io", "family", "quant", "source", "disk_format", "convert", "load", "testing", "plan", "inspect",
                      "verify", "fixtures"),
         "engine": ("layers", "cache", "models", "inputs", "draft", "runtime", "calibrate", "chat")}
PATH = re.compile(r"(?<![\w/.*-])((?:%s)/[\w/.*-]*\.(?:py|md))\b"
                  % "|".join(TOP + tuple(d for dirs in UNDER.values() for d in dirs)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", root / "tools" / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """`text` without its fenced blocks (examples, diagrams, command output)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def long_cells(text: str, limit: int = CELL_MAX) -> list[str]:
    """The start of each table cell in `text` longer than `limit` characters."""
    found = []
    for line in prose(text).splitlines():
        if line.lstrip().startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                if len(cell.strip()) > limit:
                    found.append(f"{len(cell.strip())} characters: {cell.strip()[:70]}…")
    return found


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Repository paths `text` names that match no file (a glob: no file at all)."""
    missing = []
    for path in sorted(set(PATH.findall(text))):
        top = path.split("/")[0]
        bases = [root] if top in TOP else [root / pkg for pkg, dirs in UNDER.items() if top in dirs]
        if not any(next(base.glob(path), None) is not None for base in bases):
            missing.append(path)
    return missing


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading's second anchor ends in -1, its third in -2, …"""
    found, count = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", prose(text), re.M):
        s = slug(heading)
        found.add(f"{s}-{count[s]}" if s in count else s)
        count[s] = count.get(s, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    """Relative links of `doc` whose file, or whose #anchor in it, does not exist."""
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(target)
    return broken


def test_table_cells_are_short():
    long = {str(f.relative_to(ROOT)): cells for f in doc_files() if (cells := long_cells(f.read_text()))}
    assert not long, f"table cells over {CELL_MAX} characters (a short row, the detail in a subsection): {long}"


def test_named_paths_exist():
    missing = {str(f.relative_to(ROOT)): paths for f in doc_files() if (paths := missing_paths(f.read_text()))}
    assert not missing, f"the docs name paths that are not in the tree: {missing}"


def test_links_resolve():
    broken = {str(f.relative_to(ROOT)): links for f in doc_files() if (links := broken_links(f))}
    assert not broken, f"links to a missing file or anchor: {broken}"


def test_the_index_lists_every_doc():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(index)}
    unlisted = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and p.name not in linked]
    assert not unlisted, f"docs/README.md does not list {unlisted}"
    assert "tools/README.md" in index
    assert "(docs/README.md)" in (ROOT / "README.md").read_text(), "the README links the docs index"


def test_the_checks_catch_damage(tmp_path):
    """Each check fails on the damage it is for and passes the same text undamaged."""
    assert long_cells("| a | " + "x" * CELL_MAX + " |") == []
    assert len(long_cells("| a | " + "x" * (CELL_MAX + 1) + " |")) == 1
    assert long_cells("```\n| a | " + "x" * 900 + " |\n```\n") == []  # a block's output is not a table

    (tmp_path / "kconvert" / "quant").mkdir(parents=True)
    (tmp_path / "kconvert" / "quant" / "gptq.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a1.py").write_text("")
    text = "`kconvert/quant/gptq.py`, `quant/gptq.py`, tests/test_a*.py and vllm/models/deepseek_v4/model.py"
    assert missing_paths(text, tmp_path) == []
    assert missing_paths(text + ", `kconvert/converted/catalog.py`, `cache/v41.py`, tests/test_b*.py", tmp_path) == [
        "cache/v41.py", "kconvert/converted/catalog.py", "tests/test_b*.py"]

    (tmp_path / "A.md").write_text("# Title\n\n## Multi-node (tp × pp)\n\n### `deepseek_v4`: DeepSeek-V4-Flash / -Pro\n")
    doc = tmp_path / "B.md"
    doc.write_text("[a](A.md#multi-node-tp--pp) [b](A.md#deepseek_v4-deepseek-v4-flash---pro) [c](https://x.org/y)")
    assert broken_links(doc) == []
    doc.write_text("[a](A.md#multi-node) [b](C.md) [c](#nowhere)")
    assert broken_links(doc) == ["A.md#multi-node", "C.md", "#nowhere"]
