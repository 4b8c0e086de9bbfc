"""Typed errors. Every user-facing failure is a KConvertError: the CLI prints its one line and exits 2."""

from __future__ import annotations


class KConvertError(Exception):
    """Bad input or an impossible request. `file` and `tensor` name where, when known."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.message = message
        self.file = file
        self.tensor = tensor

    def one_line(self) -> str:
        where = []
        if self.file:
            where.append(str(self.file))
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        prefix = ": ".join(where)
        text = f"{prefix}: {self.message}" if prefix else self.message
        return " ".join(text.split())  # one line, always


class CheckpointError(KConvertError):
    """The source checkpoint is unreadable, inconsistent or incomplete."""


class FormatError(CheckpointError):
    """A safetensors file (or its index) is malformed."""


class ManifestError(KConvertError):
    """No manifest matches, a manifest is malformed, or a tensor disagrees with it."""


class UsageError(KConvertError):
    """Arguments that cannot work (bad size string, unknown preset, ...)."""
