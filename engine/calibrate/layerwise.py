"""Calibrated INT4 and NVFP4 (GPTQ) computed layer by layer through the engine, from the source checkpoint.

Only one decoder layer's weights (read from the source, float32) and the calibration activations entering
it (the residual as the block kind carries it: DeepSeek-V4's mHC streams whole) are in memory at a time. Per layer:
1. the layer runs unquantized on the activations; every calibrated linear other than the routed experts
   (shared experts, dense MLPs, attention where the policy quantizes them) sums its inputs' Hessian; the
   MoE's input is kept;
2. each calibrated weight gets GPTQ codes (kconvert/quant/gptq.py); each routed expert from the tokens the
   layer's own router sends it (engine/calibrate/routing.py: DeepSeek-V3/K2's or V4's, by score or hash): gate/up
   from those tokens, down from what the expert's forward makes of them with its quantized gate/up. An
   expert with fewer than MIN_EXPERT_TOKENS tokens (or a linear no token reached) rounds to nearest with
   the same static scales: GPTQ on a handful of tokens fits them, not the model. Counted per layer;
3. the layer runs again with its quantized weights: its output is the next layer's input (and its
   relative error against step 1's output is the layer's figure).

Which tensors: the conversion's policy (`calibrates(info, shape, source)`, `group_size`, `int4_scales`; int4: routed
experts by default; nvfp4: the weights it stores in NVFP4 itself and not by an exact cast (MXFP4 experts are copied
code for code: no rounding for GPTQ to improve), never the family's other roles (block FP8 attention)). NVFP4's
per-tensor weight_scale_2 is the uncalibrated path's: a fused w1 / w3 pair's shared one (convert/fused.py).

Resume: every layer's input is kept under OUT's journal as it is reached; the caller says which layers its journalled files hold (`done_before(L)`) and older inputs go. A re-run starts from the
latest kept input at or before the first layer left to do that passes its checks (engine/calibrate/resume.py:
a digest tied to the run and the layer, finite values) and recomputes from there (deterministic: the same
codes).

Memory (engine/calibrate/memory.py): the layer's float32 weights (each replaced by its dequantized copy once
quantized), the activations entering it, its unquantized output (for the layer's figure), the MoE's input
over every token while the experts are done, and one micro-batch's temporaries; the next layer's input
overwrites this one's in place. Under torchrun the experts split over processes (engine/calibrate/split.py).

Over 300 lines: one layer's calibration is one object's state (the activations entering the layer, the Hessians being
summed, the resume point, the split); its steps read and write that state in turn."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from engine.calibrate.memory import TokenRows, fixed_mmap_threshold, rel_error, small_prefill_blocks, trim
from engine.calibrate.resume import KeptInputs, binding_of
from engine.calibrate.routing import chosen_experts, down_input, expert_parts, keep_input, routed_moe
from engine.calibrate.split import Split
from engine.layers.linear import PlainLinear
from engine.model import Model
from kconvert.disk_format.units import layer_unit
from kconvert.convert.shard.plan import unit_of
from kconvert.distributed import Group
from kconvert.errors import CheckpointError
from kconvert.family.engine_names import engine_keys, engine_name
from kconvert.convert.fused import tensor_scales
from kconvert.quant.gptq import DAMP, Grid, Hessian
from kconvert.quant.policy import QuantPolicy
from kconvert.quant.registry import get_scheme
from kconvert.source.checkpoint import Checkpoint
from kconvert.source.stored_quant import source_quant

MIN_EXPERT_TOKENS = 16  # fewer routed tokens than this: round to nearest (reported)
MICRO_BATCH = 8  # calibration sequences per forward
THREADS = 1  # fixed: the same float reductions on every machine and run, so a resumed run recomputes the
# same codes (and no OpenMP threads spin-waiting on a shared CPU: measured 15x the CPU time with 2 threads)


class LayerCalibration:
    """`layer(L)` -> {source weight name: (codes, scale, *the grid's other parts)} for layer L's calibrated weights, in
    order (int4: int8 codes and group scales; nvfp4: uint8 codes, e4m3 block scales and weight_scale_2 [1])."""

    def __init__(self, ck: Checkpoint, windows: torch.Tensor, policy: QuantPolicy, grid: Grid, record: dict,
                 progress=None):
        self.ck, self.windows, self.policy, self.grid = ck, windows, policy, grid
        self.record = {**record, "method": "gptq", "grid": grid.name, "damp": DAMP, "act_order": "static",
                       "min_expert_tokens": MIN_EXPERT_TOKENS}
        self.scale_2: dict[str, float] = {}  # nvfp4: the layer's fused groups' shared weight_scale_2
        self.progress = progress
        self.model = Model(ck.config, ck.family, Group(), "cpu", torch.float32)  # any residual (mHC: [.., n, hidden])
        self.by_layer: dict[int, list[str]] = {}
        copied = calibrated = 0  # copied: weights of the scheme stored by an exact copy instead (nvfp4: MXFP4 experts)
        for name, t in ck.logical.items():
            info = ck.info(name)
            if info.layer is not None and unit_of(info) == layer_unit(info.layer) and info.component != "mtp":
                self.by_layer.setdefault(info.layer, []).append(name)
                if name.endswith(".weight") and len(t.shape) == 2:
                    source = source_quant(ck, t, info)
                    calibrated += policy.calibrates(info, tuple(t.shape), source)
                    copied += policy.copies_exactly(info, tuple(t.shape), source)
        if copied:  # (int4 copies none: its record as before)
            self.record.update(copied_exactly=copied, calibrated=calibrated)
        self.idle = not calibrated  # every weight copied exactly: no layer to run
        self.kept: KeptInputs | None = None  # the resume state, once attached
        self.x: torch.Tensor | None = None  # the input of layer self.at, [n, seq, *stack.residual_shape]
        self.at = 0
        self.last: tuple[int | None, dict] = (None, {})  # the last layer's result
        self.figures: list[dict] = []  # one per calibrated layer
        self.split = Split()  # one process

    def share(self, group: Group) -> None:
        """Calibrate together with the other processes of `group` (each computing its share of every layer)."""
        self.split = Split(group)

    # ---- resume state (engine/calibrate/resume.py: kept inputs trusted only when their digest checks) -------
    def attach(self, state_dir: Path, identity: dict | None = None) -> None:
        """Keep each layer's input in `state_dir` for a resume, tied to the source, this calibration's record and
        the run's `identity` (its options)."""
        self.kept = KeptInputs(state_dir, binding_of({"source": self.ck.fingerprint(), "calibration": self.record,
                                                      "run": identity}))

    def _keep(self) -> None:
        """Keep the input of layer self.at (atomically) for a resume."""
        if self.kept is None or not self.split.keeps:
            return
        self.kept.keep(self.at, self.x)

    def done_before(self, L: int) -> None:
        """Every layer before L is in journalled files: a resume starts at L at the earliest, so older inputs go.
        Under torchrun every process says so (each journals its own files) before process 0 deletes."""
        self.split.barrier()
        if self.kept is None or not self.split.keeps:
            return
        self.kept.drop_before(L)

    def _start(self, L: int) -> None:
        """Position the activations at the input of layer L (or earlier): a kept state that passes its checks
        (process 0 decides, the others follow), else the embeddings."""
        if self.x is not None and self.at <= L:
            return
        lead = tuple(self.windows.shape)
        best = None
        if self.kept is not None and self.split.keeps:
            for k in reversed([k for k in self.kept.layers() if k <= L]):
                x = self.kept.load(k, lead)
                if x is not None:
                    best = k
                    break
        best = self.split.agree(best)
        if best is not None:
            if not self.split.keeps:
                x = self.kept.load(best, lead) if self.kept is not None else None
                if x is None:
                    raise CheckpointError("process 0's kept calibration input is not readable here",
                                          file=str(self.kept.path(best) if self.kept else best))
            self.x, self.at = x, best
            return
        m = self.model
        want = m.prefix + "model.embed_tokens.weight"  # stored as the family names it (V4: `embed.weight`)
        embed = self.ck.read(next((n for n in self.ck.logical if engine_name(m.names, n) == want), want), dtype=torch.float32)
        self.x, self.at = m.stack.enter(embed[self.windows]), 0

    # ---- one layer ------------------------------------------------------------------------------
    def layer(self, L: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if L >= self.model.cfg.num_layers or self.idle:
            return {}  # MTP layers kept by --keep-mtp: not on the decoding path, rounded to nearest
        if self.last[0] == L:
            return self.last[1]  # asked once per tensor (export)
        before = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        fixed_mmap_threshold()
        try:
            with small_prefill_blocks():
                self._start(L)
                result = {}
                while self.at <= L:
                    result = self._calibrate(self.at)
                    self.at += 1
                    self._keep()
                    gc.collect()  # the layer's caches and modules (reference cycles)
                    trim()
        except BaseException:
            self.x = None  # possibly half overwritten by the next layer's input: re-read on the next call
            raise
        finally:
            torch.set_num_threads(before)
        self.last = (L, result)
        return result

    def _calibrate(self, L: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        if self.progress:
            self.progress("phase", name=f"calibrate layer {L + 1}/{self.model.cfg.num_layers}")
        m, ck, split = self.model, self.ck, self.split
        tensors = {n: ck.read(n, dtype=torch.float32) for n in self.by_layer.get(L, [])}
        layer = m.build_layer(L, engine_keys(m.names, tensors), use_catalog=False)
        prefix = f"{m.layers_prefix}{L}."  # module paths inside the layer are the engine's names after it
        stored = {engine_name(m.names, n).removesuffix(".weight")[len(prefix):]: n for n in tensors
                  if n.endswith(".weight") and self._calibrates(n, tuple(tensors[n].shape))}
        scheme = get_scheme(self.grid.scheme)  # nvfp4: a fused pair's weight_scale_2 from both, before either goes
        self.scale_2 = tensor_scales(((n, ck.info(n), scheme, None, False) for n in stored.values()), tensors.get)
        del tensors  # the layer holds the weights; each goes once its quantized copy replaces it
        moe = routed_moe(layer)  # engine/calibrate/routing.py: the MoE kinds whose routers it asks
        routed = {id(lin): int(e) for e, mlp in moe.experts.items() for lin in mlp.children()} if moe else {}
        expert_of = {p: routed.get(id(layer.get_submodule(p))) for p in stored}
        others = [p for p, e in expert_of.items() if e is None]
        slot = {p: k for k, p in enumerate(others)}  # the k-th other linear: process k % P computes it
        owner = {stored[p]: split.owner(slot[p] if e is None else e)
                 for p, e in expert_of.items()}  # which process computes each weight's codes (calibrate_split)
        hessians: dict[str, Hessian] = {}
        hooks = [layer.get_submodule(p).register_forward_pre_hook(self._summing(hessians, p, split.owns(slot[p])))
                 for p in others]
        moe_in = TokenRows(self.windows.numel()) if len(others) < len(stored) else None
        if moe_in is not None:
            hooks.append(keep_input(moe, moe_in))
        ref = self._run(layer, L, None)
        for h in hooks:
            h.remove()
        result: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path in others:
            h = hessians.get(path)
            if split.owns(slot[path]):
                result[stored[path]] = self._quantize(layer, path, stored[path], h.sum if h and h.tokens else None)
        # linears no token reached (a weight the layer uses other than through its forward)
        unreached = sum(not (p in hessians and hessians[p].tokens) for p in others)
        fig = {"layer": L, "tokens": int(self.windows.numel()), "calibrated": len(stored),
               "linears_rounded_no_tokens": unreached}
        if moe_in is not None:
            trim()
            fig.update(self._experts(layer, moe, moe_in, stored, result))
            del moe_in
        fig["codes_computed_here"] = len(result)  # the others' came from the other processes (torchrun)
        path_of = {n: p for p, n in stored.items()}
        for name, parts in split.gather(result, owner).items():
            cols = layer.get_submodule(path_of[name]).dense(torch.float32).shape[1]
            result[name] = self._install(layer, path_of[name], parts, cols)
        result = {n: result[n] for n in stored.values()}
        trim()
        out = self._run(layer, L, self.x)  # in place: each micro-batch's output over its input
        fig["output_rel_error"] = rel_error(out, ref, MICRO_BATCH)
        fig["seconds"] = round(time.perf_counter() - t0, 3)
        self.figures.append(fig)
        self.x = out
        if self.progress:
            self.progress("file", path=f"layer {L}: {fig['tokens']} tokens, {fig['seconds']:.1f} s, "
                                       f"output error {fig['output_rel_error']:.2e}")
        return result

    def _summing(self, hessians: dict, path: str, owned: bool):
        """Counts the tokens a linear sees; sums their Hessian where this process computes its codes."""
        def hook(mod, args):
            x = args[0]
            h = hessians.setdefault(path, Hessian(x.shape[-1] if owned else 0))
            if owned:
                h.add(x)
            else:
                h.tokens += x[..., 0].numel()
        return hook

    def _calibrates(self, name: str, shape: tuple[int, ...]) -> bool:
        t, info = self.ck.logical[name], self.ck.info(name)
        return self.policy.calibrates(info, shape, source_quant(self.ck, t, info))

    def _quantize(self, layer, path: str, name: str, H: torch.Tensor | None):
        """GPTQ (or nearest, H None) codes of linear `path`, and the module replaced by its dequantized weight."""
        w = layer.get_submodule(path).dense(torch.float32)
        parts = self.grid.gptq(w, H, group=self.policy.group_size, search=self.policy.int4_scales,
                               scale_2=self.scale_2.get(name), name=name)
        return self._install(layer, path, parts, w.shape[1])

    def _install(self, layer, path: str, parts: tuple[torch.Tensor, ...], cols: int):
        """Linear `path` replaced by the dequantized weight of its codes and scales `parts`; returns them."""
        parent, _, attr = path.rpartition(".")
        deq = self.grid.dequantize(parts, self.policy.group_size)
        setattr(layer.get_submodule(parent) if parent else layer, attr, PlainLinear.holding(deq[:, :cols]))
        return parts

    def _experts(self, layer, moe, rows: TokenRows, stored: dict, result: dict) -> dict:
        """Each routed expert's weights from the tokens routed to it (gate/up, then down on their quantized
        output), for this process's experts; the token counts of all."""
        x, ids = chosen_experts(moe, rows)
        counts, few = [], 0
        mlp_path = next(p for p, mod in layer.named_modules() if mod is moe)
        for e, expert in moe.experts.items():
            mine = (ids == int(e)).any(-1).nonzero().flatten()
            counts.append(len(mine))
            enough = len(mine) >= MIN_EXPERT_TOKENS
            few += not enough
            if not self.split.owns(int(e)):
                continue
            xe = x[mine]
            ep = f"{mlp_path}.experts.{e}"
            H = xe.T @ xe if enough else None
            ins, down = expert_parts(moe)
            for part in ins:
                if f"{ep}.{part}" in stored:
                    result[stored[f"{ep}.{part}"]] = self._quantize(layer, f"{ep}.{part}", stored[f"{ep}.{part}"], H)
            if f"{ep}.{down}" in stored:
                h = None
                if enough:  # an expert can take every token: xe and H go before its activations are made
                    H = None
                    h, xe = down_input(moe, expert, xe), None
                result[stored[f"{ep}.{down}"]] = self._quantize(layer, f"{ep}.{down}", stored[f"{ep}.{down}"],
                                                                h.T @ h if enough else None)
        counts.sort()
        return {"experts": len(counts), "experts_rounded_few_tokens": few, "expert_tokens_min": counts[0],
                "expert_tokens_median": counts[len(counts) // 2]}

    def _run(self, layer, L: int, into: torch.Tensor | None) -> torch.Tensor:
        """The layer over every calibration sequence (micro-batches), from self.x, written into `into` (which may
        be self.x: each micro-batch's output replaces its input once that is read), or into a new tensor where
        `into` is None or the residual changes shape (Kimi K3's attention residuals gain a block at a block's
        first layer)."""
        m = self.model
        cache = None  # one for the micro-batches, reset between: a cache is a reference cycle, which only the
        # garbage collector frees (a new one per micro-batch held them all: +6 MiB each on tiny-k25-dsv32)
        with torch.inference_mode(False), torch.no_grad():
            for i in range(0, self.x.shape[0], MICRO_BATCH):
                x = self.x[i:i + MICRO_BATCH]
                B, T = x.shape[:2]
                if cache is None or cache.batch != B:
                    cache = m.new_cache(B, T)
                cache.reset()
                cos, sin = m.rotary(torch.arange(T).expand(B, T), m.dtype)
                ids = self.windows[i:i + MICRO_BATCH]
                y = layer.forward(x, 0, cache.layers[m.slot[L]], cos, sin, m.par, ids=ids)
                if into is None or into.shape[1:] != y.shape[1:]:
                    into = torch.empty((self.x.shape[0], *y.shape[1:]), dtype=y.dtype)
                into[i:i + MICRO_BATCH] = y
        return into

