"""A tiny, safe evaluator for the arithmetic in manifests (shapes and layer conditions).

Allowed: integer/float/bool constants, names looked up in a mapping (config keys, `L`, `E`),
attribute access into nested dicts (`vision_config.hidden_size`), constant subscripts
(`merge_kernel_size[0]`), + - * // % /, comparisons, and/or/not, and `if ... else ...`.
Nothing else: manifests are data, never code.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Mapping

from kconvert.errors import ManifestError, MissingKey

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.Div: operator.truediv}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ManifestError(f"bad manifest expression {text!r}: {e.msg}") from None


def evaluate(text: str | int, env: Mapping):
    """Evaluate `text` against `env`. Raises MissingKey for an absent name, ManifestError otherwise."""
    if isinstance(text, (int, float)):
        return text
    return _eval(_parse(str(text)), env, str(text))


def _eval(node: ast.expr, env: Mapping, text: str):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool, str)):
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
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return _eval(node.value, env, text)[node.slice.value]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_eval(node.left, env, text), _eval(node.right, env, text))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        v = _eval(node.operand, env, text)
        return -v if isinstance(node.op, ast.USub) else not v
    if isinstance(node, ast.Compare) and all(type(op) in _CMP for op in node.ops):
        left = _eval(node.left, env, text)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, env, text)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, env, text) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env, text) else node.orelse, env, text)
    raise ManifestError(f"manifest expression {text!r} uses something other than arithmetic on config keys")
