"""FP8 rows: e4m3 values with one power-of-two (e8m0) scale per `ROW_GROUP` values of a row, as DeepSeek-V4.1 stores
its Engram tables (`X.weight` F8_E4M3 [rows, width] + `X.scale` F8_E8M0 [rows, width / 32]). A table is looked up a
row at a time, so its rows carry their own scales, and a rank holds a run of whole rows.

Never a `--quant` choice: the manifest marks such tensors (`scale_block = [1, 32]`) and every scheme copies them as
stored, bit for bit, written `X.weight` + `X.weight_scale` (docs/FORMAT.md), or `X.weight` + `X.scale` in an
export in the release's layout (fp8-block of DeepSeek-V4.1). `quantize` is the encoder the
fixtures write the release's tables with; `dequantize` is what the engine computes per looked-up row."""

from __future__ import annotations

from kconvert.quant.scheme import V4_ENCODINGS, LosslessCopy, Options, Scheme, SourceQuant, sidecar

ROW_GROUP = 32  # values of a row per scale
E4M3_MAX = 448.0


class Fp8Rows(Scheme):
    name = "fp8_rows"
    shard = False  # copied where the source stores it so, never chosen

    def misfit(self, shape: tuple[int, ...], opts: Options) -> str | None:
        if len(shape) != 2 or shape[1] % ROW_GROUP:
            return f"FP8 rows need a 2-D table {ROW_GROUP} values wide per scale, got {list(shape)}"
        return None

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list:
        r, c = shape
        scale = sidecar(src) if opts.encoding in V4_ENCODINGS else src + "_scale"  # the release's `.scale` in exports
        return [(src, "F8_E4M3", (r, c)), (scale, "F8_E8M0", (r, c // ROW_GROUP))]

    def quantize(self, w, opts: Options, name: str = ""):
        import torch

        rows, cols = w.shape
        tiles = w.float().view(rows, cols // ROW_GROUP, ROW_GROUP)
        amax = tiles.abs().amax(-1)
        exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)), torch.zeros_like(amax)).clamp(-127, 127)
        q = (tiles / torch.exp2(exp)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(rows, cols)
        return [q.contiguous(), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu).contiguous()]

    def dequantize(self, stored, opts: Options, dtype=None):
        import torch

        w, scale = stored
        s = scale.float().repeat_interleave(ROW_GROUP, -1)
        return (w.float() * s).to(dtype or torch.float32)

    def lossless_copy(self, source: SourceQuant, opts: Options, *, same_scale_format: bool = False) -> LosslessCopy | None:
        """A source stored as FP8 rows with power-of-two scales: its bytes, cut by whole rows."""
        if source.format == "block_fp8" and source.block == (1, ROW_GROUP) and source.scale_format == "ue8m0":
            return LosslessCopy(self.name, ("weight", "scale"), 1)
        return None


SCHEME = Fp8Rows()
