"""The model assembled from a converted checkpoint's units as the loader streams them.

Nothing is allocated before its unit arrives: `Model(...)` holds only the config; `load()` builds each
decoder layer from its tensors (kept in stored form) and drops the loader's dict."""

from __future__ import annotations

import torch

from engine.attention import MLA
from engine.cache import KVCache, KVOptions
from engine.config import ModelConfig, model_config
from engine.linear import Weight, rms_norm
from engine.moe import MLP, MoE
from kconvert.distributed import Group
from engine.rope import Rotary
from kconvert.converted.units import GLOBALS, VISION, is_unit, unit_layer
from kconvert.errors import CheckpointError, EngineError
from kconvert.load.loader import open_converted
from kconvert.family.manifest import bind


class Layer:
    def __init__(self, mc: ModelConfig, index: int, t: dict, p: str, par: Group):
        cfg = mc.text
        self.eps = cfg.rms_norm_eps
        self.in_norm = t.pop(f"{p}input_layernorm.weight")
        self.post_norm = t.pop(f"{p}post_attention_layernorm.weight")
        self.attn = MLA(cfg, t, f"{p}self_attn.", par.world)
        self.mlp = MoE(cfg, t, f"{p}mlp.", par.rank, par.world) if cfg.is_moe(index) else MLP(t, f"{p}mlp.")

    def forward(self, x, start, cache, cos, sin, par: Group):
        x = x + par.all_reduce(self.attn.forward(rms_norm(x, self.in_norm, self.eps), start, cache, cos, sin))
        return x + par.all_reduce(self.mlp(rms_norm(x, self.post_norm, self.eps)))


class Model:
    def __init__(self, config: dict, family: str, par: Group | None = None, device="cpu",
                 dtype: torch.dtype = torch.bfloat16):
        self.mc = model_config(config, family)
        self.cfg = self.mc.text
        self.par = par or Group()
        self.device, self.dtype = torch.device(device), dtype
        self.names = bind(config)
        self.prefix = self.names.text.prefix
        self.layers: list[Layer | None] = [None] * self.cfg.num_layers
        self.embed = self.norm = self.head = None
        self.vision = None
        self.rotary = Rotary(self.cfg.rope, self.cfg.qk_rope_head_dim, self.device)
        self.kv = KVOptions()  # the KV format/budgets every new cache takes (chat/verify/load set them)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_converted(cls, path, device="cpu", dtype=torch.bfloat16, par: Group | None = None) -> "Model":
        par = par or Group.from_env(device)
        conv = open_converted(path, rank=par.rank, world_size=par.world)
        par.check_tp(conv.tp)
        model = cls(conv.config, conv.family, par, device, dtype)
        for unit, tensors in conv.stream(device=device):
            model.take_unit(unit, tensors)
        model.check_complete()
        return model

    def take_unit(self, unit: str, t: dict) -> None:
        t = dict(t)
        if unit == GLOBALS:
            p = self.prefix
            self.embed = t.pop(f"{p}model.embed_tokens.weight")
            self.norm = t.pop(f"{p}model.norm.weight")
            head = t.pop(f"{p}lm_head.weight", None)
            self.head = Weight(head if head is not None else self.embed)
        elif unit == VISION:
            from engine.vision import VisionTower

            self.vision = VisionTower(self.mc.vision, t)
        elif is_unit(unit):
            L = unit_layer(unit)
            if L >= self.cfg.num_layers:
                return  # MTP layers kept by --keep-mtp: not used for decoding
            self.layers[L] = Layer(self.mc, L, t, f"{self.prefix}model.layers.{L}.", self.par)
        else:
            raise CheckpointError(f"unknown unit {unit!r} in the converted checkpoint")
        left = [n for n in t if self.names.classify(n) is None or self.names.classify(n).component != "mtp"]
        if left:
            raise CheckpointError(f"unit {unit}: {len(left)} tensor(s) the engine does not use", tensor=left[0])

    def check_complete(self) -> None:
        missing = [i for i, l in enumerate(self.layers) if l is None]
        if self.embed is None or missing:
            raise CheckpointError(f"converted checkpoint is incomplete (globals: {self.embed is not None}, "
                                f"missing layers: {missing[:5]})")

    def materialize(self, dtype: torch.dtype | None = None) -> None:
        """Dequantize every weight once (speed over memory, e.g. on CPU)."""
        dtype = dtype or self.dtype
        for layer in self.layers:
            for obj in (layer.attn, layer.attn.indexer, layer.mlp, getattr(layer.mlp, "shared", None),
                        *getattr(layer.mlp, "experts", {}).values()):
                for v in vars(obj).values() if obj is not None and hasattr(obj, "__dict__") else ():
                    if isinstance(v, Weight):
                        v.materialize(dtype)
        self.head.materialize(dtype)

    # ---- compute -------------------------------------------------------------------------------
    def new_cache(self, batch: int = 1, max_len: int | None = None, reserve: int | None = None,
                  kv: KVOptions | None = None) -> KVCache:
        """A paged cache for `batch` sequences of up to max_len tokens each (default: the model's maximum);
        pages are taken as tokens arrive, bounded by the KV budget (`kv`, default self.kv)."""
        if max_len is None:
            max_len = self.cfg.max_position_embeddings
        return KVCache(self.cfg, batch, max_len, self.dtype, self.device, reserve, kv or self.kv)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.embed.shape[0]
        lo = self.par.rank * n
        local = ids - lo
        inside = (local >= 0) & (local < n)
        x = self.embed[local.clamp(0, n - 1)].to(self.dtype) * inside[..., None].to(self.dtype)
        return self.par.all_reduce(x)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, image_embeds: torch.Tensor | None = None,
                last_only: bool = False, seqs: list[int] | None = None) -> torch.Tensor:
        """Logits [B,S,V] (or [B,1,V]) for ids [B,S] appended after each sequence's cached tokens; advances
        the cache. `seqs` names the cache's sequences the rows belong to (default: all, in order); their
        lengths may differ (a ragged batch)."""
        ids = ids.to(self.device)
        B, S = ids.shape
        if cache is None:
            cache = self.new_cache(B, S)
        step = cache.begin(S, seqs)
        x = self.embed_tokens(ids)
        if image_embeds is not None:
            x = self.scatter_images(ids, x, image_embeds)
        cos, sin = self.rotary(step.positions, self.dtype)  # [B,S,rope/2]: each sequence at its own position
        start = int(step.positions[0, 0])
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, start, cache.layers[i], cos, sin, self.par)
        cache.commit(step)
        if last_only:
            x = x[:, -1:]
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        return self.par.all_gather_last(self.head(x)).float()

    def scatter_images(self, ids, x, image_embeds):
        mask = ids == self.mc.vision.image_token_id
        if int(mask.sum()) != image_embeds.shape[0]:
            raise EngineError(f"{int(mask.sum())} image placeholder tokens but {image_embeds.shape[0]} image features")
        x = x.clone()
        x[mask] = image_embeds.to(x.dtype)
        return x
