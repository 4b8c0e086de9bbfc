"""The engine side of `kconvert verify`: run every prompt through the converted model on this rank
and (with per_layer) each layer's hidden states, then attribute the first layer's error to tensors.

Runs once per rank of the conversion's tp x pp layout: in-process when the world is 1 or under torchrun,
else in processes `run_all_ranks` spawns (gloo on cpu). Rank 0 (the first stage) writes the results to
a safetensors file; the last stage's logits and the other stages' hidden states are sent to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kconvert.distributed import StoppedWatch
from kconvert.verify.forward import engine_inputs, hidden_states


def run_rank(out_dir: str, prompts: list[dict], tokens: list[torch.Tensor], result_path: str,
             per_layer: dict | None = None, device: str = "cpu", kv: tuple | None = None, progress=None,
             draft: dict | None = None) -> None:
    """Forward every prompt on this rank; rank 0 saves `prompt.i.logprobs` (+ hidden states with
    per_layer), or, when per_layer names an `attribute_layer`, only that layer's tensor ranking.
    kv: the command line's (--kv-dtype, --kv-budget, --kv-device-budget) texts, read on each rank (a fraction
    is of that rank's free memory); the KV cache every model.new_cache takes, so the KLD includes what KV
    quantization and the host tier add (default: the compute dtype, unbounded). draft: the draft check's options
    (verify/draft.py: its head predictions and speculative acceptance join the results)."""
    from engine.cache.latent import KVOptions
    from engine.cache.budget import kv_options
    from engine.model import Model
    from kconvert.distributed import Group

    par = Group.from_env(device)
    model = Model.from_converted(out_dir, device=device, dtype=torch.float32, par=par)
    par = model.par  # laid out as the conversion's tp x pp
    model.kv = kv_options(*kv, device) if kv else KVOptions()
    if per_layer is not None and per_layer.get("attribute_layer") is not None:
        from kconvert.verify.attribution import attribute

        ranking = attribute(model, out_dir, par.rank, prompts, tokens, per_layer)
        owner = par.rank_of(model.stage_of_layer(per_layer["attribute_layer"]), 0)
        ranking = par.broadcast_object(ranking, src=owner)  # the layer's stage ranked it; rank 0 writes
        if par.rank == 0:
            Path(result_path + ".attribution.json").write_text(json.dumps(ranking))
        return
    result: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for i, (p, tk) in enumerate(zip(prompts, tokens)):
            ids, img = engine_inputs(p, tk, model, model.mc.raw)
            if per_layer is None:
                logits = model.forward(ids, image_embeds=img)  # every rank gets the last stage's logits
            else:
                states, logits = hidden_states(model, ids, img)
                for L, h in enumerate(states or []):
                    result[f"prompt.{i}.hidden.{L}"] = h.contiguous()
                if img is not None:
                    result[f"prompt.{i}.vision"] = img.float().contiguous()
            if par.rank == 0:
                result[f"prompt.{i}.logprobs"] = logits[0].float().log_softmax(-1).contiguous()
            if progress:  # this process's ranks only (spawned ranks: counted when they finish)
                progress("advance", n=1)
        if draft is not None:
            from kconvert.verify.draft import engine_draft

            result.update(engine_draft(model, prompts, tokens, draft["new_tokens"]))
    if par.rank == 0:
        from safetensors.torch import save_file

        try:
            save_file({k: v.cpu() for k, v in result.items()}, result_path)  # engine may run on a device
        except Exception as e:  # SafetensorError / OSError: a full disk, a file-size limit
            from kconvert.errors import WriteError

            raise WriteError(f"cannot write verify's results ({e}); free space under {Path(result_path).parents[1]} "
                             "or set TMPDIR") from None


def spawn_main(rank: int, world: int, port: int, args: tuple, parent: int | None = None, draft: dict | None = None) -> None:
    """Entry point of a spawned rank (torch.multiprocessing). It ends when `parent` (the verify process)
    does, however that ends: a forkserver's children are not the verify process's, so nothing else would."""
    if parent is not None:
        _die_with(parent)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    run_rank(*args, draft=draft)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all_ranks(out_dir: str, world: int, prompts, tokens, result_path: str, per_layer=None, device="cpu",
                  kv: tuple | None = None, progress=None, draft: dict | None = None) -> None:
    """Run the converted model's `world` (tp x pp) ranks (spawned unless already under torchrun) to result_path;
    `progress("advance", n=1)` per prompt."""
    args = (out_dir, prompts, tokens, result_path, per_layer, device, kv)
    if world == 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        run_rank(*args, progress=progress, draft=draft)
        return
    import torch.multiprocessing as mp

    ctx = mp.start_processes(spawn_main, args=(world, free_port(), args, os.getpid(), draft), nprocs=world, join=False,
                             start_method=_start_method())
    stopped = StoppedWatch()
    try:
        while not ctx.join(timeout=1):
            r = stopped.frozen({r: p.pid for r, p in enumerate(ctx.processes) if p.is_alive()})
            if r is not None:
                from kconvert.errors import EngineError

                raise EngineError(f"verify's rank {r} is frozen (stopped by a signal for {stopped.limit_s:.0f} s: "
                                  "SIGSTOP or a debugger): every rank is stopped")
    except BaseException:  # Ctrl-C, SIGTERM (cli: terminate_as_interrupt) or a failed rank: stop every rank now
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)
        raise
    if progress:
        progress("advance", n=len(prompts))


def _die_with(parent: int) -> None:
    """A watchdog thread: exit at once when `parent` no longer exists (a pidfd on Linux, else polling)."""
    import threading

    def watch():
        try:
            fd = os.pidfd_open(parent)
            import select

            select.select([fd], [], [])  # readable when the process ends
        except (AttributeError, OSError):
            while True:
                try:
                    os.kill(parent, 0)
                except ProcessLookupError:
                    break
                threading.Event().wait(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def _start_method() -> str:
    """"forkserver" where there is one: a fresh server process imports torch and the engine once and forks
    every rank from it (no import per rank; safe with CUDA, which the server never touches); else "spawn"."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "engine.model", __name__])
    return "forkserver"


def load_result(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
