"""Resolve a Hugging Face Hub repo id to local files (honouring HF_HUB_OFFLINE), or to remote
headers only (for `inspect`/`plan` without downloading weights)."""

from __future__ import annotations

import re
from pathlib import Path

from kconvert.errors import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
META_FILES = ["*.json", "tiktoken.model", "*.tiktoken", "*.jinja", "*.txt"]


def looks_like_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and not Path(src).exists()


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def snapshot(repo_id: str, *, revision: str | None = None, weights: bool = True) -> Path:
    """Local snapshot directory of `repo_id` (metadata only unless `weights`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = META_FILES + (["*.safetensors"] if weights else [])
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=_offline()))
    except LocalEntryNotFoundError:
        mode = "HF_HUB_OFFLINE is set and" if _offline() else "the Hub cannot be reached and"
        raise CheckpointError(f"{mode} the repo is not in the local Hugging Face cache", file=repo_id) from None
    except RepositoryNotFoundError:
        raise CheckpointError("no such repo on the Hub (or no access: set HF_TOKEN)", file=repo_id) from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"could not download from the Hub: {e}", file=repo_id) from None


def remote_headers(repo_id: str, *, revision: str | None = None) -> dict[str, dict]:
    """{filename: {tensor: {dtype, shape, data_offsets}}} read with HTTP range requests (no weights)."""
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(repo_id, revision=revision)
    except Exception as e:  # network / auth / not safetensors: one line for the user
        raise CheckpointError(f"could not read safetensors headers from the Hub: {e}", file=repo_id) from None
    return {fname: {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                    for name, t in fm.tensors.items()}
            for fname, fm in meta.files_metadata.items()}
