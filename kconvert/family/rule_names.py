"""How a manifest rule's pattern (`model.layers.{L}.mlp.experts.{E}.w1.weight`) names tensors: the key every name it
generates shares, the regex that reads a name's numbers back, and the order of its placeholders."""

from __future__ import annotations

import functools
import re

from kconvert.errors import ManifestError

_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")
_PLACEHOLDER = re.compile(r"\{([LEM])\}")


def name_key(pattern: str) -> str:
    """A pattern's numbers (dot-delimited) and placeholders as '#': every name the pattern generates has this key."""
    return _NUM.sub("#", pattern.replace("{L}", "0").replace("{E}", "0").replace("{M}", "0"))


def tensor_key(name: str) -> str:
    """A stored name's key (its dot-delimited numbers as '#'): the rules that may name it share it."""
    return _NUM.sub("#", name)


def placeholders(pattern: str) -> tuple[str, ...]:
    """The pattern's {L}/{E}/{M} in order: the groups of its regex."""
    return tuple(_PLACEHOLDER.findall(pattern))


@functools.lru_cache(maxsize=None)
def rule_regex(pattern: str) -> re.Pattern:
    """The pattern as a regex reading each placeholder's number, compiled when a name is first classified against
    it: a valid checkpoint's groups are mostly matched by generated names, so most patterns never are."""
    return re.compile(re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
                      .replace(r"\{M\}", r"(?P<M>\d+)") + "$")


def scale_block(value, part: str, tensor: str | None) -> tuple[int, int] | None:
    """A rule's own FP8 scale grid (`scale_block = [rows, cols]`; V4.1's Engram rows: [1, 32]), or None."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ManifestError(f"scale_block must be two positive integers, is {value!r}", file=f"parts/{part}.toml",
                            tensor=tensor)
    return int(value[0]), int(value[1])


def stored_stage_count(names, pattern: str) -> int:
    """How many draft stages `names` hold under `pattern` ("mtp.{M}."): stages 0, 1, ... up to the first one absent
    (a stage past a gap is then a name the manifest does not know, refused as such)."""
    head, _, tail = pattern.partition("{M}")
    number = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail), re.ASCII)
    seen = {int(m[1]) for n in names if n.startswith(head) and (m := number.match(n))}
    count = 0
    while count in seen:
        count += 1
    return count
