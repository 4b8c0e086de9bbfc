"""Where a release's config.json disagrees with the tensors it stores: one rule per case, and the warning `inspect`
prints (docs/RELEASES.md "Config against tensors"). kconvert reads every case by the rule; the warning says what a
reader that takes the config at its word would get wrong.

- Draft stages: DeepSeek-V4-Flash-0731 writes `num_nextn_predict_layers: 1` and stores three DSpark stages
  (mtp.0-2). The stages are counted from the stored names (the manifest's `stages_from_names`, as mlx-vlm's drafter
  splitter counts them), never fewer than the config says; each stage stored must be whole.
- Quantization ignore list: Kimi K3's compressed-tensors `ignore` does not name tensors it stores unquantized (the
  attention-residual projections, the latent MoE projections; llm-compressor 0.14 patches the list). A tensor's
  scheme comes from how it is stored (`weight_packed` + `weight_scale`, or a plain weight), never from the list.
- A_log wider than the heads: Kimi K3 stores each KDA layer's `A_log` [head_dim] for `num_heads` heads. The first
  `num_heads` entries are read (as mlx-lm and vLLM read them); the rest are padding."""

from __future__ import annotations

import re

from kconvert.source.checkpoint import Checkpoint

PLAIN = ("BF16", "F16", "F32")
NOT_LINEAR = ("router", "hash_router", "embed", "norm")  # manifest components no quantization list targets


def disagreements(ck: Checkpoint) -> list[str]:
    return [w for w in (draft_stages(ck), ignore_list(ck), a_log(ck)) if w]


def draft_stages(ck: Checkpoint) -> str | None:
    said = int(ck.text_config.get("num_nextn_predict_layers") or 0)
    stored = ck.model.text.extra_layers
    if stored <= said:
        return None
    return (f"config.json says num_nextn_predict_layers {said}, the checkpoint stores {stored} draft stages: all "
            f"{stored} are read (counted from their names, as mlx-vlm counts them)")


def _ignored(name: str, ignore: list) -> bool:
    for entry in ignore:
        entry = str(entry)
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


def ignore_list(ck: Checkpoint) -> str | None:
    qc = ck.quantization_config or {}
    if qc.get("quant_method") != "compressed-tensors" or "ignore" not in qc:
        return None
    packed = {n[: -len(".weight_packed")] for n in ck.stored if n.endswith(".weight_packed")}
    unnamed = sorted(n for n, e in ck.stored.items()
                     if n.endswith(".weight") and len(e.shape) == 2 and e.dtype in PLAIN
                     and n[: -len(".weight")] not in packed and not _ignored(n[: -len(".weight")], qc["ignore"])
                     and ck.info(n).component not in NOT_LINEAR)
    if not unnamed:
        return None
    kinds = sorted({re.sub(r"\.\d+\.", ".N.", n) for n in unnamed})
    return (f"quantization_config.ignore does not name {len(unnamed)} tensors stored unquantized ("
            f"{', '.join(kinds[:6])}{', ...' if len(kinds) > 6 else ''}): each is read as stored; the list does not "
            "decide a tensor's scheme")


def a_log(ck: Checkpoint) -> str | None:
    heads = (ck.text_config.get("linear_attn_config") or {}).get("num_heads")
    name = next((n for n in ck.stored if n.endswith("self_attn.A_log")), None)
    if not heads or name is None:
        return None
    width = ck.stored[name].shape[-1] if ck.stored[name].shape else 1
    if width <= int(heads):
        return None
    return (f"{name} holds {width} values for {heads} KDA heads (linear_attn_config.num_heads): the first {heads} "
            "are read, as mlx-lm and vLLM read them")
