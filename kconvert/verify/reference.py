"""`kconvert reference`: run the reference implementation (transformers) over a prompt set and store
next-token log-probabilities (full, or top-K + log-mass of the rest) for `kconvert verify`.

REF.safetensors holds, per prompt i: `prompt.i.tokens` [T] int64, and either `prompt.i.logprobs`
[T, V] float32 or `prompt.i.topk_ids` [T, K] int64 + `prompt.i.topk_logprobs` [T, K] +
`prompt.i.rest_logprob` [T]; with --hidden-states also `prompt.i.hidden.L` [T, H] (input of layer L,
the final-norm input last) and `prompt.i.vision` (the projector output). The JSON in the header's
`kconvert_reference` key records the prompts, the source fingerprint, family and dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.source.checkpoint import Checkpoint
from kconvert.errors import KConvertError, UsageError
from kconvert.verify.kld import RefLogprobs
from kconvert.verify.prompts import prompt_patches

FORMAT = 1


@dataclass
class PromptInputs:
    spec: dict
    input_ids: torch.Tensor  # [T] int64
    pixel_values: torch.Tensor | None = None  # [N, 3, p, p]
    grid_thw: torch.Tensor | None = None  # [images, 3]


def encode_prompts(prompts: list[dict], model_dir: Path, config: dict) -> list[PromptInputs]:
    """Tokenize (Kimi chat format where asked) and preprocess images, expanding each image's
    placeholder to its number of merged patches."""
    from kconvert.source.tokenizer import load_kimi_tokenizer

    if not (Path(model_dir) / "tiktoken.model").exists():
        raise UsageError("no tiktoken.model beside the checkpoint: a Kimi-format tokenizer is needed", file=str(model_dir))
    enc = load_kimi_tokenizer(model_dir)
    out = []
    for p in prompts:
        text = _render(p)
        ids = enc.encode(text, allowed_special="all")
        pixel_values = grid = None
        if p.get("image"):
            if "vision_config" not in config:
                raise UsageError(f"prompt {p['id']} has an image but the model has no vision tower", file=str(model_dir))
            pixel_values, (gh, gw), merge = prompt_patches(p, config)
            grid = torch.tensor([[1, gh, gw]])
            pad = config["image_token_id"]
            n = gh * gw // (merge * merge)
            if ids.count(pad) != 1:
                raise UsageError(f"prompt {p['id']} must hold exactly one image placeholder", file=str(model_dir))
            i = ids.index(pad)
            ids = ids[:i] + [pad] * n + ids[i + 1:]
        out.append(PromptInputs(p, torch.tensor(ids, dtype=torch.int64), pixel_values, grid))
    return out


def _render(p: dict) -> str:
    image = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" if p.get("image") else ""
    if p.get("chat"):
        turns = "".join(f"<|im_{m['role']}|>{m['role']}<|im_middle|>{m['content']}<|im_end|>" for m in p["chat"])
        return turns + "<|im_assistant|>assistant<|im_middle|>"
    if p["kind"] == "image":
        return f"<|im_user|>user<|im_middle|>{image}{p['text']}<|im_end|><|im_assistant|>assistant<|im_middle|>"
    return p["text"]


def reference_model(ck: Checkpoint, dtype: torch.dtype):
    """The transformers class the family manifest names, loaded from the source checkpoint."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    name = ck.model.family.get("reference_class")
    if not name or not hasattr(transformers, name):
        raise UsageError(f"family {ck.family} names no transformers reference class", file=str(ck.root))
    model = getattr(transformers, name).from_pretrained(str(ck.root), dtype=dtype)
    return model.eval()


@torch.inference_mode()
def run_reference(src: str, out: str | Path, prompts: list[dict], *, dtype: str = "float32", top_k: int | None = None,
                  hidden_states: bool = False, progress=None) -> dict:
    ck = Checkpoint.open(src)
    ck.validate()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise UsageError(f"unknown --dtype {dtype!r} (float32 or bfloat16)")
    inputs = encode_prompts(prompts, ck.root, ck.config)
    model = reference_model(ck, torch_dtype)
    tensors: dict[str, torch.Tensor] = {}
    for i, pi in enumerate(inputs):
        kwargs = {}
        if pi.pixel_values is not None:
            kwargs = {"pixel_values": pi.pixel_values.to(torch_dtype), "image_grid_thw": pi.grid_thw}
        res = model(input_ids=pi.input_ids[None], output_hidden_states=hidden_states, **kwargs)
        logprobs = res.logits[0].float().log_softmax(-1)
        tensors[f"prompt.{i}.tokens"] = pi.input_ids
        if top_k:
            vals, ids = logprobs.topk(top_k, dim=-1)
            tensors[f"prompt.{i}.topk_ids"] = ids
            tensors[f"prompt.{i}.topk_logprobs"] = vals.contiguous()
            tensors[f"prompt.{i}.rest_logprob"] = torch.log1p(-vals.double().exp().sum(-1).clamp(max=1 - 1e-12)).float()
        else:
            tensors[f"prompt.{i}.logprobs"] = logprobs.contiguous()
        if hidden_states:
            for L, h in enumerate(res.hidden_states):
                tensors[f"prompt.{i}.hidden.{L}"] = h[0].float().contiguous()
            if pi.pixel_values is not None:
                feats = model.model.get_image_features(kwargs["pixel_values"], pi.grid_thw, return_dict=True)
                tensors[f"prompt.{i}.vision"] = torch.cat(feats.pooler_output).float().contiguous()
        if progress:
            progress("advance", n=1)
    meta = {"format": FORMAT, "source": str(src), "source_fingerprint": ck.fingerprint(), "family": ck.family,
            "dtype": dtype, "top_k": top_k, "hidden_states": hidden_states, "prompts": [p.spec for p in inputs]}
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"kconvert_reference": json.dumps(meta)})
    tmp.replace(out)
    return meta


def load_reference(path: str | Path) -> tuple[dict, list[RefLogprobs], dict[str, torch.Tensor]]:
    """(meta, per-prompt reference log-probs, all tensors) from REF.safetensors."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("kconvert_reference")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise KConvertError(f"cannot read the reference file: {e}", file=str(path)) from None
    if not raw:
        raise KConvertError("not a kconvert reference file (no kconvert_reference metadata)", file=str(path))
    meta = json.loads(raw)
    refs = []
    for i in range(len(meta["prompts"])):
        g = lambda k: tensors.get(f"prompt.{i}.{k}")  # noqa: E731
        refs.append(RefLogprobs(tokens=g("tokens"), full=g("logprobs"), topk_ids=g("topk_ids"),
                                topk_logprobs=g("topk_logprobs"), rest_logprob=g("rest_logprob")))
    return meta, refs, tensors
