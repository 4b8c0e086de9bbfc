"""`nvfp4`: NVIDIA's FP4 (Blackwell's native weight format): the e2m1 codes of MXFP4, two a byte (the even column in
the low nibble), with a float8_e4m3 scale per 16 inputs of a row and one float32 scale for the whole tensor. Routed
experts by default; what the rest of a model becomes is the family's (manifest `[family.nvfp4]`, by component:
NVIDIA's K3 recipe puts the attention projections in 128x128 block FP8, its V4 builds keep the released FP8).

Two on-disk encodings of the same codes and block scales:
- kconvert (`shard`, and `export --format nvfp4`: ModelOpt's layout, what vLLM's and SGLang's modelopt loaders read):
  `X.weight` U8 [R, C/2], `X.weight_scale` F8_E4M3 [R, C/16], `X.weight_scale_2` F32 [] and the activation scale
  `X.input_scale` F32 []; value = E2M1[code] * (weight_scale * weight_scale_2), the product of the scales in float32
  first (ModelOpt's NVFP4QTensor.dequantize).
- compressed-tensors (`export --format nvfp4-ct`, `nvfp4-pack-quantized`): `X.weight_packed` U8, `X.weight_scale`
  F8_E4M3, `X.weight_global_scale` F32 [1] = 1 / weight_scale_2 and `X.input_global_scale` F32 [1] = 1 / input_scale
  (compressed-tensors' own ModelOpt converter); value = E2M1[code] * (weight_scale / weight_global_scale), its
  decompressor's order.

Quantizing a float weight (ModelOpt's rule): weight_scale_2 = amax / (6 * 448); each block's scale
e4m3(max(block amax / (6 * weight_scale_2), 2^-9)), an all-zero block's 1.0; each w / (scale * weight_scale_2) to the
nearest e2m1 value, ties to the even code, the sign kept on a value that rounds to zero (as ModelOpt's and
compressed-tensors' packers do). An all-zero tensor takes weight_scale_2 = 1.

From MXFP4 (e8m0 2^k_j per 32 inputs) the cast is exact where e4m3 can hold the ratio of the scales: with
weight_scale_2 = 2^(k_max - 8) each 16-block's scale is 2^(k_j - k_max + 8), the product is the source's 2^k_j and
every code is copied verbatim (Model-Optimizer's closed-form MXFP4 -> NVFP4 cast). e4m3 holds 2^-9 .. 2^8, so a block
is exact when k_max - k_j <= 17, or when its codes are all zero; a block further down gets the data-derived scale 2^-9
(the finest e4m3 has) and its values rounded at it; quant/tally.py counts both kinds. k_max runs over the groups with a
nonzero code. Engines fuse an expert's w1 and w3 into one GEMM with one weight_scale_2: a conversion gives a fused
group the largest of its members' scales (`Options.tensor_scale`), which keeps every block exact that each alone would.

Over 300 lines: one format's rules (the codes, ModelOpt's scale rule, the exact cast from MXFP4, both encodings and the
scheme that picks among them) are read and changed together; split, each half would restate the other's constants.
"""

from __future__ import annotations

from kconvert.errors import CheckpointError
from kconvert.quant.chunks import check_scales, row_chunks
from kconvert.quant.fp4_e2m1 import E2M1, E8M0_BIAS, GROUP as MX_GROUP, e2m1_codes
from kconvert.quant.scheme import COMPRESSED_TENSORS, LosslessCopy, Options, Scheme, SourceQuant, Spec
from kconvert.quant.tally import count

GROUP = 16  # inputs per e4m3 block scale
E2M1_MAX, E4M3_MAX = 6.0, 448.0
E4M3_KMIN, E4M3_KMAX = -9, 8  # the powers of two e4m3 holds: 2^-9 (its smallest subnormal) .. 2^8
WINDOW = E4M3_KMAX - E4M3_KMIN  # 17: octaves between a tensor's largest MXFP4 group and the lowest one cast exactly
INPUT_SCALE = 1.0  # the activation scale written without calibration (Model-Optimizer's K3 converter's default)
CAST = "mxfp4_to_nvfp4"  # the transform of the exact cast (kconvert.json, the plan)
COPY = "nvfp4_copy"  # an NVFP4 source's bytes


# ------------------------------------------------------------------------------------------------ codes and scales
def signed_codes(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of y (already divided by its scale): the nearest value, ties to the even code, and the sign bit
    of every negative y, one that rounds to zero included (ModelOpt's and compressed-tensors' packers)."""
    import torch

    m = e2m1_codes(y.abs())
    return torch.where(y < 0, m | 8, m)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., C] -> pairs [..., C/2], the even column in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _lut(device) -> torch.Tensor:
    import torch

    return torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=device)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes 0..15 (sign bit 3)."""
    return _lut(codes.device)[codes.long()]


def scale_from_amax(amax: float) -> float:
    """weight_scale_2 of a tensor (or fused group) whose largest magnitude is `amax` (ModelOpt's amax / (6 * 448),
    in float32); 1.0 for an all-zero one."""
    import torch

    if not amax > 0:
        return 1.0
    return float(torch.tensor(amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX))


def scale_from_mxfp4(packed: torch.Tensor, e8m0: torch.Tensor) -> float:
    """weight_scale_2 = 2^(k_max - 8) of the exact cast of MXFP4 codes [..., R, C/2] with e8m0 scales [..., R, C/32]:
    k_max over the groups holding a nonzero code; 1.0 when none does."""
    import torch

    k = e8m0.view(torch.uint8).to(torch.int32) - E8M0_BIAS
    live = (packed.view(torch.uint8) & 0x77).view(*k.shape, MX_GROUP // 2).amax(-1) > 0
    if not bool(live.any()):
        return 1.0
    return float(2.0 ** (int(k[live].max()) - E4M3_KMAX))


def _power_of_two(x: float, name: str) -> int:
    import math

    m, e = math.frexp(x)
    if m != 0.5:
        raise ValueError(f"{name}: the exact MXFP4 cast needs a power-of-two weight_scale_2, got {x!r}")
    return e - 1


def _tensor_scale(w: torch.Tensor, scale_2: float | None, name: str) -> torch.Tensor:
    """float32 [] weight_scale_2: `scale_2` (a fused group's shared one) or w's own by ModelOpt's rule."""
    import torch

    if scale_2 is None:
        amax = float(w.abs().amax()) if w.numel() else 0.0
        if amax != amax or amax == float("inf"):
            check_scales(torch.tensor([amax]), w, name)
        scale_2 = scale_from_amax(amax)
    return torch.tensor(scale_2, dtype=torch.float32)


def _block_scales(g: torch.Tensor, s2: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
    """e4m3 [r, C/16, 1] scales of float32 blocks g [r, C/16, 16]: e4m3(max(block amax / (6 * s2), 2^-9)), an all-zero
    block's 1.0; NaN / Inf refused naming `name`."""
    import torch

    bs = g.abs().amax(-1, keepdim=True) / (E2M1_MAX * s2)
    check_scales(bs, w, name)
    return torch.where(bs == 0, torch.ones_like(bs), bs).clamp_(min=2.0 ** E4M3_KMIN).to(torch.float8_e4m3fn)


def nvfp4_scales(w: torch.Tensor, scale_2: float | None = None, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 block scales [R, C/16], float32 [] scale_2) of w [R, C]: quantize_nvfp4's, fixed before GPTQ codes
    (quant/gptq.py) are chosen at them."""
    import torch

    rows, cols = w.shape
    s2 = _tensor_scale(w, scale_2, name)
    g = w.to(torch.float32).reshape(rows, cols // GROUP, GROUP)
    return _block_scales(g, s2, w, name).view(rows, cols // GROUP), s2


def quantize_nvfp4(w: torch.Tensor, scale_2: float | None = None, name: str = "") -> tuple[torch.Tensor, ...]:
    """w [R, C] float (C a multiple of 16) -> (U8 code pairs [R, C/2], e4m3 block scales [R, C/16], float32 [] scale_2)
    by ModelOpt's rule; `scale_2` a fused group's shared one (else the tensor's own)."""
    import torch

    rows, cols = w.shape
    s2 = _tensor_scale(w, scale_2, name)
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    block_scale = torch.empty(rows, cols // GROUP, dtype=torch.float8_e4m3fn)
    for r0, r1 in row_chunks(rows, cols):
        g = w[r0:r1].to(torch.float32).reshape(r1 - r0, cols // GROUP, GROUP)
        bs = _block_scales(g, s2, w, name)
        codes = signed_codes(g / (bs.to(torch.float32) * s2)).view(r1 - r0, cols)
        packed[r0:r1] = pack(codes)
        block_scale[r0:r1] = bs.view(r1 - r0, cols // GROUP)
    return packed, block_scale, s2.reshape(())


def cast_mxfp4(packed: torch.Tensor, e8m0: torch.Tensor, scale_2: float | None = None,
               name: str = "") -> tuple[torch.Tensor, ...]:
    """MXFP4 (U8 code pairs [R, C/2], e8m0 [R, C/32]) -> NVFP4 (code pairs, e4m3 [R, C/16], float32 [] scale_2): every
    block within e4m3's window of k_max keeps its codes and its value; one below it is rounded at the data-derived
    scale 2^-9 (both counted: quant/tally.py). `scale_2` a fused group's shared power of two (else the tensor's own)."""
    import torch

    packed = packed.view(torch.uint8)
    rows = packed.shape[0]
    m = _power_of_two(scale_2 if scale_2 is not None else scale_from_mxfp4(packed, e8m0), name)
    k = (e8m0.view(torch.uint8).to(torch.int32) - E8M0_BIAS).repeat_interleave(MX_GROUP // GROUP, dim=1)
    blocks = packed.view(rows, -1, GROUP // 2)  # [R, C/16, 8 bytes]
    live = (blocks & 0x77).amax(-1) > 0
    d = k - m  # each block's scale exponent: 2^d * 2^m = 2^k_j
    if live.any() and int(d[live].max()) > E4M3_KMAX:
        raise ValueError(f"{name}: weight_scale_2 2^{m} is below a group's 2^{int(d[live].max()) + m} / 2^{E4M3_KMAX}")
    low = live & (d < E4M3_KMIN)  # past e4m3's window: data-derived scale 2^-9
    count(int(live.numel() - low.sum()), int(low.sum()))
    scale = torch.exp2(d.clamp(E4M3_KMIN, E4M3_KMAX).to(torch.float32)).to(torch.float8_e4m3fn)
    out = packed
    if bool(low.any()):  # their values v = E2M1[code] 2^k_j, at the scale 2^-9 * 2^m: v / that = E2M1[code] 2^(d + 9)
        codes = _unpack(blocks[low])  # [n, 16]
        y = _lut(codes.device)[codes.long()] * torch.exp2((d[low] - E4M3_KMIN).to(torch.float32))[:, None]
        out = packed.clone()
        out.view(rows, -1, GROUP // 2)[low] = pack(signed_codes(y))
    return out, scale, torch.tensor(2.0 ** m, dtype=torch.float32).reshape(())


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor,
                     dtype: torch.dtype | None = None, *, divide: bool = False) -> torch.Tensor:
    """U8 code pairs [R, C/2], e4m3 [R, C/16] and the tensor's scale -> [R, C] (float32 unless `dtype`): E2M1[code]
    times (block scale * scale_2) (ModelOpt's order) or, `divide`, times (block scale / global scale)
    (compressed-tensors' order: `scale_2` is then its weight_global_scale)."""
    import torch

    rows = packed.shape[0]
    codes = _unpack(packed.view(torch.uint8))
    s = block_scale.to(torch.float32)
    g = scale_2.to(torch.float32).reshape(())
    per_block = s / g if divide else s * g
    v = _lut(packed.device)[codes.long()].view(rows, -1, GROUP) * per_block[..., None]
    return v.view(rows, -1).to(dtype or torch.float32)


def _sibling(src: str, name: str) -> str:
    """A module's other tensor: "X.weight" -> "X.<name>" (a bare "weight" -> "<name>": the engine's module)."""
    return src[: -len("weight")] + name if src.endswith("weight") else src + "." + name


# ------------------------------------------------------------------------------------------------ the scheme
class NvFp4(Scheme):
    name = "nvfp4"
    experts_only = True
    per_tensor = True
    copies = (CAST, COPY)

    def option_problem(self, opts: Options) -> str | None:
        if opts.group_size not in (GROUP, MX_GROUP):  # 32: the default of --group-size (int4's), left alone
            return f"--quant nvfp4 stores one e4m3 scale per {GROUP} inputs; --group-size {opts.group_size} does not apply"
        return None

    def role(self, info, family: dict) -> str | None:
        """What `--quant nvfp4` stores this tensor in (manifest `[family.nvfp4]`): routed experts NVFP4 (a drafter's
        in `drafter_experts` where set: V4's NVFP4 builds keep the MTP experts MXFP4), other components the scheme
        their key names (`attention = "fp8"`), the rest unquantized. Only tensors the manifest marks `quantize`."""
        if not info.quantize:
            return None
        traits = family.get("nvfp4", {})
        if info.expert is not None:
            return traits.get("drafter_experts", self.name) if info.component == "mtp" else self.name
        return traits.get(info.component)

    def misfit(self, shape: tuple[int, ...], opts: Options) -> str | None:
        if shape[1] % GROUP:
            return f"{shape[1]} inputs per rank do not divide into nvfp4's blocks of {GROUP}"
        return None

    def specs(self, src: str, shape: tuple[int, ...], opts: Options) -> list[Spec]:
        r, c = shape
        if opts.encoding == COMPRESSED_TENSORS:
            return [(src + "_packed", "U8", (r, c // 2)), (src + "_scale", "F8_E4M3", (r, c // GROUP)),
                    (src + "_global_scale", "F32", (1,)), (_sibling(src, "input_global_scale"), "F32", (1,))]
        return [(src, "U8", (r, c // 2)), (src + "_scale", "F8_E4M3", (r, c // GROUP)), (src + "_scale_2", "F32", ()),
                (_sibling(src, "input_scale"), "F32", ())]

    def _encode(self, packed, block_scale, scale_2, input_scale, opts: Options) -> list[torch.Tensor]:
        import torch

        if opts.encoding == COMPRESSED_TENSORS:  # its divisors: 1 / each scale (compressed-tensors' converter)
            one = torch.ones((), dtype=torch.float32)
            return [packed, block_scale, (one / scale_2).reshape(1), (one / input_scale).reshape(1)]
        return [packed, block_scale, scale_2.reshape(()), input_scale.reshape(())]

    def quantize(self, w: torch.Tensor, opts: Options, name: str = "") -> list[torch.Tensor]:
        import torch

        parts = quantize_nvfp4(w, opts.tensor_scale, name)
        return self._encode(*parts, torch.tensor(INPUT_SCALE, dtype=torch.float32), opts)

    def encode(self, codes: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor,
               opts: Options) -> list[torch.Tensor]:
        """uint8 codes [R, C] (sign bit 3) and scales chosen elsewhere (calibrated: quant/gptq.py's nvfp4 grid), as
        stored."""
        import torch

        return self._encode(pack(codes), block_scale.to(torch.float8_e4m3fn), scale_2.to(torch.float32).reshape(()),
                            torch.tensor(INPUT_SCALE, dtype=torch.float32), opts)

    def dequantize(self, stored: list[torch.Tensor], opts: Options, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nvfp4(stored[0], stored[1], stored[2], dtype, divide=opts.encoding == COMPRESSED_TENSORS)

    def lossless_copy(self, source: SourceQuant, opts: Options, *, same_scale_format: bool = False) -> LosslessCopy | None:
        """MXFP4 experts (DeepSeek-V4's int8 pairs, Kimi K3's compressed-tensors bytes): the exact cast. An NVFP4
        source: its codes and scales as stored (its input_scale where it has one). Whole tensors only: the
        tensor's scale is the whole tensor's."""
        if source.format == "fp4_packed":
            return LosslessCopy(CAST, ("weight", "scale"), MX_GROUP, whole=True, recode=self._cast_recode)
        if source.format == "nvfp4_packed" and "scale_2" in source.parts:  # (compressed-tensors': dequantized)
            roles = ("weight", "scale", "scale_2") + (("input_scale",) if "input_scale" in source.parts else ())
            return LosslessCopy(COPY, roles, GROUP, whole=True, recode=self._copy_recode)
        return None

    def _cast_recode(self, parts, name: str = "", opts: Options | None = None) -> list[torch.Tensor]:
        import torch

        opts = opts or Options()
        packed, scale = parts
        return self._encode(*cast_mxfp4(packed, scale, opts.tensor_scale, name),
                            torch.tensor(INPUT_SCALE, dtype=torch.float32), opts)

    def _copy_recode(self, parts, name: str = "", opts: Options | None = None) -> list[torch.Tensor]:
        import torch

        packed, scale, scale_2 = parts[:3]
        inp = parts[3] if len(parts) > 3 else torch.tensor(INPUT_SCALE)
        return self._encode(packed.view(torch.uint8), scale.view(torch.float8_e4m3fn),
                            scale_2.to(torch.float32).reshape(()), inp.to(torch.float32).reshape(()), opts)

    def shared_scale(self, members: list[tuple[str, object, LosslessCopy | None]]) -> float:
        """The weight_scale_2 a fused group's members (name, input, copy) share: the largest of their own. Copied
        NVFP4 members keep the scale they store, so theirs must already agree: refused otherwise, naming the one
        that differs."""
        scales = [(name, self.tensor_scale(x, copy), copy) for name, x, copy in members]
        stored = [(name, s) for name, s, copy in scales if copy is not None and copy.transform == COPY]
        for name, s in stored[1:]:
            if s != stored[0][1]:
                raise CheckpointError(f"weight_scale_2 {s!r} differs from {stored[0][1]!r}, its fused partner "
                                      f"{stored[0][0]}'s: serving engines run the pair as one GEMM with one scale",
                                      tensor=name + "_scale_2")
        return max(s for _, s, _ in scales)

    def tensor_scale(self, x, copy: LosslessCopy | None) -> float:
        """The weight_scale_2 this tensor takes on its own: from its MXFP4 scales (the cast), as stored (an NVFP4
        copy), or from its values (quantizing); what a fused group's members' maximum is taken over."""
        if copy is not None and copy.transform == CAST:
            return scale_from_mxfp4(*x)
        if copy is not None:
            return float(x[2])
        return scale_from_amax(float(x.abs().amax()) if x.numel() else 0.0)


SCHEME = NvFp4()
