"""The output directory of `kconvert shard` and `export` (prepared through run.Run): which state it is in
(fresh, resumable, complete, someone else's) and the side files (config, tokenizer) copied beside the shards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kconvert.errors import CheckpointError, KConvertError, UsageError, WriteError
from kconvert.family.release_config import release_config
from kconvert.io.atomic import write_atomic, write_error
from kconvert.io.paths import contained
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, check_regular, read_json
from kconvert.source.checkpoint import Checkpoint
from kconvert.disk_format.catalog import MANIFEST
from kconvert.disk_format.journal import JOURNAL_DIR

COPY_PATTERNS = ("config.json", "generation_config.json", "tokenizer_config.json", "tiktoken.model", "*.tiktoken",
                 "special_tokens_map.json", "chat_template.jinja", "preprocessor_config.json", "processor_config.json",
                 "tokenizer.json", "engram_token_map.json")


def remove_stale_temporaries(out: Path, files: list[str]) -> None:
    """Remove what a killed run left of `files` (`.NAME.tmp-PID`, io/safetensors_write.py), and only theirs (other
    processes of the same conversion write other files): one listing per directory, not one glob per file (a
    release's conversion writes thousands)."""
    by_dir: dict[Path, set[str]] = {}
    for rel in files:
        path = out / rel
        by_dir.setdefault(path.parent, set()).add(path.name)
    for folder, names in by_dir.items():
        try:
            entries = os.listdir(folder)
        except FileNotFoundError:
            continue
        for e in entries:
            if e.startswith(".") and ".tmp-" in e and any(e.startswith(f".{n}.tmp-") for n in names):
                (folder / e).unlink(missing_ok=True)


def check_paths(ck: Checkpoint, out: Path) -> None:
    src = ck.root.resolve()
    if out == src or src in out.parents:
        raise UsageError("the output directory is inside the source checkpoint; choose a path outside it", file=str(out))
    if out.exists() and not out.is_dir():
        raise UsageError("output path exists and is not a directory", file=str(out))


def prepare_out(out: Path, identity: dict, overwrite: bool, follower: bool = False, *, marker: str = MANIFEST,
                job_of=lambda meta: meta.get("job")) -> str:
    """Make `out` ready for this job: 'fresh', 'resume' or 'complete'. Refuses to mix jobs. `marker` is the
    file written last (kconvert.json; an export's index) and `job_of` finds the job identity in it."""
    journal = out / JOURNAL_DIR
    job_file = journal / "job.json"
    if (out / marker).exists():
        meta = _read_json(out / marker)
        if job_of(meta) == identity and not overwrite:
            return "complete"
        if not overwrite:
            raise UsageError("the output directory holds a different conversion (other source or arguments); "
                             "pass --overwrite to replace it or choose another directory", file=str(out))
    elif job_file.exists():
        if _read_json(job_file) == identity:
            return "resume"
        if not overwrite and not follower:
            raise UsageError("the output directory holds an unfinished conversion with other arguments or another "
                             "source; re-run that command to finish it, or pass --overwrite", file=str(out))
    elif out.exists() and any(out.iterdir()) and not follower:
        raise UsageError("the output directory is not empty and holds no kconvert conversion; choose an empty one",
                         file=str(out))
    if follower:
        return "resume"
    if overwrite and out.exists():
        if not ((out / marker).exists() or job_file.exists() or not any(out.iterdir())):
            raise UsageError("refusing to --overwrite a directory that is not a kconvert output", file=str(out))
        shutil.rmtree(out)
    try:
        journal.mkdir(parents=True, exist_ok=True)
        write_atomic(job_file, json.dumps(identity, indent=1).encode())
    except WriteError:
        raise  # already one line naming the file (and an OSError: do not re-wrap it below)
    except PermissionError:
        raise UsageError("the output directory is not writable", file=str(out)) from None
    except OSError as e:
        raise UsageError(f"cannot create the output directory: {e.strerror}", file=str(out)) from None
    return "fresh"


def copy_side_files(ck: Checkpoint, out: Path, patterns: tuple[str, ...] = COPY_PATTERNS) -> None:
    """Config and tokenizer files, each a regular file inside the source (a symlink leading out is refused);
    config.json in the release's own spelling (kconvert/family/release_config.py), whatever the source's."""
    for pattern in patterns:
        if pattern == "config.json":
            write_atomic(out / pattern, config_json(release_config(ck.config, ck.model.family)))
            continue
        for f in sorted(ck.root.glob(pattern)):
            src = contained(ck.root, f.name, named_in=ck.root)
            check_regular(src)  # a FIFO would block the copy; a device would never end
            if src.stat().st_size > MAX_TEXT:
                raise CheckpointError(f"side file of {src.stat().st_size} bytes: over the {MAX_TEXT >> 20} MiB "
                                      "limit for config and tokenizer files", file=str(src))
            try:
                shutil.copyfile(src, out / f.name)
            except OSError as e:
                raise write_error(e, out / f.name) from None


def config_json(config: dict) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _read_json(path: Path) -> dict:
    """A JSON object, or {} when the file is damaged (then it matches no job and needs --overwrite)."""
    try:
        obj = read_json(path, limit=MAX_CONFIG)
    except (OSError, KConvertError):
        return {}
    return obj if isinstance(obj, dict) else {}
