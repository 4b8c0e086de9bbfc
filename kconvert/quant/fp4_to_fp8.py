"""FP4 e2m1 (one e8m0 scale per 32 inputs) -> block FP8 e4m3 (one scale per 128x128), exactly.

For GPUs without FP4 (Hopper, MUSA S5000): `shard --quant fp8` of a DeepSeek-V4 release keeps every
expert weight's value. Why it is exact: an FP4 value is c * 2^k with c in {0, 0.5, 1, 1.5, 2, 3, 4, 6}
(at most two significant bits) and k its group's e8m0 exponent. With the block scale 2^m, the stored
FP8 value is c * 2^(k - m). e4m3fn holds c * 2^d for every c exactly when -8 <= d <= 6: 6 * 2^6 = 384
<= 448 at the top, 0.5 * 2^-8 = 2^-9 (the smallest subnormal) and 1.5 * 2^-8 = 3 * 2^-9 at the bottom.
So m = (largest k in the block) - 6 holds every group whose k is at least m - 8, that is, a block
whose groups' exponents span at most 14 octaves. A block spanning more cannot be held exactly by one
scale: the conversion is refused with that reason, never rounded silently, unless `shard --requantize` asks
for rounding: then the block's scale still holds its largest group exactly and the groups more than 14 octaves
below it are rounded to the nearest e4m3 value (its subnormals, or zero), the only values that change.
Groups whose codes are all zero carry no value, so their scale does not count."""

from __future__ import annotations

from kconvert.errors import UsageError
from kconvert.io.dtypes import FP8_BLOCK
from kconvert.quant.fp4_e2m1 import E2M1, E8M0_BIAS, GROUP

TOP = 6  # 6 * 2^6 = 384: the largest e2m1 value lands under e4m3's 448
SPAN = 14  # d from -8 to 6: the octaves one block scale holds exactly


def block_exponents(packed: torch.Tensor, scale: torch.Tensor, name: str = "", block: int = FP8_BLOCK,
                    rounding: bool = False) -> torch.Tensor:
    """int32 [..., ceil(R/b), ceil(C/b)]: the exponent m of each block's scale 2^m (refuses a block whose
    groups span more than SPAN octaves, unless `rounding`). Leading dims: weights of a stack, each its own blocks."""
    import torch

    lead, rows = packed.shape[:-2], packed.shape[-2]
    k = scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS  # [..., R, C/32]
    live = (packed & 0x77).view(*lead, rows, -1, GROUP // 2).amax(dim=-1) > 0  # a nonzero magnitude in the group
    per = block // GROUP  # groups across one block
    br, bc = -(-rows // block), -(-k.shape[-1] // per)
    pad_r, pad_c = br * block - rows, bc * per - k.shape[-1]
    big, small = torch.iinfo(torch.int32).max, torch.iinfo(torch.int32).min

    def fold(x: torch.Tensor, fill: int, op) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r), value=fill)
        return op(op(x.view(*lead, br, block, bc, per), dim=-1).values, dim=-2).values

    hi = fold(torch.where(live, k, small), small, torch.max)
    lo = fold(torch.where(live, k, big), big, torch.min)
    empty = hi == small  # an all-zero block: any scale
    wide = ~empty & (hi - lo > SPAN)
    if wide.any() and not rounding:
        b = tuple(wide.nonzero()[0].tolist())
        r, c = b[-2:]
        raise UsageError(
            f"--quant fp8: FP4 block ({r}, {c}) has group scales 2^{int(lo[b])} .. 2^{int(hi[b])}, "
            f"more than the {SPAN} octaves one FP8 block scale holds exactly; `shard --requantize` rounds the "
            f"smallest groups (or --quant fp4 keeps FP4)", tensor=name)
    return torch.where(empty, torch.zeros_like(hi), hi - TOP)


def fp4_to_fp8_block(packed: torch.Tensor, scale: torch.Tensor, name: str = "", block: int = FP8_BLOCK,
                     rounding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [..., R, C/2] e2m1 pairs, e8m0 [..., R, C/32]) -> (float8_e4m3fn [..., R, C], float32
    [..., ceil(R/b), ceil(C/b)]) with q * scale equal to the FP4 value, element for element (`rounding`: except in
    the groups more than SPAN octaves under their block's largest, rounded to nearest). Each q is code * 2^(k - m),
    computed in that form (never as the FP4 value itself, which overflows float32 at e8m0's top scales). Leading
    dims: a stack of weights (shard's), each with its own blocks, bit-identical to converting each alone."""
    import torch

    m = block_exponents(packed, scale, name, block, rounding)
    rows = packed.shape[-2]
    k = scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS
    m_groups = m.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block // GROUP, -1)[..., : k.shape[-1]]
    # in range for every live group of an exact block; below it (rounding) e4m3's cast rounds to nearest, and
    # from 2^-13 down even code 6 is under half e4m3's smallest subnormal 2^-9: zero, as at the clamp
    low = -SPAN + TOP - 8 if rounding else -SPAN + TOP
    d = (k - m_groups).clamp_(low, TOP)
    # each code pair byte becomes its two e4m3 bytes by one lookup in the table of its group's d (_pair_table): one
    # gather over the source bytes (numpy's take: a few ns a byte), not a float32 product over every value
    import numpy as np

    at = (((d - low) << 8).numpy().astype(np.uint16)[..., None]  # d's table, then the byte's entry in it
          + packed.contiguous().numpy().reshape(*d.shape, GROUP // 2))
    pairs = np.take(_pair_table(low).view(-1, 2).view(torch.int16).view(-1).numpy(), at)
    q = torch.from_numpy(pairs).view(torch.uint8).view(*packed.shape[:-1], -1)
    return q.view(torch.float8_e4m3fn), torch.exp2(m.to(torch.float32))  # exact blocks: every q is an e4m3 value


_PAIR_TABLES: dict = {}


def _pair_table(low: int):
    """uint8 [TOP - low + 1, 256, 2]: for each exponent d in [low, TOP] and each byte of two e2m1 codes (the low
    nibble first), the e4m3 bytes of code * 2^d, made as the values themselves would be cast (the float32 product,
    exact, then torch's cast to float8_e4m3fn: rounding to nearest where d is below what e4m3 holds exactly), so a
    lookup gives the same bits as the product. Made once per `low` (a few KiB)."""
    import torch

    table = _PAIR_TABLES.get(low)
    if table is None:
        lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
        d = torch.arange(low, TOP + 1, dtype=torch.float32)
        e4m3 = (lut[None, :] * torch.exp2(d)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)  # [d, code]
        pair = torch.arange(256)
        table = _PAIR_TABLES[low] = torch.stack([e4m3[:, pair & 0xF], e4m3[:, pair >> 4]], dim=-1).contiguous()
    return table


def recode(parts: tuple[torch.Tensor, ...], name: str = "", options=None) -> list[torch.Tensor]:
    """A LosslessCopy recode: the source's (int8 code pairs, e8m0 scales) -> fp8_block's stored tensors."""
    import torch

    packed, scale = parts
    return list(fp4_to_fp8_block(packed.view(torch.uint8), scale, name))


def recoder(block: int, rounding: bool = False):
    """`recode` into blocks of `block` (fp8_block.lossless_copy's, per run); `rounding`: `--requantize`'s."""
    if block == FP8_BLOCK and not rounding:
        return recode
    import torch

    def recode_block(parts: tuple[torch.Tensor, ...], name: str = "", options=None) -> list[torch.Tensor]:
        packed, scale = parts
        return list(fp4_to_fp8_block(packed.view(torch.uint8), scale, name, block, rounding))

    return recode_block
