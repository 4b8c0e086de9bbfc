"""A tiny, safe evaluator for the arithmetic in manifests (shapes and layer conditions).

Allowed: integer/float/bool constants, names looked up in a mapping (config keys, `L`, `E`),
attribute access into nested dicts (`vision_config.hidden_size`), integer subscripts
(`merge_kernel_size[0]`, `attn_kind[L]`), + - * // % /, comparisons, and/or/not, and `if ... else ...`.
Nothing else: manifests are data, never code. Every operand of arithmetic or a comparison must be
a number (bools count as 0/1): config.json is untrusted, and a string or list there must not be
multiplied into a huge value. Results are bounded (|x| < 2**63, finite), division by zero is an error.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from collections.abc import Mapping

from kconvert.errors import ManifestError, MissingKey

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Div: operator.truediv}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}
LIMIT = 2**63  # no shape or count in any model comes near: a bigger result means a bad config


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ManifestError(f"bad manifest expression {text!r}: {e.msg}") from None


def evaluate(text: str | int, env: Mapping):
    """Evaluate `text` against `env` to a number. Raises MissingKey for an absent name, ManifestError
    for anything that is not arithmetic on numbers."""
    if _is_number(text):
        return text
    return _number(_eval(_parse(str(text)), env, str(text)), text)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v))


def _number(v, text):
    if not _is_number(v):
        raise ManifestError(f"config value {_show(v)} is not a number (needed by {text!r})")
    if abs(v) >= LIMIT:
        raise ManifestError(f"value {v:.3g} out of range (needed by {text!r})")
    return v


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _eval(node: ast.expr, env: Mapping, text: str):
    """Names, attributes and subscripts may yield containers (to index into); operators take numbers only."""
    if isinstance(node, ast.Constant) and _is_number(node.value):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise MissingKey(f"config has no {node.id!r} (needed by {text!r})")
        return env[node.id]
    if isinstance(node, ast.Attribute):
        base = _eval(node.value, env, text)
        if not isinstance(base, Mapping) or node.attr not in base:
            raise MissingKey(f"config has no {node.attr!r} (needed by {text!r})")
        return base[node.attr]
    if isinstance(node, ast.Subscript):  # a constant or a layer index (`compress_kind[L]`)
        index = _eval(node.slice, env, text)
        base = _eval(node.value, env, text)
        if type(index) is not int or not isinstance(base, (list, tuple)) or not -len(base) <= index < len(base):
            raise ManifestError(f"config value {_show(base)} has no item {_show(index)} (needed by {text!r})")
        return base[index]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left = _number(_eval(node.left, env, text), text)
        right = _number(_eval(node.right, env, text), text)
        try:
            return _number(_BIN[type(node.op)](left, right), text)
        except (ZeroDivisionError, OverflowError):
            raise ManifestError(f"division by zero or overflow in {text!r} (a config value is 0 or too large)") from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        v = _number(_eval(node.operand, env, text), text)
        return -v if isinstance(node.op, ast.USub) else not v
    if isinstance(node, ast.Compare) and all(type(op) in _CMP for op in node.ops):
        left = _number(_eval(node.left, env, text), text)
        for op, right_node in zip(node.ops, node.comparators):
            right = _number(_eval(right_node, env, text), text)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        values = (_number(_eval(v, env, text), text) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _number(_eval(node.test, env, text), text) else node.orelse, env, text)
    raise ManifestError(f"manifest expression {text!r} uses something other than arithmetic on config keys")
