"""`kconvert inspect`: what a checkpoint holds, from config.json and headers only."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from kconvert.convert.export.expert_dtype import source_disagreement
from kconvert.family.variants import recognise
from kconvert.inspect.disagreements import disagreements
from kconvert.plan.rank_bytes import COMPONENTS
from kconvert.source.checkpoint import Checkpoint

TEXT_ACTIVE = ("attention", "kda", "compressor", "indexer", "mhc", "attn_res", "latent", "shared_experts", "dense_mlp",
               "router", "hash_router", "norm", "embed", "head")


@dataclass
class Summary:
    source: str
    family: str
    architectures: list[str]
    model: dict
    params: dict[str, int]
    total_params: int
    active_params: int
    formats: list[dict] = field(default_factory=list)
    files: int = 0
    bytes_on_disk: int = 0
    tensors: int = 0
    quantization: dict | None = None  # {"format": fp8-block | w4a16 | ..., "scheme": ...} of a quantized checkpoint
    kind: str = "checkpoint"
    warnings: list[str] = field(default_factory=list)  # what a serving engine would misread though kconvert reads it
    variant: dict | None = None  # the release it is (the family manifest's [[family.variants]]), None: none matches

    def to_json(self) -> dict:
        return asdict(self)


def summarize(ck: Checkpoint) -> Summary:
    """Validate `ck` against its manifest and count what it holds (no tensor data is read)."""
    grouped = ck.grouped  # validated; tensors stored alike counted a bucket at a time
    params: dict[str, int] = defaultdict(int)
    formats: dict[tuple[str, str], dict] = {}
    for b in grouped.buckets:
        info, t, count = b.info, b.sample, len(b.names)
        numel, key = t.numel * count, (t.format, t.stored_dtype)
        params[info.component] += numel
        row = formats.get(key)
        if row is None:
            row = formats[key] = {"format": t.format, "dtype": key[1], "tensors": 0, "params": 0, "bytes": 0}
        row["tensors"] += count
        row["params"] += numel
        row["bytes"] += t.stored_bytes * count
    tc = ck.text_config
    text = ck.model.text
    n_experts, per_tok = text.expert_count, text.experts_per_token
    active = sum(params[c] for c in TEXT_ACTIVE)
    if n_experts:
        active += params["routed_experts"] * per_tok // n_experts
    vision = next((p for p in ck.model.parts if p.group == "vision"), None)
    model = {
        "layers": text.layer_count,
        "mtp_layers": text.extra_layers,
        "dense_layers": int(tc.get("first_k_dense_replace") or 0),
        "hidden_size": tc.get("hidden_size"),
        "attention_heads": tc.get("num_attention_heads"),
        "routed_experts": n_experts,
        "experts_per_token": per_tok,
        # the draft stages' own bank where it differs (DeepSeek-V4.1-Flash's DSpark: 128 experts, 3 a token)
        "draft_experts": list(ck.model.expert_bank(text.layer_count))
        if text.extra_layers and ck.model.expert_bank(text.layer_count) != (n_experts, per_tok) else None,
        "shared_experts": text.shared_experts,
        "vocab_size": tc.get("vocab_size"),
        "sparse_attention_topk": tc.get("index_topk"),
        "vision_layers": vision.layer_count if vision else 0,
        "max_position_embeddings": tc.get("max_position_embeddings"),
    }
    scheduled = next((p for p in ck.model.parts if p.schedules), None)
    if scheduled is not None:  # decoder layers by kind (V4: attention kinds, hash / top-k routing); MTP aside
        model["layer_kinds"] = {name: dict(Counter(kinds[:scheduled.layer_count]))
                                for name, kinds in scheduled.schedules.items()}
    sizes = [h.size for h in ck.files.values() if h is not None]
    bytes_on_disk = sum(sizes) if len(sizes) == len(ck.files) else sum(e.nbytes for e in ck.stored.values())
    return Summary(
        source=ck.source, family=ck.family, architectures=list(ck.config.get("architectures") or []), model=model,
        params={c: params[c] for c in COMPONENTS if params.get(c)}, total_params=sum(params.values()),
        active_params=active, formats=sorted(formats.values(), key=lambda r: -r["bytes"]),
        files=len(ck.files), bytes_on_disk=bytes_on_disk, tensors=ck.tensor_count, quantization=_quantization(ck),
        warnings=list(filter(None, [source_disagreement(ck), *disagreements(ck)])),
        variant=_variant(ck),
    )


class _StoredDtypes:
    """A checkpoint's stored name -> dtype, read off its header entries as asked (200k+ of them in a release)."""

    def __init__(self, stored):
        self.stored = stored

    def get(self, name: str):
        e = self.stored.get(name)
        return None if e is None else e.dtype

    def items(self):
        return ((name, e.dtype) for name, e in self.stored.items())


def _variant(ck: Checkpoint) -> dict | None:
    v = recognise(ck.model.family, ck.config, _StoredDtypes(ck.stored))
    return None if v is None else v.to_json()


def _quantization(ck: Checkpoint) -> dict | None:
    """The export format its quantization_config declares (a `kconvert export` or a release in one of those
    formats) and the registry scheme behind it; None when unquantized."""
    if not ck.quantization_config:
        return None  # without importing the export table (and the scheme modules): most sources are bf16
    from kconvert.convert.export.table import EXPORT_FORMATS, format_of

    fmt = format_of(ck.quantization_config)
    if fmt == "none":
        return None
    qc = ck.quantization_config
    scheme = EXPORT_FORMATS[fmt].scheme if fmt in EXPORT_FORMATS else RELEASE_FORMATS.get(qc.get("format"))
    return {"format": fmt or f"{qc.get('quant_method')}/{qc.get('format')}", "scheme": scheme}


# quantized release formats that are no export format, by the registry scheme they are another encoding of
RELEASE_FORMATS = {"mxfp4-pack-quantized": "fp4"}  # Kimi K3's routed experts
