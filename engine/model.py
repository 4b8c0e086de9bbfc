"""The model assembled from a converted checkpoint's units as the loader streams them.

Nothing is allocated before its unit arrives: `Model(...)` holds only the config; `load()` builds each
decoder layer from its tensors (kept in stored form) and drops the loader's dict.

Pipeline stages (tp x pp, kconvert.distributed): a rank builds only its stage's layers, the embeddings
(and vision tower) on the first stage, the final norm and head on the last; `forward` receives the
previous stage's hidden states and sends its own to the next (engine/pipeline.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from engine import pipeline
from engine.attention import MLA
from engine.cache import KVCache, KVOptions
from engine.config import ModelConfig, model_config
from engine.linear import Weight, rms_norm
from engine.moe import MLP, MoE
from kconvert.distributed import Group
from engine.rope import Rotary
from kconvert.converted.units import GLOBALS, VISION, is_unit, unit_layer
from kconvert.errors import CheckpointError, EngineError, UsageError
from kconvert.load.loader import open_converted
from kconvert.family.manifest import bind


class Layer:
    def __init__(self, mc: ModelConfig, index: int, t: dict, p: str, par: Group):
        cfg = mc.text
        self.eps = cfg.rms_norm_eps
        self.in_norm = t.pop(f"{p}input_layernorm.weight")
        self.post_norm = t.pop(f"{p}post_attention_layernorm.weight")
        self.attn = MLA(cfg, t, f"{p}self_attn.", par.tp)
        self.mlp = MoE(cfg, t, f"{p}mlp.", par.tp_rank, par.tp) if cfg.is_moe(index) else MLP(t, f"{p}mlp.")

    def forward(self, x, start, cache, cos, sin, par: Group):
        x = x + par.all_reduce(self.attn.forward(rms_norm(x, self.in_norm, self.eps), start, cache, cos, sin))
        return x + par.all_reduce(self.mlp(rms_norm(x, self.post_norm, self.eps)))


class Model:
    def __init__(self, config: dict, family: str, par: Group | None = None, device="cpu",
                 dtype: torch.dtype = torch.bfloat16, stages: list[list[int]] | None = None):
        """`stages`: the decoder layers of every pipeline stage (default: all layers, one stage); `par` must be
        laid out as (tp, len(stages)). MTP layers (index >= num_layers) are dropped from them."""
        self.mc = model_config(config, family)
        self.cfg = self.mc.text
        self.par = par or Group()
        self.device, self.dtype = torch.device(device), dtype
        self.names = bind(config)
        self.prefix = self.names.text.prefix
        self.stages = [[L for L in s if L < self.cfg.num_layers] for s in (stages or [range(self.cfg.num_layers)])]
        if len(self.stages) != self.par.pp:
            raise EngineError(f"{len(self.stages)} stage(s) of layers for a run of pp {self.par.pp}")
        self.stage_layers = self.stages[self.par.stage]  # the layers this rank runs
        self.slot = {L: i for i, L in enumerate(self.stage_layers)}  # layer -> its place in this rank's cache
        self.layers: list[Layer | None] = [None] * self.cfg.num_layers
        self.embed = self.norm = self.head = None
        self.vision = None
        self.has_vision = self.mc.vision is not None  # on every stage; the tower itself lives on the first
        self.rotary = Rotary(self.cfg.rope, self.cfg.qk_rope_head_dim, self.device)
        self.kv = KVOptions()  # the KV format/budgets every new cache takes (chat/verify/load set them)
        self.prefill_chunk = pipeline.PREFILL_CHUNK  # tokens per prefill micro-batch when pp > 1 (0: no split)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_converted(cls, path, device="cpu", dtype=torch.bfloat16, par: Group | None = None,
                       stages: list[list[int]] | None = None) -> "Model":
        """This rank's share of a converted checkpoint: its stage's layers, its tp slice. `stages` runs a
        pp = 1 conversion as len(stages) pipeline stages (every stage reads its tp rank's files and keeps
        its own layers: for tests and benchmarks)."""
        model, conv = cls.empty(path, par or Group.from_env(device), device, dtype, stages)
        for unit, tensors in conv.stream(device=device):
            model.take_unit(unit, tensors)
        model.check_complete()
        return model

    @classmethod
    def empty(cls, path, par: Group, device="cpu", dtype=torch.bfloat16, stages=None):
        """(model holding no weights yet, this rank's loader): checks the launched world against the layout."""
        probe = open_converted(path)
        cat = probe.catalog
        where = str(probe.root / "kconvert.json")
        if stages is None:
            par = par.layout(cat.tp, cat.pp, where)
            stages, rank = [cat.stage_layers(s) for s in range(cat.pp)], par.rank
        else:
            if cat.pp != 1:
                raise UsageError(f"explicit stages need a pp = 1 conversion; this one has pp {cat.pp}", file=str(path))
            par = par.layout(cat.tp, len(stages), where)
            rank = par.tp_rank
        conv = probe if rank == 0 else open_converted(path, rank=rank)
        return cls(conv.config, conv.family, par, device, dtype, stages), conv

    def stage_of_layer(self, L: int) -> int:
        return next(s for s, layers in enumerate(self.stages) if L in layers)

    def take_unit(self, unit: str, t: dict) -> None:
        t = dict(t)
        par = self.par
        if unit == GLOBALS:  # with pp > 1: embeddings on the first stage, norm + head on the last
            p = self.prefix
            embed = t.pop(f"{p}model.embed_tokens.weight", None)
            norm = t.pop(f"{p}model.norm.weight", None)
            head = t.pop(f"{p}lm_head.weight", None)
            if par.first:
                self.embed = embed
            if par.last:
                self.norm = norm
                head = head if head is not None else embed  # tied to the embeddings
                self.head = Weight(head) if head is not None else None
        elif unit == VISION:
            if par.first:
                from engine.vision import VisionTower

                self.vision = VisionTower(self.mc.vision, t)
            else:
                t = {}
        elif is_unit(unit):
            L = unit_layer(unit)
            if L not in self.slot:
                return  # MTP layers kept by --keep-mtp (not used for decoding), or another stage's layer
            self.layers[L] = Layer(self.mc, L, t, f"{self.prefix}model.layers.{L}.", par)
        else:
            raise CheckpointError(f"unknown unit {unit!r} in the converted checkpoint")
        left = [n for n in t if self.names.classify(n) is None or self.names.classify(n).component != "mtp"]
        if left:
            raise CheckpointError(f"unit {unit}: {len(left)} tensor(s) the engine does not use", tensor=left[0])

    def check_complete(self) -> None:
        missing = [L for L in self.stage_layers if self.layers[L] is None]
        lacks = [what for what, need, got in (("embeddings", self.par.first, self.embed),
                                              ("final norm", self.par.last, self.norm),
                                              ("lm_head", self.par.last, self.head)) if need and got is None]
        if lacks or missing:
            raise CheckpointError(f"converted checkpoint is incomplete for stage {self.par.stage} (missing: "
                                  f"{', '.join(lacks + [f'layers {missing[:5]}'] * bool(missing))})")
        if self.par.pp > 1:  # the first stage holds the tower: every stage must agree on images
            self.has_vision = self.par.broadcast_object(self.vision is not None, src=0)
        else:
            self.has_vision = self.vision is not None

    def materialize(self, dtype: torch.dtype | None = None) -> None:
        """Dequantize every weight once (speed over memory, e.g. on CPU)."""
        dtype = dtype or self.dtype
        for layer in (self.layers[L] for L in self.stage_layers):
            for obj in (layer.attn, layer.attn.indexer, layer.mlp, getattr(layer.mlp, "shared", None),
                        *getattr(layer.mlp, "experts", {}).values()):
                for v in vars(obj).values() if obj is not None and hasattr(obj, "__dict__") else ():
                    if isinstance(v, Weight):
                        v.materialize(dtype)
        if self.head is not None:
            self.head.materialize(dtype)

    # ---- compute -------------------------------------------------------------------------------
    def new_cache(self, batch: int = 1, max_len: int | None = None, reserve: int | None = None,
                  kv: KVOptions | None = None) -> KVCache:
        """A paged cache of this stage's layers for `batch` sequences of up to max_len tokens each (default:
        the model's maximum); pages are taken as tokens arrive, bounded by the KV budget (`kv`, default self.kv).
        cache.layers[model.slot[L]] is layer L's."""
        if max_len is None:
            max_len = self.cfg.max_position_embeddings
        cfg = replace(self.cfg, num_layers=len(self.stage_layers))  # a stage holds only its layers' KV
        return KVCache(cfg, batch, max_len, self.dtype, self.device, reserve, kv or self.kv)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        n = self.embed.shape[0]
        lo = self.par.tp_rank * n
        local = ids - lo
        inside = (local >= 0) & (local < n)
        x = self.embed[local.clamp(0, n - 1)].to(self.dtype) * inside[..., None].to(self.dtype)
        return self.par.all_reduce(x)

    def stage_input(self, ids: torch.Tensor, image_embeds: torch.Tensor | None) -> torch.Tensor:
        """First stage: the embeddings of ids [B,S], image features scattered in."""
        x = self.embed_tokens(ids)
        return self.scatter_images(ids, x, image_embeds) if image_embeds is not None else x

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """This stage's layers over x [B,S,H] at `positions` [B,S] (cache.begin opened the step)."""
        cos, sin = self.rotary(positions, self.dtype)  # [B,S,rope/2]: each sequence at its own position
        start = int(positions[0, 0])
        for L in self.stage_layers:
            x = self.layers[L].forward(x, start, cache.layers[self.slot[L]], cos, sin, self.par)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: the final norm and the (vocab-parallel) head."""
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        return self.par.all_gather_last(self.head(x)).float()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, image_embeds: torch.Tensor | None = None,
                last_only: bool = False, seqs: list[int] | None = None, everywhere: bool = True):
        """Logits [B,S,V] (or [B,1,V]) for ids [B,S] appended after each sequence's cached tokens; advances
        the cache. `seqs` names the cache's sequences the rows belong to (default: all, in order); their
        lengths may differ (a ragged batch). Every rank passes the same ids. With pp > 1 the logits come
        from the last stage: to every rank, or with everywhere=False to the last stage only (None elsewhere)."""
        ids = ids.to(self.device)
        if cache is None:
            cache = self.new_cache(ids.shape[0], ids.shape[1])
        return pipeline.forward(self, ids, cache, image_embeds, last_only, seqs, everywhere)

    def tokens_per_image(self, grid_hw: tuple[int, int]) -> int:
        kh, kw = self.mc.vision.merge_kernel
        return (grid_hw[0] // kh) * (grid_hw[1] // kw)

    def scatter_images(self, ids, x, image_embeds):
        mask = ids == self.mc.vision.image_token_id
        if int(mask.sum()) != image_embeds.shape[0]:
            raise EngineError(f"{int(mask.sum())} image placeholder tokens but {image_embeds.shape[0]} image features")
        x = x.clone()
        x[mask] = image_embeds.to(x.dtype)
        return x
