"""The family manifests on disk (manifests/*.toml) and which one a config.json belongs to. Binding one to a
config is kconvert/family/manifest.py's `bind`."""

from __future__ import annotations

import functools
import importlib.resources
import re
import tomllib
from pathlib import Path

from kconvert.errors import ManifestError


def manifests_dir() -> Path:
    return Path(str(importlib.resources.files("manifests")))


@functools.lru_cache(maxsize=None)
def read_toml(path: Path) -> dict:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError("manifest file not found", file=str(path)) from None
    return _parsed(path, data)


def _parsed(path: Path, data: bytes) -> dict:
    try:
        return tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid TOML: {e}", file=str(path)) from None


_FAMILY_KEY = re.compile(rb"""(?m)^[ \t]*(\[{1,2}[ \t]*)?["']?family["']?[ \t]*[].=]""")  # [family], family.x =


@functools.lru_cache(maxsize=None)
def families() -> tuple[tuple[str, dict], ...]:
    out = []
    for path in sorted(manifests_dir().glob("*.toml")):
        data = path.read_bytes()  # read once: searched for a family key, then parsed from the same bytes
        if not _FAMILY_KEY.search(data):  # no family key (devices, limits): not parsed to find one
            continue
        spec = _parsed(path, data)
        if "family" in spec:
            out.append((path.name, spec))
    return tuple(out)


def family_aliases(family: dict) -> tuple[tuple[re.Pattern, str], ...]:
    """A family's [family.aliases]: (pattern matching a stored name's start, the published start)."""
    try:
        return tuple((re.compile(p), str(to)) for p, to in (family.get("aliases") or {}).items())
    except (re.error, AttributeError) as e:
        raise ManifestError(f"family {family.get('name')}: bad [family.aliases]: {e}") from None


def any_alias(aliases: tuple[tuple[re.Pattern, str], ...]) -> re.Pattern | None:
    """One pattern matching where any alias rule matches (200k names: one search each, not one per rule); None
    when a rule's own backreference would change meaning inside an alternation."""
    if not aliases or any(re.search(r"\\[1-9]|\(\?P=", p.pattern) for p, _ in aliases):
        return None
    try:
        return re.compile("|".join(f"(?:{p.pattern})" for p, _ in aliases))
    except re.error:  # e.g. a rule's global inline flag, legal only at the start of a whole pattern
        return None


def literal_ends(aliases: tuple[tuple[re.Pattern, str], ...]) -> tuple[str, ...] | None:
    """What every name an alias rule matches ends with, where each rule ends in plain text and `$` (Kimi K3's
    `..._weight$`): a name ending otherwise needs no regex search (500k names: one C-level endswith each). Python's
    `$` also matches before a final newline, so each ending comes with that too. None: some rule has no such end."""
    ends = []
    for p, _ in aliases:
        text = p.pattern
        if p.flags & re.IGNORECASE or not text.endswith("$") or text.endswith("\\$"):
            return None
        tail = re.search(r"(?:[A-Za-z0-9_]|\\\.)+$", text[:-1])  # letters, digits, _ and escaped dots before the $
        if tail is None or text[:tail.start()].endswith("\\") or _top_level_bar(text):
            return None  # (its first letter an escape's, as \d; or `a|b$`, whose `a` ends anyhow)
        literal = tail.group().replace("\\.", ".")
        ends += [literal, literal + "\n"]
    return tuple(ends) if ends else None


def _top_level_bar(pattern: str) -> bool:
    """Whether `pattern` has an alternation outside every group and character class."""
    depth, escaped, in_class = 0, False, False
    for c in pattern:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            return True
    return False


def find_family(config: dict, *, config_file: str = "config.json") -> dict:
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ManifestError("architectures must be a list of strings", file=config_file)
    if model_type is not None and not isinstance(model_type, str):
        raise ManifestError("model_type must be a string", file=config_file)
    for _, spec in families():
        fam = spec["family"]
        if any(a in fam.get("architectures", []) for a in archs) or model_type in fam.get("model_types", []):
            return spec
    known = ", ".join(spec["family"]["name"] for _, spec in families())
    raise ManifestError(f"unknown architecture {archs or model_type!r}: no manifest matches (known families: {known})",
                        file=config_file)
