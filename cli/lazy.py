"""What keeps `kconvert --help`, `--version` and a mistyped command fast: nothing under cli/ imports torch,
transformers or the engine when the module loads (tests/cli/test_cli_startup.py). A command imports the library
it calls inside its function; an option whose choices come from a registry that needs torch (quantization
schemes, export formats) reads them only when that option is shown or parsed (`RegistryChoice`)."""

from __future__ import annotations

from typing import Callable, Iterable

import click


class RegistryChoice(click.Choice):
    """click.Choice whose names come from a registry, looked up on first use (a command's --help or its
    parsing), never when the CLI starts; the names are the registry's own, so help cannot drift from it."""

    def __init__(self, names: Callable[[], Iterable[str]], case_sensitive: bool = True, check: bool = True) -> None:
        self._names, self._choices, self._check = names, None, check
        self.case_sensitive = case_sensitive

    def convert(self, value, param, ctx):
        # check=False: the help lists the names, the library refuses others with its own one-line error
        return super().convert(value, param, ctx) if self._check else value

    @property
    def choices(self) -> tuple[str, ...]:
        if self._choices is None:
            self._choices = tuple(self._names())
        return self._choices


class RegistryHelpOption(click.Option):
    """click.Option whose help text is made from a registry when --help shows it (`help_from()`), not at start-up."""

    def __init__(self, *args, help_from: Callable[[], str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._help_from = help_from

    def get_help_record(self, ctx):
        self.help = self._help_from()
        return super().get_help_record(ctx)


def device_help() -> str:
    """The devices `kconvert.devices.resolve` takes, from its own list of accelerator kinds."""
    from kconvert.devices import KNOWN

    return f"auto (an accelerator if there is one, else cpu), cpu, or {', '.join(f'{k}[:i]' for k in KNOWN)}."


def shard_schemes() -> tuple[str, ...]:
    from kconvert.quant.registry import SHARD_SCHEMES

    return SHARD_SCHEMES


def scale_formats() -> tuple[str, ...]:
    from kconvert.quant.scheme import SCALE_FORMATS

    return SCALE_FORMATS


def export_formats() -> tuple[str, ...]:
    from kconvert.convert.export.table import FORMATS

    return FORMATS


def int4_scale_rules() -> tuple[str, ...]:
    from kconvert.quant.int4_group import INT4_SCALES

    return INT4_SCALES
