"""click parameter types over kconvert/arguments.py, the one check of what a user types: whole numbers in
ASCII digits within bounds, finite floats within bounds. A refusal is kconvert's one line (exit 2), not
click's usage block."""

from __future__ import annotations

import click

from kconvert import arguments


class Whole(click.ParamType):
    name = "integer"

    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        return arguments.integer(value, _option(param), self.lo, self.hi)


class Real(click.ParamType):
    name = "float"

    def __init__(self, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        return arguments.number(value, _option(param), self.lo, self.hi, lo_open=self.lo_open)


def _option(param) -> str:
    return param.opts[0] if param is not None and param.opts else "value"


class Rank(click.ParamType):
    """A rank number (--rank, --stage, --tp-rank): kconvert.arguments.rank, the one parse of them."""

    name = "rank"

    def convert(self, value, param, ctx):
        return arguments.rank(value, _option(param))


RANK = Rank()
COUNT = Whole(1)  # ranks, stages, workers, threads, batch: at least one
SEED = Whole(0, 2**63 - 1)
