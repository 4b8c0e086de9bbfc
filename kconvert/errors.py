"""Every error kconvert raises on purpose, in one place.

Each is a KConvertError (the CLI prints `one_line()` and exits with `exit_code`: 2 for bad input,
1 for a verify FAIL) and also the Python built-in that fits, so library callers can catch
`FileNotFoundError`, `ValueError` or `OSError` as they would anywhere else. Anything else reaching the CLI is
a bug in kconvert and is reported as an internal error (exit 3)."""

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


# --- inputs: checkpoints, converted directories, files
class CheckpointError(KConvertError, ValueError):
    """A checkpoint (source or converted) is unreadable, inconsistent or incomplete."""


class FormatError(CheckpointError):
    """A safetensors file (or its index) is malformed."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is not there."""


class ChecksumMismatch(CheckpointError):
    """The bytes of a file do not have the CRC-32 kconvert.json records."""


class TokenizerError(CheckpointError):
    """A tokenizer file (tiktoken.model, tokenizer_config.json) is malformed or lies outside the checkpoint."""


class ChatTemplateError(TokenizerError):
    """A chat template does not parse, is refused by the sandbox, or exceeds the rendering limits."""


class LoaderError(CheckpointError):
    """A converted checkpoint that cannot be loaded as asked."""


class NonFiniteError(CheckpointError):
    """NaN or Inf in a tensor, a scale or a result that must be finite."""


# --- model families
class ManifestError(KConvertError, ValueError):
    """No manifest matches, a manifest is malformed, or a tensor or config value disagrees with it."""


class MissingKey(ManifestError):
    """An expression named a config key the config does not have."""


# --- requests
class UsageError(KConvertError, ValueError):
    """Arguments that cannot work (bad size string, unknown preset, a tp degree that does not divide ...)."""


class DeviceError(UsageError):
    """The requested device does not exist on this machine."""


class ImageError(UsageError):
    """An image given to the engine is missing, unreadable, or too large to decode safely."""


class MissingDependency(UsageError, ImportError):
    """An optional package is needed for this command; the message says how to install it."""


class EngineError(KConvertError, ValueError):
    """The engine cannot run this model or these inputs as asked (layout, shapes, family)."""


# --- outputs
class WriteError(KConvertError, OSError):
    """Writing failed (permissions, I/O error); nothing half-written is left behind."""


class DiskFullError(WriteError):
    """No space left (or quota) while writing; the output stays resumable."""


# --- verdicts
class VerifyFailed(KConvertError):
    """The conversion ran but is not faithful (or its files are damaged): exit code 1."""

    exit_code = 1
