"""Model hyper-parameters read from a converted checkpoint's config.json.

Which families the engine runs, where their text and vision configs sit and which config key names the
image placeholder come from the family manifests (`[family.engine]` in manifests/*.toml), not from here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kconvert.errors import CheckpointError, EngineError, KConvertError
from kconvert.family.manifest import ModelMap, bind, families
from kconvert.family.rope import RopeConfig, read_rope


class Reads(dict):
    """A config section that remembers the key read last (its whole path, nested sections included), so that a value
    the engine cannot read is named by its key path (bind's bounds refuse such values first: this is the engine's own
    line if one is ever missed)."""

    def __init__(self, section: dict, prefix: str = "", file: str = "config.json", _root: "Reads | None" = None):
        super().__init__(section)
        self.prefix, self.file = prefix, file
        self._root = self if _root is None else _root
        self.last, self.last_value = None, None

    def _seen(self, key, value):
        root = self._root
        root.last, root.last_value = f"{self.prefix}{key}", value
        if isinstance(value, dict) and not isinstance(value, Reads):
            return Reads(value, f"{self.prefix}{key}.", self.file, root)
        return value

    def __getitem__(self, key):
        self._root.last, self._root.last_value = f"{self.prefix}{key}", None  # named if absent (KeyError)
        return self._seen(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self._seen(key, super().get(key, default))

    def error(self, e: Exception) -> KConvertError:
        """The one line for an exception raised while reading this section (KeyError: a key it lacks)."""
        if isinstance(e, KConvertError):
            return e
        root = self._root
        if isinstance(e, KeyError):
            return CheckpointError(f"{root.last or e.args[0]} is absent and needed by the engine", file=self.file)
        shown = repr(root.last_value) if len(repr(root.last_value)) <= 40 else repr(root.last_value)[:37] + "..."
        return CheckpointError(f"{root.last} = {shown}: not a value the engine can read (docs/LIMITS.md)", file=self.file)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    experts_per_token: int
    n_group: int
    topk_group: int
    first_k_dense: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    index_topk: int | None  # None: no DSA indexer (deepseek_v3)
    index_n_heads: int
    index_head_dim: int
    hidden_act: str
    # layer kinds (engine/models/registry.py tables), named by the manifest's [family.engine]; defaults: DeepSeek V3/V3.2
    block_kind: str = "pre_norm"
    attention_kind: str = "mla"
    dense_mlp_kind: str = "swiglu"
    moe_kind: str = "deepseek_moe"
    draft_kind: str | None = None  # engine/draft kind of the layers past num_layers (MTP); None: the family has none
    section: dict = field(default_factory=dict, compare=False, repr=False)  # the config.json text section as is
    # per-layer kinds the family manifest schedules (name -> kind per layer: Kimi Linear's kda / mla ...)
    schedules: dict = field(default_factory=dict, compare=False, repr=False)
    image_token_id: int | None = None  # the image placeholder, for layers that treat image tokens apart (V4.1)
    config_file: str = "config.json"  # where the config was read, and the section's key prefix: named by errors
    key_prefix: str = ""

    def reads(self) -> Reads:
        """The config section, each key read remembered (Reads: errors name the key path)."""
        return Reads(self.section, self.key_prefix, self.config_file)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel: tuple[int, int]
    hidden_act: str
    rope_theta: float
    projector_eps: float
    text_hidden: int
    image_token_id: int
    kind: str = "moonvit"  # engine/models/registry.py VISION: moonvit (Kimi-K2.5), moonvit_v2 (Kimi K3), deepseek_vit
    qkv_hidden_size: int = 0  # attention width where it is not the tower's (MoonViT-V2)
    processor: str = "kimi"  # engine/inputs/image.py PROCESSORS: the family's [family.engine] image_processor
    # DeepSeek-V4.1's resize rules (deepseek_vit; merge_kernel is its r x r aligner window): an image smaller than
    # min_pixels is enlarged, one costing more than max_image_tokens text positions shrunk, wide ones clamped
    min_pixels: int = 0
    max_image_tokens: int = 0
    max_wh_ratio: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    family: str
    text: TextConfig
    vision: VisionConfig | None
    raw: dict


def _rope(c: dict, prefix: str = "", file: str = "config.json") -> RopeConfig:
    """The text model's rotary setting (kconvert/family/rope.py: the one reader, which bind checks with too)."""
    return read_rope(c, prefix=prefix, file=file)


def _text(c: dict) -> TextConfig:
    c = c if isinstance(c, Reads) else Reads(c)
    try:
        g = c.get
        n_routed = int(g("n_routed_experts") or 0)
        return TextConfig(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]), num_layers=int(c["num_hidden_layers"]),
            num_heads=int(c["num_attention_heads"]), q_lora_rank=int(g("q_lora_rank") or 0),
            # MLA's own keys may be absent (DeepSeek-V4 has none); engine/attention.MLA requires them
            kv_lora_rank=int(g("kv_lora_rank") or 0), qk_nope_head_dim=int(g("qk_nope_head_dim") or 0),
            qk_rope_head_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(g("v_head_dim") or 0),
            intermediate_size=int(g("intermediate_size") or 0), moe_intermediate_size=int(g("moe_intermediate_size") or 0),
            n_routed_experts=n_routed, n_shared_experts=int(g("n_shared_experts") or 0),
            experts_per_token=int(g("num_experts_per_tok") or 0), n_group=int(g("n_group") or 1),
            topk_group=int(g("topk_group") or 1), first_k_dense=int(g("first_k_dense_replace") or 0),
            routed_scaling_factor=float(g("routed_scaling_factor") or 1.0), norm_topk_prob=bool(g("norm_topk_prob", True)),
            rms_norm_eps=float(g("rms_norm_eps") or 1e-6), max_position_embeddings=int(g("max_position_embeddings") or 4096),
            rope=_rope(c, c.prefix, c.file), index_topk=int(c["index_topk"]) if g("index_topk") else None,
            index_n_heads=int(g("index_n_heads") or 0), index_head_dim=int(g("index_head_dim") or 0),
            hidden_act=g("hidden_act") or "silu",
        )
    except (KConvertError, KeyError, TypeError, ValueError) as e:
        raise c.error(e) from None


LAYER_KINDS = ("block", "attention", "dense_mlp", "moe", "draft")  # [family.engine] keys naming registry kinds
# (engine/models/registry.py; `draft`: engine/draft/registry.py)


def engine_families() -> dict[str, dict]:
    """name -> [family] table of every manifest with an `[family.engine]` table."""
    return {spec["family"]["name"]: spec["family"] for _, spec in families() if "engine" in spec["family"]}


def _section(config: dict, key: str, family: str, names: ModelMap | None = None, file: str = "config.json") -> dict:
    """Config section `key`, a null where its manifest parts give a default read as that default (bind accepted the
    null meaning just that: `q_lora_rank: null`, no q LoRA)."""
    sub = config if key == "." else config.get(key)
    if not isinstance(sub, dict):
        raise CheckpointError(f"config.json has no {key!r} section (family {family})", file=file)
    return names.with_defaults(sub, key) if names is not None else sub


def image_token_id(config: dict, engine: dict, file: str = "config.json") -> int:
    """The image placeholder's id: the first config key the family's [family.engine] names, else its default."""
    for key in engine.get("image_token_keys", ()):
        if config.get(key) is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{key} = {value!r:.40}: must be a token id (a non-negative integer)", file=file)
            return value
    if "image_token_default" not in engine:
        raise CheckpointError(f"config.json names no image token ({', '.join(engine.get('image_token_keys', ()))})",
                            file=file)
    return int(engine["image_token_default"])


def _deepseek_vit(v: dict, text: TextConfig, image_token_id: int) -> VisionConfig:
    """DeepSeek-V4.1's vision_config; the optional keys default as mlx-vlm's deepseek_v41 does."""
    r = int(v["downsample_ratio"])
    ratio = v.get("max_wh_ratio")
    return VisionConfig(
        hidden_size=int(v["hidden_size"]), num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
        intermediate_size=int(v["intermediate_size"]), patch_size=int(v["patch_size"]), pos_emb_height=0,
        pos_emb_width=0, merge_kernel=(r, r), hidden_act="silu", rope_theta=float(v.get("rope_theta", 10000.0)),
        projector_eps=0.0, text_hidden=text.hidden_size, image_token_id=image_token_id, kind="deepseek_vit",
        min_pixels=int(v.get("min_pixels", 295936)), max_image_tokens=int(v.get("max_image_tokens", 1024)),
        max_wh_ratio=None if ratio is None else float(ratio))


def _vision(c: dict, v: dict, text: TextConfig, image_token_id: int, kind: str = "moonvit") -> VisionConfig:
    if kind == "deepseek_vit":
        return _deepseek_vit(v, text, image_token_id)
    if kind == "moonvit_v2":  # Kimi K3's vision_config spells the tower's keys `vt_*`
        return VisionConfig(
            hidden_size=int(v["vt_hidden_size"]), num_layers=int(v["vt_num_hidden_layers"]),
            num_heads=int(v["vt_num_attention_heads"]), intermediate_size=int(v["vt_intermediate_size"]),
            patch_size=int(v.get("patch_size", 14)), pos_emb_height=int(v.get("init_pos_emb_height", 64)),
            pos_emb_width=int(v.get("init_pos_emb_width", 64)), merge_kernel=tuple(v.get("merge_kernel_size", (2, 2))),
            hidden_act="gelu_pytorch_tanh", rope_theta=10000.0, projector_eps=float(v.get("projector_ln_eps", 1e-5)),
            text_hidden=text.hidden_size, image_token_id=image_token_id, kind=kind,
            qkv_hidden_size=int(v.get("qkv_hidden_size") or 0))
    rp = v.get("rope_parameters") or {}
    return VisionConfig(
        hidden_size=int(v["hidden_size"]), num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
        intermediate_size=int(v["intermediate_size"]), patch_size=int(v.get("patch_size", 14)),
        pos_emb_height=int(v.get("pos_emb_height", 64)), pos_emb_width=int(v.get("pos_emb_width", 64)),
        merge_kernel=tuple(v.get("merge_kernel_size", (2, 2))), hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(rp.get("rope_theta", 10000.0)), projector_eps=float(c.get("projection_layer_norm_eps", 1e-5)),
        text_hidden=text.hidden_size, image_token_id=image_token_id,
    )


def text_schedules(names) -> dict[str, list[str]]:
    """Each layer schedule's kind per layer, whichever text part reads it (DeepSeek-V4.1: its block part)."""
    return {k: v for p in names.parts if p.group == "text" for k, v in p.schedules.items()}


def model_config(config: dict, family: str, config_file: str = "config.json") -> ModelConfig:
    """The engine's reading of `config` (family `family`), bound to its manifest first: every bound, relation and rule
    of manifests/limits.toml is checked there (as inspect and shard check them), so what is read here is in range.
    `config_file`: where the config came from (a converted checkpoint's kconvert.json), named by every error."""
    known = engine_families()
    if family not in known:
        raise EngineError(f"the engine does not run family {family!r} (known: {', '.join(sorted(known))})",
                          file="kconvert.json")
    names = bind(config, config_file=config_file)
    fam = names.family  # with its text model's traits: Kimi over DeepSeek-V4 runs V4's layer kinds
    engine = fam["engine"]
    key = fam.get("text_config", ".")
    section = _section(config, key, family, names, config_file)
    prefix = "" if key == "." else f"{key}."
    text = replace(_text(Reads(section, prefix, config_file)), section=section, schedules=text_schedules(names),
                   config_file=config_file, key_prefix=prefix,
                   **{f"{k}_kind": engine[k] for k in LAYER_KINDS if k in engine})
    vision = None
    if engine.get("vision_config"):
        token = image_token_id(config, engine, config_file)
        text = replace(text, image_token_id=token)
        vkey = engine["vision_config"]
        v = Reads(_section(config, vkey, family, names, config_file), f"{vkey}.", config_file)
        try:
            vision = _vision(config, v, text, token, engine.get("vision", "moonvit"))
            vision = replace(vision, processor=engine.get("image_processor", "kimi"))
        except (KConvertError, KeyError, TypeError, ValueError) as e:
            raise v.error(e) from None
    return ModelConfig(family, text, vision, config)
