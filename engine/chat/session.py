"""Chat with a converted checkpoint.

    python -m engine.chat OUT                                   interactive: /image PATH, /clear, /exit
    python -m engine.chat OUT --prompt "Describe it" --image cat.png --max-new-tokens 64
    python -m engine.chat OUT --device cuda                     one GPU per rank (nccl; mccl on musa)
    torchrun --nproc-per-node 2 -m engine.chat OUT              also works (torchrun starts the ranks)
    torchrun --nnodes 2 --node-rank I --master-addr HOST --master-port 29500 --nproc-per-node 8 \\
        -m engine.chat OUT --device cuda                        tp 8 x pp 2 across two machines (docs/COMMANDS.md "Multi-node")

A checkpoint converted with --tp T --pp P runs as T x P processes (stage by stage: global rank = stage x T
+ tp rank): this command starts them itself (one per rank on cpu, one per device on cuda/musa); this
process is rank 0 and owns the terminal, the others follow its input. --nproc may only repeat the count.
Ctrl-C or an error in any rank ends every rank with one line.
Tokens stream as they are generated; after each answer: time to first token and decode tokens/s.
--speculative decodes greedily with the conversion's draft heads (engine/runtime/speculative.py): the same
tokens, and after each answer the drafts' acceptance rate and the tokens per target step.
The KV cache grows with the conversation in pages of 64 tokens, up to --context tokens (default: the
model's maximum) and --kv-budget bytes; --kv-dtype fp8 stores it in about 0.65 of bf16's bytes (fp8-ds:
0.56); --kv-device-budget keeps older pages in host memory (docs/KV_CACHE.md).
Exit codes: 0 done, 2 bad input (one line naming the file), 3 internal error, 130 interrupted."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from engine.runtime import launch
from engine.chat.from_source import converted_dir
from engine.runtime.generate import Sampling, generate
from engine.runtime.speculative import generate_speculative
from engine.draft.drafter import new_drafter
from engine.chat.args import DTYPES, parse_args
from engine.inputs.image import load_image, preprocess_for
from engine.cache.budget import kv_options
from engine.model import Model
from engine.chat.stream import TextStream
from engine.inputs.tokenizer import Tokenizer
from kconvert.distributed import Group
from kconvert.errors import EngineError, KConvertError, UsageError
from kconvert.exit_codes import run_reporting_errors

COMMANDS = ("/image", "/clear", "/exit", "/quit")  # what the interactive chat takes; any other "/..." is refused

class Session:
    def __init__(self, model: Model, tok: Tokenizer, sampling: Sampling, system: str | None, context: int,
                 complete: bool = False, speculative: bool = False, draft_tokens: int | None = None):
        self.model, self.tok, self.sampling, self.system = model, tok, sampling, system
        self.complete = complete  # a base model: continue the text as is, no chat template
        self.speculative, self.draft_tokens = speculative, draft_tokens
        # the drafter follows the cache over the conversation (last stage; None elsewhere)
        self.drafter = new_drafter(model, draft_tokens) if speculative else None
        self.cache = model.new_cache(1, context, reserve=0)  # grows with the conversation, up to `context`
        self.clear()

    def clear(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.images: list[tuple[torch.Tensor, tuple[int, int]]] = []  # every image of the conversation
        self.cached: list[int] = []  # tokens whose latent is in the cache
        self.cache.reset()

    def turn(self, text: str, image_path: str | None, out) -> None:
        content = text
        new_images = []
        if image_path:
            if not self.model.has_vision:
                raise UsageError("this checkpoint has no vision tower: images are not available")
            new_images.append(_on_rank0(self.model.par, lambda: preprocess_for(self.model.mc.vision, image_path)))
            content = [{"type": "image"}, {"type": "text", "text": text}]
        messages = self.messages + [{"role": "user", "content": content}]
        images = self.images + new_images
        counts = [self.model.tokens_per_image(g) for _, g in images]
        prompt = self.tok.encode(text) if self.complete else self.tok.chat_ids(messages, counts)
        if not prompt:
            raise UsageError("--prompt is empty")
        if len(prompt) + 1 > self.cache.max_len:
            raise UsageError(f"prompt of {len(prompt)} tokens does not fit the context of {self.cache.max_len} "
                             f"tokens (/clear starts over; --context raises the limit)")
        start = len(self.cached) if prompt[:len(self.cached)] == self.cached else 0
        if start == 0:
            self.cache.reset()
        start = min(start, len(prompt) - 1)
        self.cache.length = start
        embeds = self._image_embeds(prompt, start, images, counts)
        text = TextStream()  # holds a character's bytes until its last token arrives
        if self.complete and out:  # a continuation reads as the prompt followed by what the model adds
            out.write(content)

        def show(t):
            if t not in self.sampling.stop_ids:
                out.write(text.feed(self.tok.decode_bytes([t])))
                out.flush()

        if self.speculative:
            res = generate_speculative(self.model, prompt, self.sampling, self.cache, embeds, show if out else None,
                                       start=start, drafter=self.drafter, k=self.draft_tokens)
        else:
            res = generate(self.model, prompt, self.sampling, self.cache, embeds, show if out else None, start=start)
        answer = self.tok.decode([t for t in res.tokens if t not in self.sampling.stop_ids])
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.images = images
        self.cached = prompt + res.tokens[:-1]
        if out:
            out.write(text.close())
            spec = ""
            if self.speculative:
                s = res.stats
                spec = (f" · acceptance {100 * s.acceptance:.1f} % ({sum(s.accepted)}/{sum(s.proposed)} drafts) · "
                        f"{s.tokens_per_step:.2f} tokens/target step")
            out.write(f"\n[TTFT {res.ttft_s * 1000:.0f} ms · {len(res.tokens)} tokens · "
                      f"{res.tokens_per_s:.1f} tokens/s · {res.stop_reason}{spec}]\n")
            out.flush()

    def _image_embeds(self, prompt, start, images, counts):
        """Vision features of the images whose placeholders are still to be prefilled (prompt[start:])."""
        pad = self.tok.media_pad
        before = sum(1 for t in prompt[:start] if t == pad)
        todo, seen = [], 0
        for (patches, grid), n in zip(images, counts):
            if seen >= before:
                todo.append((patches, grid))
            seen += n
        if not todo or self.model.vision is None:  # the tower is on the first stage: only it needs features
            return None
        if before and before not in {sum(counts[:i]) for i in range(len(counts) + 1)}:
            raise EngineError("cache boundary inside an image")
        pix = torch.cat([p for p, _ in todo]).to(self.model.device, self.model.dtype)
        return self.model.vision(pix, [g for _, g in todo])


def _on_rank0(par: Group, load):
    """The image as rank 0 reads it (large images are shrunk, never rejected), given to every rank: under
    torchrun across nodes the file may exist on rank 0's machine only. An error is raised on every rank."""
    res = None
    if par.rank == 0:
        try:
            res = load()
        except KConvertError as e:
            res = e
    res = par.broadcast_object(res, src=0)
    if isinstance(res, KConvertError):
        raise res
    return res


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = world = None

    def size_the_world(stack) -> int:  # every argument and the world are checked before a rank starts
        nonlocal a, world
        from kconvert.load.loader import open_converted

        a = parse_args(argv, __doc__)
        a.path = stack.enter_context(converted_dir(a.path, lambda line: print(line, file=sys.stderr), a.nproc))
        world = launch.world_for(open_converted(a.path), a.nproc, a.device)
        return 0

    from kconvert.io.workdir import terminate_as_interrupt

    # SIGTERM as Ctrl-C in the process the user started: the stack's exits run (a source's temporary conversion
    # is removed, the ranks it started are stopped). A rank it started, or one under torchrun, keeps the default:
    # it must end at once with its parent or launcher, not when a collective it is blocked in returns.
    ours = not (launch.under_launcher() or os.environ.get(launch.PARENT_ENV))
    with terminate_as_interrupt() if ours else contextlib.nullcontext(), contextlib.ExitStack() as stack:
        code = run_reporting_errors(lambda: size_the_world(stack), launch.say_once)
        if code:
            return code
        return launch.run(world, [sys.executable, "-m", "engine.chat", *argv], lambda: _guarded(a), a.device)


def _guarded(a) -> int:
    """One rank's run; every way it can end is one line and an exit code. A collective fails when another
    rank died: that rank's error is the one to show (launch.peer_failure)."""
    return run_reporting_errors(lambda: _run(a), launch.say_once, on_internal=lambda e: launch.peer_failure())


def _context(requested: int | None, model: Model) -> int:
    limit = model.cfg.max_position_embeddings
    if requested is None:
        return limit
    if not 1 <= requested <= limit:
        raise UsageError(f"--context {requested}: the model takes 1 to {limit} tokens")
    return requested


def _run(a) -> int:
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {a.max_new_tokens}")
    device = launch.rank_device(a.device)
    par = Group.from_env(device)
    kv = kv_options(a.kv_dtype, a.kv_budget, a.kv_device_budget, device)  # bad input fails before loading
    model = Model.from_converted(a.path, device=device, dtype=DTYPES[a.dtype], par=par)
    model.kv = kv
    tok = Tokenizer(a.path, model.cfg.image_token_id)
    sampling = Sampling(a.temperature, a.top_p, a.top_k, a.max_new_tokens, tok.stop_ids, a.seed)
    if a.complete and (a.prompt is None or a.image):
        raise UsageError("--complete continues one --prompt of plain text (no image, not interactive)")
    session = Session(model, tok, sampling, a.system, _context(a.context, model), a.complete, a.speculative,
                      a.draft_tokens)
    out = launch.tracked_stdout() if par.rank == 0 else None
    if a.prompt is not None:
        session.turn(a.prompt, a.image, out)
    else:
        _interactive(session, model, par, out)
    par.close()
    return 0


def _interactive(session: Session, model: Model, par: Group, out) -> None:
    err = sys.stderr
    if out:
        print(f"{model.mc.family} · tp {model.par.tp} x pp {model.par.pp} · {model.device} · /image PATH, /clear, /exit", file=out)
    pending_image = None
    while True:
        line = None
        if par.rank == 0:
            out.mid_line = True  # the "> " prompt holds the cursor until the user ends the line
            try:
                line = input("> ")
            except EOFError:
                line = "/exit"
            out.mid_line = False
        line = par.broadcast_object(line).strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/clear":
            session.clear()
            pending_image = None
            if out:
                print("[conversation cleared: the next turn starts afresh]", file=out)
            continue
        if line.startswith("/") and line.split()[0] not in COMMANDS:
            if out:
                print(f"error: unknown command {line.split()[0]} ({', '.join(COMMANDS[:3])})", file=err)
            continue
        if line.startswith("/image"):
            path = line[len("/image"):].strip()
            try:
                if not model.has_vision:
                    raise UsageError("this checkpoint has no vision tower")
                _on_rank0(par, lambda: load_image(path).size)
                pending_image = path
                if out:
                    print(f"[image {path} attached to the next turn]", file=out)
            except KConvertError as e:
                if out:
                    print(f"error: {e.one_line()}", file=err)
            continue
        try:
            session.turn(line, pending_image, out)
        except KConvertError as e:  # a bad turn (image, template, context) ends the turn, not the chat
            if out:
                print(f"error: {e.one_line()}", file=err)
        pending_image = None


if __name__ == "__main__":
    sys.exit(main())
