"""Issue 55's classes, tried with values held out from the ones the fixes were written against (other ids, other
kinds, other files): each is one line naming the file, exit 2, no traceback, within the case's deadline, and no
complete-looking OUT. The classes: configs only the engine used to check (V4.1 roles, Engram and DSpark keys, V4's
DSpark targets), silent fallbacks (activations, vision kinds, projector types, heads, quantization claims), side files
the engine reads (Engram token map, chat template) and their containment at run time, prompt lengths and types,
pack / unpack on a directory they cannot write, --rank, and the work directory never named."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from helpers import assert_one_line_error, cli_here

DEADLINE_S = 60  # a guard against work done before the refusal, not a speed target


def _edit(src: Path, change: dict, section: str = "text_config") -> None:
    cfg = json.loads((src / "config.json").read_text())
    where = cfg if section == "." else cfg[section]
    for key, value in change.items():
        *heads, last = key.split(".")
        for h in heads:
            where = where.setdefault(h, {})
        where[last] = value
    (src / "config.json").write_text(json.dumps(cfg))


def _refused(args, *needles, out: Path | None = None):
    t = time.perf_counter()
    r = cli_here(*args)
    assert time.perf_counter() - t < DEADLINE_S
    assert_one_line_error(r, *needles)
    if out is not None:
        assert not (out / "kconvert.json").exists()
    return r


CONFIG_CASES = [
    # (preset, section, change, needles): configs the engine used to refuse after a finished conversion
    ("tiny-dsv41", "text_config", {"candidate_source_layer_id": 5}, ["candidate_source_layer_id = 5", "no indexer"]),
    ("tiny-dsv41", "text_config", {"candidate_source_layer_id": -2}, ["candidate_source_layer_id = -2"]),
    ("tiny-dsv41", "text_config", {"candidate_source_layer_id": 8.0}, ["candidate_source_layer_id = 8.0"]),
    ("tiny-dsv41", "text_config", {"candidate_source_layer_id": True}, ["candidate_source_layer_id = True"]),
    ("tiny-dsv41", "text_config", {"kv_source_layer_ids": [0, 4]}, ["kv_source_layer_ids names layer 0",
                                                                     "compresses nothing"]),
    ("tiny-dsv41", "text_config", {"compress_ratios": [0, 2, 3, 2, 1, 1, 1, 1, 0, 0]},
     ["compress_ratios: layer 2 reads compressed state made at other rates"]),
    ("tiny-dsv41", "text_config", {"engram_compressed_vocab_size": 1025}, ["engram_compressed_vocab_size = 1025"]),
    ("tiny-dsv41", "text_config", {"engram_pad_token_id": -1}, ["engram_pad_token_id = -1"]),
    ("tiny-dsv41", "text_config", {"engram_pad_token_id": 1024}, ["engram_pad_token_id = 1024"]),
    ("tiny-dsv41", "text_config", {"dspark_block_size": 257}, ["dspark_block_size = 257"]),
    ("tiny-dsv41", "text_config", {"dspark_block_size": "5"}, ["dspark_block_size = '5'"]),
    ("tiny-dsv41", "text_config", {"dspark_noise_token_id": 1024}, ["dspark_noise_token_id = 1024"]),
    ("tiny-dsv41", "text_config", {"engram_num_embeddings": [272, 347]}, ["engram_num_embeddings = 347"]),
    ("tiny-dsv41", "text_config", {"hc_eps": None}, ["hc_eps = None"]),
    ("tiny-dsv41", "text_config", {"scoring_func": "sparsemax"}, ["scoring_func = 'sparsemax'"]),
    ("tiny-dsv41", "text_config", {"rope_scaling.type": "longrope"}, ["rope_scaling.type = 'longrope'"]),
    ("tiny-dsv4-dspark", ".", {"dspark_target_layer_ids": [0, 4]}, ["dspark_target_layer_ids = [0, 4]"]),
    ("tiny-dsv4-dspark", ".", {"dspark_target_layer_ids": [-2, 1]}, ["dspark_target_layer_ids"]),
    ("tiny-dsv4-dspark", ".", {"dspark_target_layer_ids": [2, 2]}, ["dspark_target_layer_ids", "twice"]),
    ("tiny-dsv4-dspark", ".", {"dspark_block_size": 10**6}, ["dspark_block_size = 1000000"]),
    ("tiny-dsv4-dspark", ".", {"dspark_noise_token_id": -7}, ["dspark_noise_token_id = -7"]),
    # silent fallbacks
    ("tiny-k25-dsv32", "text_config", {"hidden_act": "relu"}, ["text_config.hidden_act = 'relu'", "silu"]),
    ("tiny-kimi-k3", "text_config", {"hidden_act": "gelu_new"}, ["text_config.hidden_act = 'gelu_new'", "situ"]),
    ("tiny-k25-dsv32", "vision_config", {"model_type": "clip_vision_model"}, ["vision_config.model_type"]),
    ("tiny-kimi-k3", "vision_config", {"mm_projector_type": "mlp2x_gelu"}, ["vision_config.mm_projector_type",
                                                                             "patchmergerv2"]),
    ("tiny-kimi-k3", "vision_config", {"model_type": "siglip_vision_model"}, ["moonvit3d"]),
    ("tiny-k25-dsv32", "vision_config", {"num_attention_heads": 3}, ["vision_config", "rotary_heads"]),
    ("tiny-kimi-k3", "vision_config", {"vt_num_attention_heads": 5}, ["vision_config", "rotary_heads"]),
    ("tiny-dsv41", "vision_config", {"model_type": "siglip"}, ["vision_config.model_type = 'siglip'"]),
    ("tiny-k25-dsv32", "vision_config", {"hidden_act": "swish"}, ["vision_config.hidden_act = 'swish'"]),
]


@pytest.mark.parametrize("preset, section, change, needles", CONFIG_CASES,
                         ids=[f"{p}-{next(iter(c))}-{c[next(iter(c))]!r}" for p, _, c, _ in CONFIG_CASES])
def test_configs_the_engine_would_refuse_are_refused_before_any_work(checkpoint, copy_checkpoint, tmp_path, preset,
                                                                     section, change, needles):
    src = copy_checkpoint(checkpoint(preset))
    _edit(src, change, section)
    _refused(["inspect", src], "config.json", *needles)
    _refused(["shard", src, tmp_path / "out", "--tp", "1"], "config.json", *needles, out=tmp_path / "out")


K3_CLAIMS = [({"config_groups.group_0.weights.group_size": 128}, "group_size = 128"),
             ({"config_groups.group_0.weights.type": "int"}, "type = 'int'"),
             ({"format": "float-quantized"}, "format = 'float-quantized'"),
             ({"config_groups.group_0.format": "nvfp4-pack-quantized"}, "format = 'nvfp4-pack-quantized'"),
             ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method = 'fp8'")]


@pytest.mark.parametrize("change, needle", K3_CLAIMS, ids=[n for _, n in K3_CLAIMS])
def test_a_quantization_config_contradicting_the_stored_bytes(checkpoint, copy_checkpoint, tmp_path, change, needle):
    src = copy_checkpoint(checkpoint("tiny-kimi-k3"))
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg["text_config"]["quantization_config"]
    for key, value in change.items():
        *heads, last = key.split(".")
        where = qc
        for h in heads:
            where = where[h]
        where[last] = value
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(["inspect", src], "config.json", "text_config.quantization_config", needle, "MXFP4")
    _refused(["shard", src, tmp_path / "out", "--tp", "1"], needle, out=tmp_path / "out")


def test_k3s_incomplete_ignore_list_still_converts(checkpoint, copy_checkpoint):
    """The release's `ignore` omits BF16-stored tensors (FACTS.md): a tensor's scheme is read from its bytes."""
    src = copy_checkpoint(checkpoint("tiny-kimi-k3"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["ignore"] = ["re:.*self_attn.*", "lm_head"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert cli_here("inspect", src).returncode == 0


MAPS = [('{"0": 1}', "non-empty JSON list"), ("[0, 1.5]", "entry 1 = 1.5"), ("[3, -4]", "entry 1 = -4"),
        ("[0, 1, 2]", "3 entries for a tokenizer of 1024 tokens"), ("[0]", "1 entries"), ("[", "not valid JSON")]


@pytest.mark.parametrize("text, needle", MAPS, ids=[m for m, _ in MAPS])
def test_a_bad_engram_token_map_is_refused_when_shard_starts(checkpoint, copy_checkpoint, tmp_path, text, needle):
    src = copy_checkpoint(checkpoint("tiny-dsv41"))
    (src / "engram_token_map.json").write_text(text)
    _refused(["shard", src, tmp_path / "out", "--tp", "1"], "engram_token_map.json", needle, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before OUT was made


def test_a_malformed_chat_template_is_refused_when_shard_starts(checkpoint, copy_checkpoint, tmp_path):
    src = copy_checkpoint(checkpoint("tiny-k25-dsv32"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] "}]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    _refused(["shard", src, tmp_path / "out", "--tp", "1"], "tokenizer_config.json", "chat_template[0]",
             out=tmp_path / "out")


def test_the_engine_opens_the_token_map_through_the_containment_rule(conversion, tmp_path):
    """A conversion whose engram_token_map.json is a symlink leading out of it: refused by the engine, as shard
    refuses the same link in a source."""
    from engine.model import Model
    from kconvert.distributed import Group
    from kconvert.errors import CheckpointError

    out = tmp_path / "out"
    shutil.copytree(conversion("tiny-dsv41", tp=1), out)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(out / "engram_token_map.json", outside)
    (out / "engram_token_map.json").unlink()
    (out / "engram_token_map.json").symlink_to(outside)
    with pytest.raises(CheckpointError) as e:
        Model.empty(out, Group())
    assert "symlink leading out" in e.value.one_line() and "engram_token_map.json" in e.value.one_line()


PROMPTS = [([{"kind": "chat", "chat": [{"role": "user", "content": [1, 2]}]}], "chat turn 0"),
           ([{"kind": "chat", "chat": [{"role": "robot", "content": "hi"}]}], "chat turn 0"),
           ([{"kind": "short", "text": 7}], "`text` must be a string"),
           ([{"kind": "image", "text": "x", "image": "cat.png"}], "no image file is read"),
           ([{"kind": "image", "text": "x", "image": {"seed": "1", "width": 8, "height": 8}}], "image.seed"),
           ([{"kind": "image", "text": "x", "image": {"seed": 1, "width": 10**6, "height": 8}}], "image.width"),
           ([{"kind": "long", "text": "tokens " * 9000}], "over --max-prompt-tokens 8192")]


@pytest.mark.parametrize("prompts, needle", PROMPTS, ids=[n for _, n in PROMPTS])
def test_reference_prompts_of_wrong_types_or_length(checkpoint, tmp_path, prompts, needle):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(prompts))
    _refused(["reference", checkpoint("tiny-k25-dsv32"), "--out", tmp_path / "ref.safetensors", "--prompts", f], needle)
    assert not (tmp_path / "ref.safetensors").exists()


def test_the_prompt_length_bound_is_a_flag(checkpoint, tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps([{"kind": "long", "text": "tokens " * 300}]))
    _refused(["reference", checkpoint("tiny-k25-dsv32"), "--out", tmp_path / "r", "--prompts", f,
              "--max-prompt-tokens", "100"], "over --max-prompt-tokens 100")
    _refused(["reference", checkpoint("tiny-k25-dsv32"), "--out", tmp_path / "r", "--prompts", f,
              "--max-prompt-tokens", "٣٠٠"], "--max-prompt-tokens", "ASCII digits")


@pytest.mark.parametrize("command, rank", [("unpack", "٢"), ("pack", "²"), ("verify-files", "３"), ("load", "1٠")])
def test_rank_takes_ascii_digits_everywhere(conversion, command, rank):
    _refused([command, conversion("tiny-k25-dsv32", tp=2), "--rank", rank], "--rank", "ASCII digits")


@pytest.mark.parametrize("command", ["pack", "unpack"])
def test_pack_on_a_directory_it_cannot_write(conversion, tmp_path, monkeypatch, command):
    """A read-only mount (EROFS) or permissions: one line before any file is touched (root passes permission checks,
    so the read-only answer is stood in for)."""
    out = tmp_path / "ro"
    shutil.copytree(conversion("tiny-k25-dsv32", tp=1), out)
    if command == "unpack":
        assert cli_here("pack", out).returncode == 0
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == out and mode & os.W_OK
                        else real(p, mode, **kw))
    _refused([command, out], "not writable", str(out))
    assert not (out / ".kconvert").exists()


def test_pack_when_the_journal_cannot_be_made(conversion, tmp_path, monkeypatch):
    import errno

    out = tmp_path / "ro"
    shutil.copytree(conversion("tiny-k25-dsv32", tp=1), out)
    real = Path.mkdir

    def mkdir(self, *a, **kw):
        if self == out / ".kconvert":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    _refused(["pack", out], "not writable (Read-only file system)")


def test_verify_never_names_its_work_directory(conversion, checkpoint, tmp_path):
    """verify --force against another checkpoint's reference: the faithfulness reference it makes in its work
    directory disagrees; the line says so without naming that directory."""
    from kconvert.io.workdir import base_dir

    ref = tmp_path / "other.safetensors"
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"kind": "short", "text": "x = [i * i for i in range(9)]"}]))
    assert cli_here("reference", checkpoint("tiny-dsv41"), "--out", ref, "--prompts", prompts).returncode == 0
    r = cli_here("verify", conversion("tiny-k25-dsv32", tp=1, quant="fp8"), "--reference", ref, "--force")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr
    assert str(base_dir()) not in r.stderr and "kconvert-work" not in r.stderr, r.stderr


def test_reference_leaves_no_compiler_cache_behind(checkpoint, tmp_path, monkeypatch):
    """MLX compiles its CPU kernels into $TMPDIR/mlx/ (Kimi K3's reference runs on MLX): inside the command's own work
    directory now, removed with it."""
    import tempfile

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"kind": "short", "text": "def main(): return [i for i in range(3)]"}]))
    r = cli_here("reference", checkpoint("tiny-kimi-k3"), "--out", tmp_path / "ref.safetensors", "--prompts", prompts)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp.iterdir()) in ([], ["kconvert-work"]), list(tmp.rglob("*"))[:5]
    assert not any((tmp / "kconvert-work").iterdir())


@pytest.mark.parametrize("missing", ["mtp.1.confidence_head.proj.weight", "mtp.0.main_norm.weight",
                                     "mtp.1.markov_head.head.weight", "mtp.0.ffn.gate.weight"])
def test_a_v41_drafter_stage_missing_a_tensor(tmp_path, missing):
    """A drafter stage the checkpoint holds but missing a tensor (held out from tests/families/dsv41's): shard refuses
    naming it, so verify-files never vouches for a conversion plain chat then refuses."""
    from kconvert.fixtures.models.dsv41 import v41_config, write_v41_checkpoint

    src = tmp_path / "src"
    write_v41_checkpoint(src, v41_config(), seed=5, without=(missing,))
    _refused(["shard", src, tmp_path / "out", "--tp", "1"], missing, out=tmp_path / "out")
