"""Optional (and core) third-party packages: what a missing one is needed for, and the exact command that
installs it into the running interpreter. The version pins come from kconvert's own installed metadata
(pyproject.toml), so they are written down once."""

from __future__ import annotations

import re
import shlex
import sys

from kconvert.errors import MissingDependency

# import name -> (distribution, extra or None for a core dependency, what needs it)
PACKAGES = {
    "transformers": ("transformers", "ref", "the reference implementation (fixture, reference, verify --against)"),
    "matplotlib": ("matplotlib", "plot", "verify --plot"),
    # the reference of the families no transformers release runs (Kimi K3); on Linux mlx needs its mlx-cpu backend
    "mlx": (("mlx", "mlx-cpu") if sys.platform == "linux" else "mlx", "mlx",
            "the MLX reference of Kimi K3 (reference, verify --against)"),
    "mlx_lm": ("mlx-lm", "mlx", "the MLX reference of Kimi K3's text model (reference, verify --against)"),
    "mlx_vlm": ("mlx-vlm", "mlx", "the MLX reference of DeepSeek-V4.1 and of Kimi K3's vision tower"),
    "compressed_tensors": ("compressed-tensors", "ref", "verify's independent fake-quantized reference"),
    "jinja2": ("jinja2", None, "chat templates"),
    "PIL": ("Pillow", None, "images"),
    "tiktoken": ("tiktoken", None, "the Kimi tokenizer"),
    "zstandard": ("zstandard", None, "compressed shards"),
    "safetensors": ("safetensors", None, "safetensors files"),
    "huggingface_hub": ("huggingface_hub", None, "Hub repo ids"),
    "numpy": ("numpy", None, "kconvert"),
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(dist: str, extra: str | None) -> str:
    """`dist` with the version kconvert declares for it (for that extra), or bare when not installed as a package."""
    try:
        from importlib.metadata import PackageNotFoundError, requires

        reqs = requires("kconvert") or []
    except PackageNotFoundError:
        reqs = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        if name and _norm(name.group()) == _norm(dist) and (extra is None or f'"{extra}"' in marker or not marker):
            return spec.strip()
    return dist


def install_command(module: str) -> str:
    """The pip command for `module`: its distribution(s) (MLX on Linux: mlx and its CPU backend) at kconvert's pins."""
    dists, extra, _ = PACKAGES[module]
    dists = (dists,) if isinstance(dists, str) else dists
    return f"{shlex.quote(sys.executable)} -m pip install " + " ".join(shlex.quote(requirement(d, extra)) for d in dists)


def missing(module: str) -> MissingDependency:
    """The one-line error for a package `module` (import name) that is not installed."""
    dist, extra, purpose = PACKAGES[module]
    dist = dist if isinstance(dist, str) else dist[0]
    kind = f"the `{extra}` extra" if extra else "a core dependency: the installation is incomplete"
    return MissingDependency(f"{dist} is not installed ({kind}, needed for {purpose}); install it with: "
                             f"{install_command(module)}")


def from_import_error(exc: ImportError) -> MissingDependency | None:
    """MissingDependency for an ImportError of a package listed above, None for anything else (a bug)."""
    root = (getattr(exc, "name", None) or "").split(".")[0]
    return missing(root) if isinstance(exc, ModuleNotFoundError) and root in PACKAGES else None


def require(module: str) -> None:
    """Fail early, before any work, when a package a requested option needs is missing."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == module:
            raise missing(module) from None
        raise
