"""The model assembled from a converted checkpoint's units as the loader streams them: an nn.Module tree
whose attribute paths are the stored tensor names under the family's prefix (`language_model.model.layers.3.
self_attn.q_b_proj.weight_scale_inv`), so its state_dict keys are the checkpoint's.

Nothing is allocated before its unit arrives: each unit builds its modules with empty slots (engine/layers/slots.py),
picks every linear's class from the catalog's record of its stored format (engine/layers/linear.py) and assigns the
loader's tensors without a copy. Layer modules come from engine/models/registry.py, by the kinds the manifest names.

Pipeline stages (tp x pp, kconvert.distributed): a rank builds only its stage's layers, the embeddings
(and vision tower) on the first stage, the final norm and head on the last; `forward` receives the
previous stage's hidden states and sends its own to the next (engine/pipeline.py). Draft heads (MTP layers
past the decoder layers: engine/draft/) are built on the last stage, beside the embeddings and head they share.
(Over 300 lines: the one module tree every family runs, its unit-by-unit loading and its forward, kept together
so that no family is named here; what a kind adds lives in its own package.)"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine import pipeline
from engine.cache.latent import KVCache, KVOptions
from engine.config import model_config
from engine.draft.registry import build_draft_head, check_draft_shares
from engine.models.registry import block_stack, decoder_layer, image_tokens, vision_modules
from engine.layers.linear import LinearSlot, PlainLinear, RMSNorm, format_of, materialize, options_of, resolve_linears
from engine.layers.rope import Rotary
from engine.layers.slots import Stored, holds_all, load_unit, slot
from engine.models.kimi_k25.vision import ImageEncoder
from kconvert.disk_format.units import GLOBALS, VISION, is_unit, layer_unit, unit_layer
from kconvert.distributed import Group
from kconvert.errors import CheckpointError, EngineError, UsageError
from kconvert.family.engine_names import engine_keys
from kconvert.family.manifest import bind
from kconvert.load.loader import ConvertedCheckpoint, open_converted
from kconvert.quant.scheme import Options


def stored_formats(conv: ConvertedCheckpoint) -> dict[str, str]:
    """{stored tensor name: its kconvert.json `transform`} of this rank (what each linear is stored as)."""
    return {t["name"]: t["transform"] for t in conv.catalog.rank_tensors(conv.rank) if "transform" in t}


class Model(nn.Module):
    def __init__(self, config: dict, family: str, par: Group | None = None, device="cpu",
                 dtype: torch.dtype = torch.bfloat16, stages: list[list[int]] | None = None,
                 formats: dict[str, str] | None = None, quant_options: Options | None = None,
                 config_file: str = "config.json"):
        """`stages`: the decoder layers of every pipeline stage (default: all layers, one stage); `par` must be
        laid out as (tp, len(stages)). MTP layers (index >= num_layers) in them are the draft heads. `formats`:
        stored_formats() of this rank's catalog (without it, each linear's format is read off its tensors);
        `quant_options`: the scheme options the conversion recorded (int4's group size ...); `config_file`: where
        `config` was read (a conversion's kconvert.json), named by errors."""
        super().__init__()
        self.mc = model_config(config, family, config_file)
        self.cfg = self.mc.text
        self.par = par or Group()
        self.device, self.dtype = torch.device(device), dtype
        self.quant_options = quant_options or Options()
        stages = stages or [range(self.cfg.num_layers)]
        self.stages = [[L for L in s if L < self.cfg.num_layers] for s in stages]
        drafts = sorted({L for s in stages for L in s if L >= self.cfg.num_layers})
        self.names = bind(config, config_file=config_file, draft_stages=len(drafts))  # V4-0731 counts its DSpark stages from its names
        self.formats = engine_keys(self.names, formats or {})
        self.prefix = self.names.text.module_prefix
        self.draft_layers = drafts  # built: last stage
        self.draft_heads = nn.ModuleDict()  # str(L) -> engine/draft head
        self.tap_layers: list[int] = []  # target layers a drafter reads (DSpark's dspark_target_layer_ids)
        self.shared_embed: torch.Tensor | None = None  # the embeddings on the last stage, for the draft heads
        if len(self.stages) != self.par.pp:
            raise EngineError(f"{len(self.stages)} stage(s) of layers for a run of pp {self.par.pp}")
        self.stage_layers = self.stages[self.par.stage]  # the layers this rank runs
        self.slot = {L: i for i, L in enumerate(self.stage_layers)}  # layer -> its place in this rank's cache
        text = self
        for part in self.prefix.split(".")[:-1]:  # "language_model." -> self.language_model
            text.add_module(part, nn.Module())
            text = text.get_submodule(part)
        text.model = nn.Module()
        text.model.embed_tokens = text.model.norm = text.lm_head = None  # the globals unit fills them
        text.model.layers = nn.ModuleDict()  # str(L) -> layer L, for this stage's layers
        self.layers_prefix = self.prefix_of(text.model.layers)  # "language_model.model.layers."
        self.vision_tower = self.mm_projector = None  # the vision unit fills them (first stage)
        self.vision: ImageEncoder | None = None
        self.has_vision = self.mc.vision is not None  # on every stage; the tower itself lives on the first
        self.rotary = Rotary(self.cfg.rope, self.cfg.qk_rope_head_dim, self.device)
        self.stack = block_stack(self.cfg)  # how the residual enters / leaves the layers, their cache
        self.residual_head: nn.Module | None = None  # the stack's merge (globals unit, last stage), if any
        self.kv = KVOptions()  # the KV format/budgets every new cache takes (chat/verify/load set them)
        self.prefill_chunk = pipeline.PREFILL_CHUNK  # tokens per prefill micro-batch when pp > 1 (0: no split)

    @property
    def text(self) -> nn.Module:
        """The module under the family's text prefix (holds `model.*` and `lm_head`)."""
        return self.get_submodule(self.prefix[:-1]) if self.prefix else self

    @property
    def layers(self) -> nn.ModuleDict:
        return self.text.model.layers

    def layer(self, L: int) -> nn.Module:
        return self.layers[str(L)]

    def prefix_of(self, module: nn.Module) -> str:
        """The checkpoint prefix of `module`'s tensors: its path in this tree (attribute names are the stored ones)."""
        return next(path for path, m in self.named_modules() if m is module) + "."

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_converted(cls, path, device="cpu", dtype=torch.bfloat16, par: Group | None = None,
                       stages: list[list[int]] | None = None) -> "Model":
        """This rank's share of a converted checkpoint: its stage's layers, its tp slice. `stages` runs a
        pp = 1 conversion as len(stages) pipeline stages (every stage reads its tp rank's files and keeps
        its own layers: for tests and benchmarks)."""
        model, conv = cls.empty(path, par or Group.from_env(device), device, dtype, stages)
        for unit, tensors in conv.stream(device=device, verify="first"):  # CRCs on a first load
            model.take_unit(unit, tensors)
        model.check_complete()
        return model

    @classmethod
    def empty(cls, path, par: Group, device="cpu", dtype=torch.bfloat16, stages=None):
        """(model holding no weights yet, this rank's loader): checks the launched world against the layout."""
        probe = open_converted(path)
        cat = probe.catalog
        if stages is None:
            rank = par.layout(cat.tp, cat.pp, str(probe.root / "kconvert.json")).rank
        else:
            if cat.pp != 1:
                raise UsageError(f"explicit stages need a pp = 1 conversion; this one has pp {cat.pp}", file=str(path))
            rank = par.layout(cat.tp, len(stages), str(probe.root / "kconvert.json")).tp_rank
        conv = probe if rank == 0 else open_converted(path, rank=rank)
        return cls.for_rank(conv, par, device, dtype, stages), conv

    @classmethod
    def for_rank(cls, conv: ConvertedCheckpoint, par: Group, device="cpu", dtype=torch.bfloat16,
                 stages: list[list[int]] | None = None) -> "Model":
        """The empty model of the rank `conv` reads, `par` laid out as its conversion (or as `stages`)."""
        cat = conv.catalog
        where = str(conv.root / "kconvert.json")
        if stages is None:
            stages = [cat.stage_layers(s) for s in range(cat.pp)]
        else:  # the conversion's draft layers (past every named layer) go to the last stage, as shard places them
            named = {L for s in stages for L in s}
            extra = [L for L in cat.stage_layers(cat.pp - 1) if L not in named and L > max(named, default=-1)]
            stages = [list(s) for s in stages[:-1]] + [list(stages[-1]) + extra]
        par = par.layout(cat.tp, len(stages), where)
        model = cls(conv.config, conv.family, par, device, dtype, stages, stored_formats(conv),
                    options_of(cat.doc.get("quantization")), config_file=where)
        if hasattr(model.stack, "attach"):  # a stack that reads side files of the checkpoint (V4.1's Engram token map)
            model.stack.attach(conv.root)
        return model

    def stage_of_layer(self, L: int) -> int:
        """The stage running decoder layer L; MTP layers (L >= num_layers) belong to the last stage, as in
        kconvert.convert.stages."""
        return next((s for s, layers in enumerate(self.stages) if L in layers), len(self.stages) - 1)

    def _is_mtp(self, name: str) -> bool:
        info = self.names.classify(name)
        return info is not None and info.component == "mtp"

    def _linear_format(self, tensors: dict, use_catalog: bool = True):
        formats = self.formats if use_catalog else {}
        return lambda name: format_of(name, formats, tensors, self.quant_options)

    def build_layer(self, L: int, tensors: dict, use_catalog: bool = True) -> nn.Module:
        """Decoder layer L filled from its unit's tensors (not attached to the model). use_catalog=False
        reads every linear's format off the tensors given (e.g. with some replaced by dense ones)."""
        layer = decoder_layer(self.cfg, L, self.par)
        prefix = f"{self.layers_prefix}{L}."
        resolve_linears(layer, prefix, self._linear_format(tensors, use_catalog))
        load_unit(layer_unit(L), {prefix: layer}, tensors, ignore=self._is_mtp)
        return layer

    def take_unit(self, unit: str, t: dict) -> None:
        t = engine_keys(self.names, t)  # released names onto the module tree's where they differ (DeepSeek-V4)
        if unit == GLOBALS:
            self._take_globals(t)
        elif unit == VISION:
            if self.par.first:  # the tower lives on the first stage
                vc = self.mc.vision
                self.vision_tower, self.mm_projector = vision_modules(vc)
                parts = {self.prefix_of(m): m for m in (self.vision_tower, self.mm_projector)}
                load_unit(unit, parts, t, ignore=self._is_mtp)
                self.vision = ImageEncoder(self.vision_tower, self.mm_projector)
        elif is_unit(unit):
            L = unit_layer(unit)
            if L in self.slot:  # not another stage's layer
                self.layers[str(L)] = self.build_layer(L, t)
            elif L in self.draft_layers and self.par.last:
                self.draft_heads[str(L)] = build_draft_head(self, L, t, self._linear_format(t))
        else:
            raise CheckpointError(f"unknown unit {unit!r} in the converted checkpoint")

    def _take_globals(self, t: dict) -> None:
        """With pp > 1 a stage's globals hold what it uses: the embeddings on the first stage, the final norm
        and head on the last (the embeddings there too for a head tied to them); every slot is optional."""
        text, par = self.text, self.par
        text.model.embed_tokens, text.model.norm = Stored(optional=True), RMSNorm(self.cfg.rms_norm_eps)  # a stage may not hold them
        slot(text.model.norm, "weight", optional=True)
        merge = self.stack.make_head()  # the stack's merge before the norm (optional slots), or None
        if merge is not None:
            setattr(text.model, self.stack.head_name, merge)
        text.lm_head = LinearSlot()
        head = self.prefix_of(text.lm_head)
        if any(n.startswith(head) for n in t):
            resolve_linears(text, self.prefix, self._linear_format(t))
        else:
            text.lm_head = None  # tied to the embeddings
        parts = {self.prefix_of(m): m for m in (text.model.embed_tokens, text.model.norm, text.lm_head, merge) if m is not None}
        load_unit(GLOBALS, parts, t, ignore=self._is_mtp)
        if merge is not None:  # kept where it is used (the last stage), and only whole
            self.residual_head = merge if par.last and holds_all(merge) else None
            setattr(text.model, self.stack.head_name, self.residual_head)
        embed, norm = text.model.embed_tokens.weight, text.model.norm.weight
        self.shared_embed = embed if par.last else None  # the draft heads' (draft_shares), where they have none
        if text.lm_head is None and embed is not None:
            text.lm_head = PlainLinear.holding(embed)
        if not par.first or embed is None:
            text.model.embed_tokens = None
        if not par.last or norm is None:
            text.model.norm = None
        if not par.last:
            text.lm_head = None

    def check_complete(self) -> None:
        stack = self.text.model
        missing = [L for L in self.stage_layers if str(L) not in self.layers]
        last, head = self.par.last, self.stack.head_name
        parts = (("embeddings", self.par.first, stack.embed_tokens), ("final norm", last, stack.norm),
                 ("lm_head", last, self.text.lm_head), (f"model.{head}", last and head, self.residual_head))
        lacks = [what for what, need, got in parts if need and got is None]
        if self.par.last:
            missing += [L for L in self.draft_layers if str(L) not in self.draft_heads]
        if lacks or missing:
            raise CheckpointError(f"converted checkpoint is incomplete for stage {self.par.stage} (missing: "
                                  f"{', '.join(lacks + [f'layers {missing[:5]}'] * bool(missing))})")
        check_draft_shares(self)
        has = self.vision is not None  # the first stage holds the tower: with pp > 1 every stage must agree on images
        self.has_vision = self.par.broadcast_object(has, src=0) if self.par.pp > 1 else has

    def materialize(self, dtype: torch.dtype | None = None) -> None:
        """Dequantize every linear once (speed over memory, e.g. on CPU)."""
        materialize(self, dtype or self.dtype)

    # ---- compute -------------------------------------------------------------------------------
    def new_cache(self, batch: int = 1, max_len: int | None = None, reserve: int | None = None,
                  kv: KVOptions | None = None) -> KVCache:
        """A paged cache of this stage's layers for `batch` sequences of up to max_len tokens each (default:
        the model's maximum); pages are taken as tokens arrive, bounded by the KV budget (`kv`, default self.kv).
        cache.layers[model.slot[L]] is layer L's."""
        if max_len is None:
            max_len = self.cfg.max_position_embeddings
        cfg = replace(self.cfg, num_layers=len(self.stage_layers))  # a stage holds only its layers' KV
        return self.stack.new_cache(cfg, batch, max_len, self.dtype, self.device, reserve, kv or self.kv,
                                    layers=self.stage_layers)

    def embed_tokens(self, ids: torch.Tensor, embed: torch.Tensor | None = None) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows of `embed` (the model's), the rest summed in from the others."""
        embed = self.text.model.embed_tokens.weight if embed is None else embed
        n = embed.shape[0]
        lo = self.par.tp_rank * n
        local = ids - lo
        inside = (local >= 0) & (local < n)
        x = embed[local.clamp(0, n - 1)].to(self.dtype) * inside[..., None].to(self.dtype)
        return self.par.all_reduce(x)

    def stage_input(self, ids: torch.Tensor, image_embeds: torch.Tensor | None) -> torch.Tensor:
        """First stage: the embeddings of ids [B,S], image features scattered in, entered into the residual."""
        x = self.embed_tokens(ids)
        return self.stack.enter(self.scatter_images(ids, x, image_embeds) if image_embeds is not None else x)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, ids=None,
                   taps: dict | None = None) -> torch.Tensor:
        """This stage's layers over the residual x at `positions` [B,S] (opened by cache.begin); ids: their tokens.
        `taps`: filled with the residual after each layer of `tap_layers` (its streams averaged), for a drafter."""
        cos, sin = self.rotary(positions, self.dtype)  # [B,S,rope/2]: each sequence at its own position
        start = int(positions[0, 0])
        for L in self.stage_layers:
            x = self.layer(L).forward(x, start, cache.layers[self.slot[L]], cos, sin, self.par, ids=ids)
            if taps is not None and L in self.tap_layers:
                r = self.stack.reported(x) if hasattr(self.stack, "reported") else x
                taps[L] = r.mean(2) if r.dim() == 4 else r
        return x

    def taps_before(self, B: int, S: int) -> dict:
        """The drafter's taps of the layers before this stage's (sent by the previous stage, in layer order), for a
        forward of S positions: what this stage adds its own to and passes on."""
        first = self.stage_layers[0] if self.stage_layers else self.cfg.num_layers
        earlier = sorted(L for L in self.tap_layers if L < first)
        if not earlier or self.par.first:
            return {}
        got = self.par.recv_prev((B, S, len(earlier), self.cfg.hidden_size), self.dtype, self.device)
        return dict(zip(earlier, got.unbind(2)))

    def draft_input(self, x: torch.Tensor, taps: dict | None) -> torch.Tensor:
        """What the drafter reads of a forward's positions (last stage): the taps, concatenated in tap_layers'
        order, or the residual itself."""
        return torch.cat([taps[L] for L in self.tap_layers], -1) if self.tap_layers else x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The residual leaves the layers (the stack's head, if any), then the final norm."""
        return self.text.model.norm(self.stack.leave(self.residual_head, x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocab slice of the head's output (last stage)."""
        return self.text.lm_head(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: the final norm and the (vocab-parallel) head."""
        return self.par.all_gather_last(self.head(self.final_norm(x))).float()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, image_embeds: torch.Tensor | None = None,
                last_only: bool = False, seqs: list[int] | None = None, everywhere: bool = True,
                hidden: list | None = None):
        """Logits [B,S,V] (or [B,1,V]) for ids [B,S] appended after each sequence's cached tokens; advances
        the cache. `seqs` names the cache's sequences the rows belong to (default: all, in order); their
        lengths may differ (a ragged batch). Every rank passes the same ids. With pp > 1 the logits come
        from the last stage: to every rank, or with everywhere=False to the last stage only (None elsewhere).
        `hidden`: a list the last stage appends its residual (before the final norm) to, for the draft heads."""
        ids = ids.to(self.device)
        if cache is None:
            cache = self.new_cache(ids.shape[0], ids.shape[1])
        return pipeline.forward(self, ids, cache, image_embeds, last_only, seqs, everywhere, hidden)

    def tokens_per_image(self, grid_hw: tuple[int, int]) -> int:
        """Known on every stage (the tower itself lives on the first); the vision kind's count (DeepSeek-V4.1: the
        whole image span, its start, row breaks and end included: image_embeds hold a row for each)."""
        return image_tokens(self.mc.vision, grid_hw)

    def scatter_images(self, ids, x, image_embeds):
        mask = ids == self.mc.vision.image_token_id
        if int(mask.sum()) != image_embeds.shape[0]:
            raise EngineError(f"{int(mask.sum())} image placeholder tokens but {image_embeds.shape[0]} image features")
        x = x.clone()
        x[mask] = image_embeds.to(x.dtype)
        return x
