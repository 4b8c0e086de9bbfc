"""`kconvert verify`'s check of the draft heads (MTP layers) a conversion holds.

A draft head loaded wrongly leaves the output right, since the target checks every draft: serving engines ran
heads on random weights (0 % acceptance) or without their shared experts (60 % -> 26 %) and said nothing
(vLLM #43456, #43459). So on verify's prompt set, for the head the drafter uses:

1. predictions: at every prompt position, the head's next-token distribution read with the target's own hidden
   states and the true next token, against the reference's (mean KLD, same top-1), within `[draft] mean_kld` when
   every weight is copied, `mean_kld_quantized` otherwise. The reference runs the
   source: the engine in float32 on a temporary tp 1 `--quant none` conversion of it gives the target's hidden
   states, and the source's own head reads them, as the family's manifest says (`draft_reference`):
   "mlx-vlm" (DeepSeek-V4's MTP block: mlx-vlm 0.7.10's deepseek_v4_mtp drafter, loaded from the source's
   `mtp.*` tensors; V4-0731's DSpark drafter: mlx-vlm's deepseek_v4_dspark, kconvert/verify/mlx_dspark.py),
   otherwise the engine's head itself (no reference implements the DeepSeek-V3-style MTP
   layer: transformers drops it, mlx-lm too; nor V4.1's DSpark drafter). A DSpark drafter's prediction at a
   position is its block's first draft there (base logits + the Markov bias of the anchor, the true next token),
   its context the target's taps up to that position (engine/draft/dspark.py).
2. acceptance: greedy speculative decoding of `new_tokens` after each prompt (k = the number of heads), the
   share of drafts the target accepts, against the source head's own acceptance in the same run on the source;
   FAIL when it falls more than the scheme's `acceptance_drop` below it (manifests/verify_thresholds.toml).

The engine side runs on every rank of the conversion (kconvert/verify/run.py), the reference in this process."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kconvert.verify import kld

ENGINE = "the engine's float32 run of the source's own head (no reference implementation runs this head)"
MLX_VLM = "mlx-vlm's deepseek_v4_mtp drafter on the source's own head"
MLX_VLM_DSPARK = "mlx-vlm's deepseek_v4_dspark drafter on the source's own stages"


@dataclass
class DraftCheck:
    verdict: str  # PASS | FAIL | SKIPPED
    reference: str
    heads: list[dict] = field(default_factory=list)  # one row per head the drafter uses
    limits: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def draft_layers(meta: dict) -> list[int]:
    """The draft layers a converted directory holds (its units past the decoder layers)."""
    from kconvert.disk_format.units import unit_layer

    cfg = meta["config"]
    n = cfg.get("text_config", cfg)["num_hidden_layers"]
    return sorted(L for u in meta["layout"]["units"] if (L := unit_layer(u)) is not None and L >= n)


def head_name(config: dict, layer: int) -> str:
    """A head's stored prefix (`model.layers.61`, `mtp.0`), from the family manifest."""
    from engine.draft.registry import own_prefix
    from kconvert.family.manifest import bind

    return own_prefix(bind(config), layer, stored=True).rstrip(".")


@torch.inference_mode()
def engine_draft(model, prompts: list[dict], tokens: list[torch.Tensor], new_tokens: int,
                 streams: dict | None = None) -> dict[str, torch.Tensor]:
    """Every rank of a run: the drafter's head log-probs at every position of each prompt ([T-1, V]: position i
    reads the target at i and token i+1) and the acceptance of greedy speculative decoding after it (summed
    over the prompts), as tensors for the results file (the same on every rank). `streams`: filled with the
    target's residuals each prompt's head read (one process, for a reference that reads them too)."""
    from engine.draft.drafter import new_drafter
    from engine.runtime.generate import Sampling
    from engine.runtime.speculative import SpecStats, generate_speculative
    from kconvert.verify.forward import engine_inputs

    par = model.par
    drafter = new_drafter(model)
    out, total = {}, SpecStats()
    for i, (p, tk) in enumerate(zip(prompts, tokens)):
        ids, img = engine_inputs(p, tk, model, model.mc.raw)
        T = ids.shape[1]
        hidden: list = []
        model.forward(ids, image_embeds=img, last_only=True, everywhere=False, hidden=hidden)
        lp = None
        if drafter is not None:
            x = torch.cat(hidden, 1)[:, :-1]
            lp = drafter.score(x, ids[:, 1:]).float().log_softmax(-1)
            if streams is not None:
                streams[i] = x.float().cpu()
        if par.pp > 1:
            lp = par.broadcast(lp if lp is not None else torch.empty(T - 1, model.cfg.vocab_size, device=model.device),
                               par.last_rank)
        out[f"prompt.{i}.draft.logprobs"] = lp.cpu().contiguous()
        res = generate_speculative(model, ids[0].tolist(), Sampling(max_new_tokens=new_tokens), image_embeds=img)
        s = res.stats
        for j, (a, n) in enumerate(zip(s.accepted, s.proposed)):
            while len(total.proposed) <= j:
                total.proposed.append(0)
                total.accepted.append(0)
            total.proposed[j] += n
            total.accepted[j] += a
        total.steps += s.steps
        total.tokens += s.tokens
    out["draft.proposed"] = torch.tensor(total.proposed, dtype=torch.int64)
    out["draft.accepted"] = torch.tensor(total.accepted, dtype=torch.int64)
    out["draft.steps_tokens"] = torch.tensor([total.steps, total.tokens], dtype=torch.int64)
    return out


def reference_draft(src: str, prompts: list[dict], tokens: list[torch.Tensor], new_tokens: int,
                    tmp: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(what the predictions are compared with, engine_draft's tensors) of the source's own head."""
    from engine.model import Model
    from kconvert.convert.shard.job import ShardJob, shard
    from kconvert.convert.layout import Topology
    from kconvert.source.checkpoint import Checkpoint

    ck = Checkpoint.open(src)
    conv = shard(ShardJob(str(src), str(tmp / "draft-reference"), topology=Topology(tp=1))).out
    model = Model.from_converted(conv, dtype=torch.float32)
    streams: dict = {}
    got = engine_draft(model, prompts, tokens, new_tokens, streams)
    if ck.model.family.get("draft_reference") != "mlx-vlm":
        return ENGINE, got
    if ck.model.family.get("engine", {}).get("draft") == "v4_dspark":  # V4-0731's DSpark drafter: its own reference
        from kconvert.verify.mlx_dspark import V4DsparkReference

        mlx, label = V4DsparkReference(ck.root), MLX_VLM_DSPARK  # it reads the dequantized release itself
    else:
        from kconvert.verify.mlx_draft import V4MtpReference

        root = ck.root
        if ck.quantization_config:  # mlx-vlm reads plain weights: kconvert's exact dequantization of the release
            from kconvert.verify.fake_quant import write_dequantized_source

            root = write_dequantized_source(src, tmp / "draft-dequantized")
        mlx, label = V4MtpReference(root, ck.model.text.layer_count), MLX_VLM  # the first MTP block: the drafter's
    for i, x in streams.items():  # the target's residual (MTP) or its taps (DSpark) the engine's head read
        got[f"prompt.{i}.draft.logprobs"] = mlx.logprobs(x, tokens[i][None, 1:]).contiguous()
    return label, got


def check(meta: dict, prompts: list[dict], tokens: list[torch.Tensor], got: dict, ref: dict | None, label: str,
          faithful: bool, limits: dict) -> DraftCheck:
    """The draft check of the conversion's results `got` against the reference's `ref` (None: no source at hand)."""
    layer = draft_layers(meta)[0]
    name = head_name(meta["config"], layer)
    acc = _acceptance(got)
    row = {"head": name, "layer": layer, "acceptance": acc["acceptance"], "per_depth": acc["per_depth"],
           "tokens_per_step": acc["tokens_per_step"], "drafts": acc["drafts"]}
    if ref is None:
        return DraftCheck("SKIPPED", label, [row], limits)
    stats = [kld.compare(kld.RefLogprobs(tokens=tk[1:], full=ref[f"prompt.{i}.draft.logprobs"]),
                         got[f"prompt.{i}.draft.logprobs"]) for i, tk in enumerate(tokens) if len(tk) > 1]
    summary = kld.summarize(kld.concat(stats)).to_json()
    ref_acc = _acceptance(ref)
    row.update(mean_kld=summary["mean_kld"], same_top1_pct=summary["same_top1_pct"],
               reference_acceptance=ref_acc["acceptance"], reference_per_depth=ref_acc["per_depth"])
    failures = []
    kl_limit = limits["mean_kld"] if faithful else limits["mean_kld_quantized"]
    if not summary["mean_kld"] <= kl_limit:
        failures.append(f"draft head {name}: predictions' mean KLD {summary['mean_kld']:.3g} > {kl_limit} vs {label}")
    drop = ref_acc["acceptance"] - acc["acceptance"]
    if not drop <= limits["acceptance_drop"]:
        failures.append(f"draft head {name}: acceptance {100 * acc['acceptance']:.1f} % is {100 * drop:.1f} points "
                        f"below the source head's {100 * ref_acc['acceptance']:.1f} % (budget "
                        f"{100 * limits['acceptance_drop']:.0f})")
    row["verdict"] = "FAIL" if failures else "PASS"
    return DraftCheck(row["verdict"], label, [row], limits, failures)


def _acceptance(t: dict) -> dict:
    proposed, accepted = t["draft.proposed"].tolist(), t["draft.accepted"].tolist()
    steps, tokens = t["draft.steps_tokens"].tolist()
    return {"acceptance": sum(accepted) / sum(proposed) if sum(proposed) else 0.0, "drafts": sum(proposed),
            "per_depth": [a / p if p else 0.0 for a, p in zip(accepted, proposed)],
            "tokens_per_step": tokens / steps if steps else 0.0}
