"""DeepSeek-V4's own fp8-block layout (`X.weight` + a `X.scale` sidecar), written by `export` for the families whose
manifest says `export_encoding = { "fp8-block" = "deepseek-v4" }` (V4, V4.1, Kimi over V4 text): one `expert_dtype`
for the whole checkpoint, and every FP8 block scale in the dtype the readers take for it.

vLLM decides the scale dtype from `expert_dtype` alone (`DeepseekV4FP8Config.is_scale_e8m0`: e8m0 for "fp4",
float32 for "fp8"; an e8m0 byte beside "fp8" is read as a number, 2^-12 as 115.0, silently). So:
- the source stores its routed experts in FP4 -> `expert_dtype: fp4`: the experts FP4 (copied byte for byte; one
  stored otherwise is quantized to FP4, as vLLM reads one expert format), every FP8 scale e8m0 (V4-Flash, V4-Pro);
- otherwise -> `expert_dtype: fp8`: routed experts FP8 and every FP8 scale float32 (V4-Flash-Base); a source's
  e8m0-scaled blocks are copied, their scales re-encoded exactly in float32.
Which key each consumer reads: docs/EXPORT.md, "Scale dtypes as each consumer reads them".
"""

from __future__ import annotations

from kconvert.convert.export.table import EXPORT_FORMATS
from kconvert.source.stored_quant import source_scale_fmt
from kconvert.errors import UsageError
from kconvert.quant.scheme import DEEPSEEK_V4, DEEPSEEK_V4_F32
from kconvert.source.checkpoint import Checkpoint


def family_encoding(ck: Checkpoint, fmt: str) -> str:
    """How `fmt` lays its values out for this model: the format's own encoding, unless the family's text model has its
    own layout for it (the manifest's `export_encoding`)."""
    return ck.model.family.get("export_encoding", {}).get(fmt, EXPORT_FORMATS[fmt].encoding)


def expert_dtype(ck: Checkpoint, fmt: str) -> str | None:
    """The `expert_dtype` an export of `ck` as `fmt` writes: "fp4" when the source stores routed experts in FP4, else
    "fp8"; None when the export is not in DeepSeek-V4's layout. (A validated bucket's members are stored alike: one
    sample each.)"""
    if family_encoding(ck, fmt) != DEEPSEEK_V4:
        return None
    return "fp4" if any(b.sample.format == "fp4_packed" for b in ck.grouped.buckets) else "fp8"


def declared_expert_dtype(ck: Checkpoint) -> tuple[str, str]:
    """(the source's `expert_dtype`, where it says so) as vLLM reads it: the top level, the text config, then
    `quantization_config` (V4.1's spelling); absent, "fp4"."""
    for where, d in (("config.json", ck.config), ("text_config", ck.text_config),
                     ("quantization_config", ck.quantization_config)):
        if isinstance(d, dict) and "expert_dtype" in d:
            return str(d["expert_dtype"]), where
    return "fp4", "config.json (absent: vLLM's default)"


def source_disagreement(ck: Checkpoint) -> str | None:
    """One line when a DeepSeek-V4-layout source stores FP8 block scales in the dtype its `expert_dtype` does not
    mean (e8m0 for "fp4", float32 for "fp8": vLLM's rule), naming the first; else None. kconvert reads every scale by
    its stored dtype, which the safetensors header makes unambiguous (as SGLang does); vLLM would take e8m0 bytes as
    numbers beside "fp8" (2^-12 as 115.0) and round float32 scales to powers of two beside "fp4", silently."""
    if family_encoding(ck, "fp8-block") != DEEPSEEK_V4:
        return None
    declared, where = declared_expert_dtype(ck)
    want = {"fp4": "F8_E8M0", "fp8": "F32"}.get(declared)
    if want is None:
        return None
    off = [b for b in ck.grouped.buckets if b.sample.format == "block_fp8" and b.rule.scale_block is None
           and b.sample.parts["scale"].dtype != want]
    if not off:
        return None
    scale = off[0].sample.parts["scale"]
    more = sum(len(b.names) for b in off) - 1
    return (f"{scale.name} is {scale.dtype}{f' (and {more} more FP8 scales)' if more else ''}, but expert_dtype "
            f"{declared!r} ({where}) means {want} FP8 scales to vLLM, which would misread them silently: kconvert reads "
            f"each scale by its stored dtype; `kconvert export --format fp8-block` writes them consistent")


def encoding(ck: Checkpoint, fmt: str, experts: str | None) -> str:
    """The layout of the export's tensors: V4's with e8m0 `.scale` beside FP4 experts, float32 beside FP8 ones."""
    if experts == "fp8":
        return DEEPSEEK_V4_F32
    return DEEPSEEK_V4 if experts == "fp4" else family_encoding(ck, fmt)


def scale_format(ck: Checkpoint, asked: str | None, experts: str | None) -> str:
    """The value rule of the export's FP8 block scales (fp32: amax / 448; ue8m0: powers of two). `asked`: --scale-format.
    FP4 experts: e8m0 bytes hold only powers of two. FP8 experts: float32 holds either; by default a block-FP8
    source's own rule (its blocks are then copied), else V4's powers of two (exact in every reader, mlx-lm's log2
    included)."""
    if experts == "fp4":
        if asked == "fp32":
            raise UsageError("--scale-format fp32: DeepSeek-V4's layout with FP4 routed experts (expert_dtype fp4) "
                             "stores its FP8 scales as e8m0 powers of two")
        return "ue8m0"
    if asked:
        return asked
    if experts == "fp8" and ck.quantization_config.get("quant_method") != "fp8":
        return "ue8m0"
    return source_scale_fmt(ck)


def config_scale_fmt(encoding_: str, scale_fmt: str) -> str:
    """The `scale_fmt` the export's quantization_config names: the scales' storage dtype, as transformers reads the key
    (`ue8m0`: e8m0 parameters), so float32 `.scale` sidecars are never called ue8m0 whatever their values."""
    if encoding_ == DEEPSEEK_V4:
        return "ue8m0"
    return "fp32" if encoding_ == DEEPSEEK_V4_F32 else scale_fmt
