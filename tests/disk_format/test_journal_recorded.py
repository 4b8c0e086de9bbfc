"""The journal's own lines are not decoded again at the end of a run (converted/journal.py): a line read back byte for
byte as this process wrote it is the record it encoded; any other line (another process's, a resumed run's, a line
changed on disk) is decoded, and a record JSON would not give back as it is (a tuple, a float) is never taken."""

from __future__ import annotations

from kconvert.disk_format.journal import JournalLog, read_done


def _file(out, rel: str, size: int) -> None:
    (out / rel).write_bytes(b"x" * size)


def test_own_lines_are_the_records_written(tmp_path):
    out, log = tmp_path, tmp_path / "done-0000.jsonl"
    _file(out, "a.safetensors", 3)
    _file(out, "b.safetensors", 5)
    recorded: dict = {}
    rec_a = {"file": "a.safetensors", "bytes": 3, "crc32": "0000000a", "tensors": {"w": "00000001"}}
    rec_b = {"file": "b.safetensors", "bytes": 5, "crc32": "0000000b", "tensors": {"v": "00000002"}}
    with JournalLog(log, recorded) as j:
        j.add_all([rec_a, rec_b])
    done = read_done([log], out, lambda r: r["bytes"], recorded)
    assert done["a.safetensors"] is rec_a and done["b.safetensors"] is rec_b  # taken, not decoded
    assert read_done([log], out, lambda r: r["bytes"]) == {"a.safetensors": rec_a, "b.safetensors": rec_b}


def test_other_lines_are_decoded(tmp_path):
    out, log = tmp_path, tmp_path / "done-0000.jsonl"
    _file(out, "a.safetensors", 3)
    _file(out, "c.safetensors", 4)
    recorded: dict = {}
    rec_a = {"file": "a.safetensors", "bytes": 3, "crc32": "0000000a", "tensors": {"w": "00000001"}}
    with JournalLog(log, recorded) as j:
        j.add(rec_a)
    # another process's (or an earlier run's) line, and this one's line changed on disk: both decoded
    raw = log.read_bytes().replace(b'"0000000a"', b'"0000000f"')
    log.write_bytes(raw + b'{"file":"c.safetensors","bytes":4,"crc32":"0000000c","tensors":{}}\n')
    done = read_done([log], out, lambda r: r["bytes"], recorded)
    assert done["a.safetensors"]["crc32"] == "0000000f" and done["a.safetensors"] is not rec_a
    assert done["c.safetensors"]["crc32"] == "0000000c"


def test_records_json_changes_are_never_taken(tmp_path):
    """A record holding a tuple (JSON gives a list back) or a float is decoded as any reader would see it."""
    out, log = tmp_path, tmp_path / "done-0000.jsonl"
    _file(out, "a.safetensors", 3)
    recorded: dict = {}
    rec = {"file": "a.safetensors", "bytes": 3, "crc32": "0000000a", "tensors": {}, "stored": {"chunks": (1, 2)}}
    with JournalLog(log, recorded) as j:
        j.add(rec)
    assert recorded == {}
    done = read_done([log], out, lambda r: r["bytes"], recorded)
    assert done["a.safetensors"]["stored"] == {"chunks": [1, 2]}
