"""The side files the engine reads at run time, checked when a conversion starts (shard and export, before any work)
as the engine reads them, so a conversion never finishes around a tokenizer, chat template or Engram token map that
chat then refuses: `check_side_files(ck)`.

- tokenizer (tiktoken.model or tokenizer.json): read as the engine reads it (kconvert/source/tokenizer.py), inside the
  checkpoint (a symlink leading out is refused, io/paths.py);
- tokenizer_config.json: an object; its `chat_template` a string or a list of {name, template}, and every template
  (and chat_template.jinja) parses in jinja2's sandbox (rendering, which runs the template, stays the engine's,
  in its limited child process: engine/inputs/template.py);
- a family's own side files (its manifest's `side_checks`): DeepSeek-V4.1's engram_token_map.json checked against
  the config and the tokenizer (kconvert/family/v41_rules.read_token_map, the engine's reader too)."""

from __future__ import annotations

from pathlib import Path

from kconvert.errors import ChatTemplateError, TokenizerError
from kconvert.io.paths import side_file
from kconvert.io.side_files import MAX_CONFIG, MAX_TEXT, read_json, read_text

TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json")
MAX_TEMPLATE_CHARS = 16 << 20  # engine/inputs/template.py's limit on what a template renders; no real one is near


def check_side_files(ck) -> None:
    """Refuse, naming the file, a side file of checkpoint `ck` the engine would refuse at run time."""
    root = Path(ck.root)
    tokens = _tokenizer(root)
    _chat_templates(root)
    for name in ck.model.family.get("side_checks", ()):
        SIDE_CHECKS[name](ck, tokens)


def _tokenizer(root: Path) -> int | None:
    """The tokenizer's number of tokens, read as the engine reads it; None without a tokenizer (conversions may ship
    without one: chat then names the missing file)."""
    if not any(side_file(root, n) for n in TOKENIZER_FILES):
        return None
    from kconvert.source.tokenizer import load_tokenizer

    return load_tokenizer(root).n_vocab


def _chat_templates(root: Path) -> None:
    cfg_path = side_file(root, "tokenizer_config.json")
    if cfg_path is not None:
        cfg = read_json(cfg_path, limit=MAX_CONFIG, error=TokenizerError)
        if not isinstance(cfg, dict):
            raise TokenizerError("must be a JSON object", file=str(cfg_path))
        t = cfg.get("chat_template")
        named = [("chat_template", t)] if not isinstance(t, list) else [
            (f"chat_template[{i}]", x.get("template") if isinstance(x, dict) else x) for i, x in enumerate(t)]
        for field, text in named:
            if text is None and field == "chat_template":
                continue
            if not isinstance(text, str):
                raise ChatTemplateError(f"{field} must be a string (a template), not {type(text).__name__}",
                                        file=str(cfg_path))
            _parses(text, f"{cfg_path}: {field}")
    jinja = side_file(root, "chat_template.jinja")
    if jinja is not None:
        _parses(read_text(jinja, limit=MAX_TEXT, error=ChatTemplateError), str(jinja))


def _parses(template: str, where: str) -> None:
    """The template parses (jinja2's sandboxed environment, as the engine's renderer builds it); not run."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"a chat template of {len(template)} characters: over the {MAX_TEMPLATE_CHARS} the "
                                "engine renders", file=where)
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}", file=where) from None
    except (RecursionError, MemoryError):
        raise ChatTemplateError("chat template nested too deeply to parse", file=where) from None


def _engram_token_map(ck, tokens: int | None) -> None:
    """DeepSeek-V4.1's engram_token_map.json, where the config has Engram layers."""
    from kconvert.family.v41_rules import read_token_map

    text, key = ck.model.text_config, ck.model.family.get("text_config", ".")
    if text.get("engram_layer_ids"):
        read_token_map(ck.root, text, prefix="" if key == "." else f"{key}.", tokens=tokens)


SIDE_CHECKS = {"engram_token_map": _engram_token_map}
