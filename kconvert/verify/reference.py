"""`kconvert reference`: run the reference implementation (transformers) over a prompt set and store
next-token log-probabilities (full, or top-K + log-mass of the rest) for `kconvert verify`.

REF.safetensors holds, per prompt i: `prompt.i.tokens` [T] int64, and either `prompt.i.logprobs`
[T, V] float32 or `prompt.i.topk_ids` [T, K] int64 + `prompt.i.topk_logprobs` [T, K] +
`prompt.i.rest_logprob` [T]; with --hidden-states also `prompt.i.hidden.L` [T, H] (input of layer L,
the final-norm input last) and `prompt.i.vision` (the projector output). The JSON in the header's
`kconvert_reference` key records the prompts, the source fingerprint, family, dtype, the indexer tie
rule and, for a faithfulness reference (`--like OUT`), the fake-quantization it ran with (`fake_quant`).
Written atomically; non-finite log-probs are refused (NonFiniteError), never stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from torch.overrides import TorchFunctionMode

from kconvert.errors import KConvertError, NonFiniteError, UsageError
from kconvert.io.atomic import write_atomic
from kconvert.io.workdir import compiler_caches, work_dir
from kconvert.io.side_files import check_regular, parse_json
from kconvert.source.checkpoint import Checkpoint
from kconvert.verify.kld import RefLogprobs, topk_reference
from kconvert.verify.prompts import MAX_PROMPT_TOKENS, check_lengths, prompt_patches

FORMAT = 1


@dataclass
class PromptInputs:
    spec: dict
    input_ids: torch.Tensor  # [T] int64
    pixel_values: torch.Tensor | None = None  # [N, 3, p, p]
    grid_thw: torch.Tensor | None = None  # [images, 3]


def encode_prompts(prompts: list[dict], model_dir: Path, config: dict, image_token_id: int | None = None) -> list[PromptInputs]:
    """Tokenize and preprocess images, expanding each image's placeholder (`image_token_id`, default config.json's)
    to the text positions its vision kind gives it. Chat and image prompts take Kimi's turn format with Kimi's
    tokenizer, the checkpoint's own chat template with a tokenizer.json (DeepSeek's releases)."""
    from engine.inputs.tokenizer import Tokenizer

    pad = config.get("image_token_id") if image_token_id is None else image_token_id
    tok = Tokenizer(model_dir, pad)  # tiktoken.model or tokenizer.json, read once; none: one line naming the directory
    enc = tok.enc
    out = []
    for p in prompts:
        text = _render(p) if tok.kimi else _templated(tok, p)
        ids = enc.encode(text, allowed_special="all")
        pixel_values = grid = None
        if p.get("image"):
            if "vision_config" not in config:
                raise UsageError(f"prompt {p['id']} has an image but the model has no vision tower", file=str(model_dir))
            pixel_values, (gh, gw), n = prompt_patches(p, config)
            grid = torch.tensor([[1, gh, gw]])
            if ids.count(pad) != 1:
                raise UsageError(f"prompt {p['id']} must hold exactly one image placeholder", file=str(model_dir))
            i = ids.index(pad)
            ids = ids[:i] + [pad] * n + ids[i + 1:]
        out.append(PromptInputs(p, torch.tensor(ids, dtype=torch.int64), pixel_values, grid))
    return out


def _templated(tok, p: dict) -> str:
    """A prompt's text through the checkpoint's chat template (engine/inputs/tokenizer.py renders it, sandboxed, an image
    as its token's text)."""
    if p.get("chat"):
        return tok.render([{"role": m["role"], "content": m["content"]} for m in p["chat"]])
    if p["kind"] == "image":
        image = [{"type": "image"}] if p.get("image") else []
        return tok.render([{"role": "user", "content": [*image, {"type": "text", "text": p["text"]}]}])
    return p["text"]


def _render(p: dict) -> str:
    image = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" if p.get("image") else ""
    if p.get("chat"):
        turns = "".join(f"<|im_{m['role']}|>{m['role']}<|im_middle|>{m['content']}<|im_end|>" for m in p["chat"])
        return turns + "<|im_assistant|>assistant<|im_middle|>"
    if p["kind"] == "image":
        return f"<|im_user|>user<|im_middle|>{image}{p['text']}<|im_end|><|im_assistant|>assistant<|im_middle|>"
    return p["text"]


class EarliestTies(TorchFunctionMode):
    """torch.topk with the documented tie rule: among equal scores the earliest positions win (what the
    engine's DSA indexer does). transformers' indexer leaves ties to torch.topk, which breaks them
    arbitrarily; ReLU index scores tie at exactly 0 often when a model has few indexer heads."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            x, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if not kwargs.get("largest", True):
                return func(*args, **kwargs)
            order = torch.sort(x, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
            return torch.return_types.topk((x.gather(dim, order), order))
        return func(*args, **kwargs)


def _with_tie_rule(module: torch.nn.Module) -> None:
    forward = module.forward

    def tie_ruled(*args, **kwargs):
        with EarliestTies():
            return forward(*args, **kwargs)

    module.forward = tie_ruled


def reference_model(ck: Checkpoint, dtype: torch.dtype):
    """The transformers class the family manifest names, loaded from the source checkpoint, its DSA
    indexers (if any) selecting with the documented tie rule; or, for a family no transformers release runs
    (`reference_backend = "mlx"`: Kimi K3), mlx-lm's model (verify/mlx_reference.py)."""
    if ck.model.family.get("reference_backend") == "mlx":
        from kconvert.verify import mlx_reference

        return getattr(mlx_reference, ck.model.family.get("reference_class", "MlxReference"))(ck.root, dtype)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    name = ck.model.family.get("reference_class")
    if not name or not hasattr(transformers, name):
        raise UsageError(f"family {ck.family} names no transformers reference class", file=str(ck.root))
    model = getattr(transformers, name).from_pretrained(str(ck.root), dtype=dtype)
    for m in model.modules():
        if type(m).__name__.endswith("Indexer"):
            _with_tie_rule(m)
    return model.eval()


def run_reference(src: str, out: str | Path, prompts: list[dict], *, dtype: str = "float32", top_k: int | None = None,
                  hidden_states: bool = False, like: str | None = None, like_export: str | None = None,
                  progress=None, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> dict:
    """Reference log-probs of SRC over `prompts` into `out`. With `like` (a converted directory): of SRC
    with every weight that conversion quantized fake-quantized the same way (verify/fake_quant.py),
    the reference for the faithfulness check. With `like_export` too (`like` is then the temporary
    conversion of that export): SRC fake-quantized by the export's rule and stored scales first. The compilers' caches
    (MLX's kernels, torch inductor's) live in a work directory of its own, removed with it."""
    with work_dir("reference") as tmp, compiler_caches(tmp):
        return _reference(src, out, prompts, dtype, top_k, hidden_states, like, like_export, progress, max_prompt_tokens)


def _reference(src, out, prompts, dtype, top_k, hidden_states, like, like_export, progress, max_prompt_tokens) -> dict:
    ck = Checkpoint.open(src)
    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"unknown --dtype {dtype!r} (float32 or bfloat16)")
    check_lengths(encode_prompts(prompts, ck.root, ck.config, _image_token(ck)), max_prompt_tokens)  # before any model
    ck.validate()
    meta = {"format": FORMAT, "source": str(src), "source_fingerprint": ck.fingerprint(), "family": ck.family,
            "dtype": dtype, "top_k": top_k, "hidden_states": hidden_states, "tie_rule": "earliest", "fake_quant": None}
    # transformers and mlx-lm read no NVFP4: a source storing it runs on kconvert's dequantization, as V4's releases
    nvfp4 = any(b.sample.format == "nvfp4_packed" for b in ck.grouped.buckets)
    if like is None and (nvfp4 or ck.model.family.get("reference_from_dequantized") and ck.quantization_config):
        from kconvert.verify.fake_quant import write_dequantized_source

        with work_dir("reference-dq") as tmp:  # kconvert's exact dequantization
            tensors, specs = _run(Checkpoint.open(write_dequantized_source(src, Path(tmp))), prompts, dtype, top_k,
                                  hidden_states, progress)
    elif like is None:
        tensors, specs = _run(ck, prompts, dtype, top_k, hidden_states, progress)
    else:
        from kconvert.disk_format.catalog import Catalog
        from kconvert.verify.exported import describe
        from kconvert.verify.fake_quant import plan_digest, write_export_fake_quant_source, write_fake_quant_source

        conv = Catalog.read(like).whole_doc()
        made_from = describe(like_export).made_from if like_export else conv["source"]["fingerprint"]
        if made_from is not None and made_from != meta["source_fingerprint"]:  # None: an export kconvert did not make
            raise UsageError(f"{like_export or like} was made from another source", file=str(src))
        q = conv["quantization"]
        meta["fake_quant"] = {"scheme": describe(like_export).format if like_export else q["scheme"],
                              "scale_format": q.get("scale_format"), "group_size": q.get("group_size"),
                              "int4_scales": q.get("int4_scales"), "tp": conv["layout"]["tp"],
                              "plan_digest": plan_digest(conv, of_export=bool(like_export))}
        with work_dir("reference-fq") as tmp:
            written = (write_export_fake_quant_source(src, like_export, conv, Path(tmp)) if like_export
                       else write_fake_quant_source(src, conv, Path(tmp), like))
            fq = Checkpoint.open(written)
            tensors, specs = _run(fq, prompts, dtype, top_k, hidden_states, progress)
    meta["prompts"] = specs
    from safetensors.torch import save

    write_atomic(Path(out), save(tensors, metadata={"kconvert_reference": json.dumps(meta)}))
    return meta


@torch.inference_mode()
def _run(ck: Checkpoint, prompts: list[dict], dtype: str, top_k: int | None, hidden_states: bool, progress):
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    inputs = encode_prompts(prompts, ck.root, ck.config, _image_token(ck))
    model = reference_model(ck, torch_dtype)
    tensors: dict[str, torch.Tensor] = {}
    for i, pi in enumerate(inputs):
        kwargs = {}
        if pi.pixel_values is not None:
            kwargs = {"pixel_values": pi.pixel_values.to(torch_dtype), "image_grid_thw": pi.grid_thw}
            if hasattr(model, "image_features"):  # the MLX reference scatters the features itself
                kwargs["image_token_id"] = _image_token(ck)
        res = model(input_ids=pi.input_ids[None], output_hidden_states=hidden_states, **kwargs)
        logprobs = res.logits[0].float().log_softmax(-1)
        if not bool(torch.isfinite(logprobs).all()):
            raise NonFiniteError(f"the reference produced non-finite log-probs for prompt {pi.spec.get('id', i)}: "
                                 "refusing to write them", file=str(ck.root))
        tensors[f"prompt.{i}.tokens"] = pi.input_ids
        if top_k:
            r = topk_reference(pi.input_ids, logprobs, top_k)
            tensors.update({f"prompt.{i}.topk_ids": r.topk_ids, f"prompt.{i}.topk_logprobs": r.topk_logprobs.contiguous(),
                            f"prompt.{i}.rest_logprob": r.rest_logprob})
        else:
            tensors[f"prompt.{i}.logprobs"] = logprobs.contiguous()
        if hidden_states:
            for L, h in enumerate(res.hidden_states):
                tensors[f"prompt.{i}.hidden.{L}"] = h[0].float().contiguous()
            if pi.pixel_values is not None and hasattr(model, "image_features"):  # the MLX reference
                tensors[f"prompt.{i}.vision"] = model.image_features(kwargs["pixel_values"], pi.grid_thw).contiguous()
            elif pi.pixel_values is not None:
                feats = model.model.get_image_features(kwargs["pixel_values"], pi.grid_thw, return_dict=True)
                tensors[f"prompt.{i}.vision"] = torch.cat(feats.pooler_output).float().contiguous()
        if progress:
            progress("advance", n=1)
    return tensors, [p.spec for p in inputs]


def _image_token(ck: Checkpoint) -> int | None:
    """The image placeholder id under the config key the family names (Kimi K3: media_placeholder_token_id)."""
    from engine.config import image_token_id

    engine = ck.model.family.get("engine", {})
    return image_token_id(ck.config, engine) if engine.get("image_token_keys") else None


def load_reference(path: str | Path) -> tuple[dict, list[RefLogprobs], dict[str, torch.Tensor]]:
    """(meta, per-prompt reference log-probs, all tensors) from REF.safetensors."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    check_regular(path, error=KConvertError)  # a FIFO would block safe_open forever
    try:
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("kconvert_reference")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise KConvertError(f"cannot read the reference file: {e}", file=str(path)) from None
    if not raw:
        raise KConvertError("not a kconvert reference file (no kconvert_reference metadata)", file=str(path))
    meta = parse_json(raw, file=str(path), error=KConvertError)
    refs = []
    for i in range(len(meta["prompts"])):
        g = lambda k: tensors.get(f"prompt.{i}.{k}")  # noqa: E731
        refs.append(RefLogprobs(tokens=g("tokens"), full=g("logprobs"), topk_ids=g("topk_ids"),
                                topk_logprobs=g("topk_logprobs"), rest_logprob=g("rest_logprob")))
    return meta, refs, tensors
