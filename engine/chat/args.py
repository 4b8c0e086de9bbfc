"""`python -m engine.chat`'s arguments, parsed and checked before anything is loaded or any rank started.

Numbers are read as text and checked by kconvert/arguments.py (ASCII digits, finite floats in range), the
device by kconvert/devices.py; argparse's own errors become one UsageError line (exit 2) instead of its
usage block."""

from __future__ import annotations

import argparse

import torch

from kconvert import arguments as arg
from kconvert.errors import UsageError
from kconvert.kv_rows import KV_DTYPES

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
MAX_SEED = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print its usage block and exit
        raise UsageError(f"{message} (python -m engine.chat --help)")


def _known_devices() -> tuple[str, ...]:
    from kconvert.devices import KNOWN

    return KNOWN


def parse_args(argv: list[str], description: str | None = None) -> argparse.Namespace:
    ap = _Parser(prog="python -m engine.chat", description=description,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="converted checkpoint directory (kconvert shard OUT); a source checkpoint or an "
                    "export is converted first into a temporary tp 1 directory (the cost is shown)")
    ap.add_argument("--prompt", help="one non-interactive turn")
    ap.add_argument("--image", help="image for the --prompt turn")
    ap.add_argument("--system", default=None)
    ap.add_argument("--complete", action="store_true",
                    help="continue --prompt as plain text, without the chat template (base models such as the "
                         "trained fixtures: --prompt 'def main(' --complete)")
    ap.add_argument("--max-new-tokens", default="256")
    ap.add_argument("--speculative", action="store_true",
                    help="greedy speculative decoding with the conversion's draft heads (MTP): the same tokens as "
                         "plain greedy decoding, several per target step when the drafts agree; prints the "
                         "acceptance rate and tokens per target step")
    ap.add_argument("--draft-tokens", default=None,
                    help="drafts per step with --speculative (default: the number of draft heads; more re-use "
                         "the first head chained)")
    ap.add_argument("--temperature", default="0", help="0 (greedy) to 100")
    ap.add_argument("--top-p", default="1", help="above 0, at most 1")
    ap.add_argument("--top-k", default="0", help="0 (all tokens) or a count")
    ap.add_argument("--seed", default=None, help=f"0 to {MAX_SEED}")
    ap.add_argument("--context", default=None,
                    help="most tokens a conversation may hold (default: the model's maximum); the cache is "
                         "allocated as the conversation grows, never for the whole limit up front")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                    help="KV cache format (default: the compute dtype); fp8: e4m3 latent + per-128 scales, "
                         "indexer keys bf16; fp8-ds: fp8 keys too (DeepSeek-V3.2's layout, fewer bytes)")
    ap.add_argument("--kv-budget", default=None,
                    help="most bytes the KV cache may take (8GiB, 512M) or a fraction of free memory (0.9)")
    ap.add_argument("--kv-device-budget", default=None,
                    help="bytes of KV latent kept on the device; older pages go to host memory")
    ap.add_argument("--device", default="cpu", help="cpu or " + ", ".join(_known_devices())
                    + " (each rank takes device LOCAL_RANK)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--nproc", default=None,
                    help="processes to start when not under torchrun (default, and the only count that works: "
                         "the conversion's tp x pp)")
    a = ap.parse_args(argv)
    a.max_new_tokens = arg.integer(a.max_new_tokens, "--max-new-tokens", 1, 10**9)
    a.temperature = arg.number(a.temperature, "--temperature", 0.0, 100.0)
    a.top_p = arg.number(a.top_p, "--top-p", 0.0, 1.0, lo_open=True)
    a.top_k = arg.integer(a.top_k, "--top-k", 0, 10**9)
    a.seed = None if a.seed is None else arg.integer(a.seed, "--seed", 0, MAX_SEED)
    a.context = None if a.context is None else arg.integer(a.context, "--context", 1)
    a.nproc = None if a.nproc is None else arg.integer(a.nproc, "--nproc", 1)
    a.draft_tokens = None if a.draft_tokens is None else arg.integer(a.draft_tokens, "--draft-tokens", 1, 64)
    if a.draft_tokens is not None and not a.speculative:
        raise UsageError("--draft-tokens needs --speculative")
    if a.speculative and a.temperature > 0:
        raise UsageError("--speculative decodes greedily: it takes --temperature 0")
    from kconvert import devices

    devices.resolve(a.device)  # a device this machine does not have: one line now, not a crash in a rank
    return a
