"""Model-family manifests (manifests/*.toml): which tensors a family has, their shapes as functions
of config.json, their tensor-parallel split rule and default quantization policy.

A family manifest composes reusable *parts* (manifests/parts/*.toml: DeepSeek text, DSA indexer,
DeepSeek-V4 text, MoonViT, projector), each with a name prefix and the sub-config its shapes are evaluated
against; a part may apply only to one text model type (`if_model_type` / `unless_model_type`: Kimi over
DeepSeek-V3 or over DeepSeek-V4), and a text part may bring the family traits of its model (`[part.family]`:
engine layer kinds, shard modes), so a family over a new text model needs no copy of that model's manifest.
`find_family(config)` picks the family; `bind(config)` gives a `ModelMap` that classifies
tensor names and enumerates every expected tensor (which `plan` uses for models too big to exist).
Over 300 lines: a part bound to its config and the model map of them are one contract, read together (the helpers
they share live in compose, rule_names, schedule and expr).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import compress, repeat
from dataclasses import dataclass
from typing import NamedTuple

from kconvert.errors import ManifestError
from kconvert.family.compose import part_applies, stage_count, stage_names, with_traits
from kconvert.family.families import any_alias, family_aliases, literal_ends, families, find_family, manifests_dir, read_toml  # noqa: F401 (API)
from kconvert.family.expr import evaluate
from kconvert.family.limits import LIMITS_FILE, check_bounds, check_quantization, check_relations, run_checks
from kconvert.family.rule_names import name_key, placeholders, rule_regex, scale_block, tensor_key  # noqa: F401 (API)
from kconvert.family.schedule import list_length, padded, read_schedules

SPLITS = ("vocab", "col", "row", "expert", "replicate", "table")  # table: rows in ceil(n / tp) slices


@dataclass(frozen=True)
class Rule:
    """One manifest tensor entry, bound to a part instance (prefix + sub-config)."""

    pattern: str  # full name with {L}/{E}, or {M} (MTP block M = layer layer_count + M)
    component: str
    split: str
    quantize: bool
    shape: tuple[str, ...]
    layers: str | None  # layer kind, None for non-layer tensors
    required: str
    part: "BoundPart"
    values_below: str | None = None  # an integer table (V4's tid2eid): every entry in [0, this)
    reference: str | None = None  # the transformers name (a released name's `conversion_mapping` target)
    split_multiple: str | None = None  # each rank's slice a multiple of this (V4's wo_a: whole output groups)
    dtype: str | None = None  # the released dtype tag of a tensor kept as stored (F32 mHC, I64 tid2eid)
    engine: str | None = None  # the engine's module path where it differs from the name (family/engine_names.py)
    scale_block: tuple[int, int] | None = None  # its FP8 scale grid where not the config's (V4.1's Engram rows: 1 x 32)
    # serving engines run it in one GEMM with the other rules of this name in its layer and expert (gate and up: w1 /
    # w3), so a per-tensor scale (nvfp4's weight_scale_2) is shared by them
    fuse: str | None = None


class TensorInfo(NamedTuple):
    """What the manifest says about one concrete tensor name (a named tuple: 70k-200k of them per checkpoint,
    built far cheaper than a frozen dataclass)."""

    name: str
    rule: Rule
    layer: int | None
    expert: int | None

    @property
    def group(self) -> str:
        return self.rule.part.group

    @property
    def component(self) -> str:
        rule, layer = self.rule, self.layer  # asked per tensor and per piece: locals, no property chain
        if layer is not None and layer >= rule.part.layer_count and rule.part.group == "text":
            return "mtp"
        return rule.component

    @property
    def split(self) -> str:
        return self.rule.split

    @property
    def quantize(self) -> bool:
        return self.rule.quantize

    def expected_shape(self) -> tuple[int, ...]:
        return self.rule.part.shape_of(self.rule, self.layer)


class BoundPart:
    """A part (parts/NAME.toml) applied to one config."""

    def __init__(self, name: str, spec: dict, prefix: str, config: dict, *, section: str = ".",
                 config_file: str = "config.json", decoder_only: bool = False, engine_prefix: str | None = None,
                 names: dict[str, str] | None = None, family_defaults: dict | None = None, stored_stages: int = 0,
                 rebind: dict[str, str] | None = None):
        self.name, self.prefix, self.config, self.config_file = name, prefix, config, config_file
        self.engine_prefix = engine_prefix  # the engine's module path of its `engine` names (None: the root)
        self.decoder_only = decoder_only  # {L} names only decoder layers (V4 names its MTP blocks mtp.{M}.)
        self.engine_rename: str | None = spec.get("part", {}).get("engine_rename")  # + stored name: engine path
        head = spec.get("part", {})
        self.group = head.get("group", name)
        self.traits: dict = head.get("family", {})  # a text model's family traits (engine kinds, shard modes)
        self.kinds: dict[str, str] = spec.get("layer_kinds", {})
        # a family may fix a shared part's defaults for its own models (`defaults` in its [[parts]] entry)
        defaults = {**spec.get("defaults", {}), **(family_defaults or {})}
        self.section, self.defaults = section, defaults
        # (expression, layer) -> value: 384 experts x 61 layers share each layer's few shape expressions
        self._values: dict[tuple, object] = {}
        # null for a key with a default means "not set" (DeepSeek configs write q_lora_rank: null)
        self._env = {**{k: v for k, v in defaults.items() if "." not in k},
                     **{k: v for k, v in config.items() if not (v is None and k in defaults)}}
        for key, value in defaults.items():  # "section.key": a default inside a nested config section
            section_key, _, tail = key.partition(".")
            if tail and isinstance(self._env.get(section_key), dict) and self._env[section_key].get(tail) is None:
                self._env[section_key] = {**self._env[section_key], tail: value}
        where = "" if section == "." else f"{section}."  # the section's prefix in messages
        limits_path = manifests_dir() / LIMITS_FILE
        check_bounds(name, config, defaults, prefix=where, file=config_file, limits_path=limits_path)
        # a family may rebind keys for this part, from the config (DeepSeek-V4.1's drafter stages route over their own
        # bank: n_routed_experts is dspark_n_routed_experts there when set), before the relations and shapes read them
        self._env.update({key: self._eval(text) for key, text in (rebind or {}).items()})
        self._values.clear()
        for key, path in head.get("lengths", {}).items():  # a config list's length, for shape expressions
            self._env[key] = list_length(self._env, path, prefix=where, file=config_file)
        schedules = read_schedules(spec.get("schedules", {}), self._env, prefix=where, file=config_file)
        self._env.update(schedules)
        self._shapes: dict[tuple, tuple[int, ...]] = {}
        self._layer_ok: dict[tuple, bool] = {}
        # per schedule, each layer's kind by name (inspect's layer kinds: sliding / CSA / HCA, hash / top-k)
        self.schedules = {name: [spec["schedules"][name]["kinds"][k] for k in kinds] for name, kinds in schedules.items()
                          if "kinds" in spec["schedules"][name]}  # a position schedule names no kinds
        # decoder (and MTP) layers, routed experts, those a token reaches and the shared ones: each family's keys
        self.layer_count = self.extra_layers = self.expert_count = self.experts_per_token = self.shared_experts = 0
        for count in ("layer_count", "extra_layers", "expert_count", "experts_per_token", "shared_experts"):
            if count in head:
                setattr(self, count, int(self._eval(head[count])))
        # draft stages the checkpoint's names show (`stages_from_names`): whole, and every stage the config counts with
        # them (a drafter missing a stage is refused, one without any converts without it)
        self.required_extra = max(stored_stages, self.extra_layers) if stored_stages else 0
        if stored_stages > self.extra_layers:  # and at least that many, past the schedules config.json gives
            self._env.update(padded(spec.get("schedules", {}), schedules, self.layer_count + stored_stages))
            self.extra_layers = stored_stages
        self._env["extra_layer_count"] = self.extra_layers  # what the last stage's layer kind compares with
        self._env["stored_stages"] = self.required_extra  # draft stages the checkpoint holds (0: none, or not known)
        # what relates keys to each other (ranges that are expressions of other keys, relations, the engine's own rules
        # of kconvert/family/config_checks.py), once every key, schedule and the draft stages are known
        check_bounds(name, config, defaults, prefix=where, file=config_file, limits_path=limits_path, env=self._env)
        check_relations(name, self._env, prefix=where, file=config_file, limits_path=limits_path)
        run_checks(name, config, self._env, prefix=where, file=config_file, limits_path=limits_path)
        self.rules: list[Rule] = []
        for t in spec.get("tensor", []):
            if not self._eval(t.get("when", "True")):
                continue
            split = t.get("split", "replicate")
            if split not in SPLITS or (t.get("layers") and t["layers"] not in self.kinds):
                raise ManifestError(f"bad split {split!r} or layer kind {t.get('layers')!r}", file=f"parts/{name}.toml",
                                    tensor=t.get("name"))
            pattern = (names or {}).get(t["name"], prefix + t["name"])  # a family may name a tensor otherwise
            self.rules.append(Rule(pattern, t["component"], split, bool(t.get("quantize", False)),
                                   tuple(str(s) for s in t.get("shape", [])), t.get("layers"),
                                   str(t.get("required", "True")), self, t.get("values_below"),
                                   t.get("reference"), t.get("split_multiple"),
                                   t.get("dtype"), t.get("engine"), scale_block(t.get("scale_block"), name, t.get("name")),
                                   t.get("fuse")))

    @property
    def module_prefix(self) -> str:
        """The engine's module path of this part: its engine prefix, else its stored-name prefix."""
        return self.prefix if self.engine_prefix is None else self.engine_prefix

    def env(self, layer: int | None = None) -> dict:
        return self._env if layer is None else {**self._env, "L": layer}

    def _eval(self, text, layer: int | None = None):
        key = (text, layer)
        if key in self._values:
            return self._values[key]
        try:
            value = self._values[key] = evaluate(text, self.env(layer))
        except ManifestError as e:  # MissingKey included: a config problem, named as one
            raise ManifestError(f"{e.message} (part {self.name})", file=e.file or self.config_file) from None
        return value

    def shape_of(self, rule: Rule, layer: int | None) -> tuple[int, ...]:
        """The shape config.json implies for `rule` at `layer`, evaluated once per (rule, layer) (the rule itself,
        as for layer_matches: two rules of one pattern may differ in shape)."""
        key = (id(rule), layer)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = tuple(int(self._eval(s, layer)) for s in rule.shape)
        return shape

    def layer_matches(self, rule: Rule, layer: int) -> bool:
        """Whether `rule` names a tensor of `layer`: once per (rule, layer), as 384 experts of a layer ask the
        same question (keyed by the rule itself: rules live as long as their part, and two rules of one
        pattern serve different layer kinds)."""
        key = (id(rule), layer)
        ok = self._layer_ok.get(key)
        if ok is None:
            ok = self._layer_ok[key] = self._layer_matches(rule, layer)
        return ok

    def _layer_matches(self, rule: Rule, layer: int) -> bool:
        if not 0 <= layer < self.layer_count + self.extra_layers:
            return False
        if "{M}" in rule.pattern and layer < self.layer_count:
            return False
        if "{L}" in rule.pattern and self.decoder_only and layer >= self.layer_count:
            return False
        return bool(self._eval(self.kinds[rule.layers], layer))

    def is_kind(self, kind: str, layer: int) -> bool:
        """Whether `layer` is of the part's layer kind `kind` ([layer_kinds]: a DSpark drafter's first_stage ...)."""
        return bool(self._eval(self.kinds[kind], layer))

    def is_required(self, rule: Rule, layer: int | None) -> bool:
        if self.group == "text" and layer is not None and layer >= self.layer_count + self.required_extra:
            return False  # MTP layers: published by some releases, not needed for inference (unless counted present)
        return bool(self._eval(rule.required, layer))


class ModelMap:
    """A family manifest bound to one config.json."""

    def __init__(self, family: dict, parts: list[BoundPart], config: dict):
        self.family = with_traits(family, parts)
        self.name: str = family["name"]
        self.parts = parts
        self.config = config
        key = family.get("text_config", ".")
        self.text_config: dict = config if key == "." else config.get(key, {})
        self.by_key: dict[str, list[tuple[Rule, tuple[str, ...]]]] = {}  # name_key -> (rule, its {L}/{E}/{M} in order)
        self.aliases = family_aliases(family)
        self._any_alias = any_alias(self.aliases)
        self._alias_ends = literal_ends(self.aliases) if self._any_alias is not None else None
        # any tensor the engine names otherwise (family/engine_names.py): decided once, asked per unit
        self.renames = any(p.engine_rename or any(r.engine or r.reference for r in p.rules) for p in parts)
        for part in parts:
            for rule in part.rules:
                fields = placeholders(rule.pattern)
                self.by_key.setdefault(name_key(rule.pattern), []).append((rule, fields))

    def with_defaults(self, sub: dict, section: str) -> dict:
        """Config section `section` (`sub`) with each null that a part bound to it gives a default for read as that
        default, as bind read it (a null with a default means "not set"; limits.toml refuses other nulls)."""
        out = dict(sub)
        for part in self.parts:
            if part.section != section:
                continue
            for key, value in part.defaults.items():
                head, _, tail = key.partition(".")
                if not tail and head in out and out[head] is None:
                    out[head] = value
                elif tail and isinstance(out.get(head), dict) and tail in out[head] and out[head][tail] is None:
                    out[head] = {**out[head], tail: value}
        return out

    def canonical(self, name: str) -> str:
        """A stored name as the manifest names it: the family's [family.aliases] rules, each once at the start."""
        if self._any_alias is not None and not self._any_alias.search(name):
            return name  # no rule matches the name as stored, so none matches after another rule either
        for pattern, published in self.aliases:
            name = pattern.sub(published, name, count=1)
        return name

    def aliased(self, names) -> bool:
        """Whether an alias rule may rename one of `names` (200k: one C-level pass)."""
        if self._any_alias is None:
            return True
        if self._alias_ends is not None:  # only the names with an ending some rule ends in can match
            names = compress(names, map(str.endswith, names, repeat(self._alias_ends)))
        return any(map(self._any_alias.search, names))

    @property
    def text(self) -> BoundPart:
        return next(p for p in self.parts if p.group == "text")

    def expert_bank(self, layer: int) -> tuple[int, int]:
        """(routed experts, experts a token reaches) of text layer `layer`: the counts of the part whose routed
        experts that layer holds (a DeepSeek-V4.1 DSpark stage routes over its own bank), else the text model's."""
        for part in self.parts:
            if part.group == "text" and part.expert_count and any(
                    "{E}" in rule.pattern and part.layer_matches(rule, layer) for rule in part.rules):
                return part.expert_count, part.experts_per_token or self.text.experts_per_token
        return self.text.expert_count, self.text.experts_per_token

    def classify(self, name: str) -> TensorInfo | None:
        """The manifest entry for `name`, or None when the family does not know it."""
        for rule, fields in self.by_key.get(tensor_key(name), ()):  # a name has no {L}/{E}/{M}: its own key
            m = rule_regex(rule.pattern).match(name)
            if not m:
                continue
            layer = expert = None
            for field, value in zip(fields, m.groups()):
                if field == "L":
                    layer = int(value)
                elif field == "M":
                    layer = rule.part.layer_count + int(value)
                else:
                    expert = int(value)
            if layer is not None and not rule.part.layer_matches(rule, layer):
                continue
            if expert is not None and not 0 <= expert < rule.part.expert_count:
                continue
            return TensorInfo(name, rule, layer, expert)
        return None

    def expected(self, *, include_optional: bool = False) -> Iterator[tuple[TensorInfo, bool]]:
        """Every tensor the config implies, as (info, required), in model order."""
        for rule, layer, required, names in self.expected_groups():
            if required or include_optional:
                per_expert = "{E}" in rule.pattern
                for e, name in enumerate(names):
                    yield TensorInfo(name, rule, layer, e if per_expert else None), required

    def expected_groups(self) -> Iterator[tuple[Rule, int | None, bool, list[str]]]:
        """The tensors the config implies a (rule, layer) at a time, optional ones included: (rule, layer, required,
        names), in expert order for a per-expert rule (384 experts: one group, not 384 infos)."""
        for part in self.parts:
            numbers = list(map(str, range(part.expert_count)))  # once a part: names are joined from them in C
            for rule in part.rules:
                layers = [None] if rule.layers is None else [
                    L for L in range(part.layer_count + part.extra_layers) if part.layer_matches(rule, L)]
                for L in layers:
                    name = rule.pattern if L is None else \
                        rule.pattern.replace("{L}", str(L)).replace("{M}", str(L - part.layer_count))
                    if "{E}" not in name:
                        names = [name]
                    elif name.count("{E}") == 1:
                        head, _, tail = name.partition("{E}")
                        names = list(map("".join, zip(repeat(head), numbers, repeat(tail))))
                    else:
                        names = [name.replace("{E}", str(e)) for e in range(part.expert_count)]
                    yield rule, L, part.is_required(rule, L), names


def bind(config: dict, *, config_file: str = "config.json", names=None, draft_stages: int | None = None) -> ModelMap:
    """Pick the family manifest for `config` and bind it; `names` (stored tensor names): for draft stages counted from
    them (compose.stage_count); `draft_stages`: that count where the names are not at hand (a converted checkpoint's
    draft layers)."""
    spec = find_family(config, config_file=config_file)
    if draft_stages is not None and names is None:
        names = stage_names(spec.get("parts", []), draft_stages)
    limits_path = manifests_dir() / LIMITS_FILE
    check_quantization(config.get("quantization_config"), field="quantization_config", file=config_file,
                       limits_path=limits_path)
    text_key = spec["family"].get("text_config", ".")
    if text_key != "." and isinstance(config.get(text_key), dict):
        check_quantization(config[text_key].get("quantization_config"), field=f"{text_key}.quantization_config",
                           file=config_file, limits_path=limits_path)
    parts = []
    for p in spec.get("parts", []):
        sub = config if p.get("config", ".") == "." else config.get(p["config"])
        if not isinstance(sub, dict):
            raise ManifestError(f"config has no {p['config']!r} section (family {spec['family']['name']})", file=config_file)
        if not part_applies(p, sub):
            continue
        part_spec = read_toml(manifests_dir() / "parts" / f"{p['use']}.toml")
        parts.append(BoundPart(p["use"], part_spec, p.get("prefix", ""), sub, section=p.get("config", "."),
                               config_file=config_file, decoder_only=bool(p.get("decoder_layers_only", False)),
                               engine_prefix=p.get("engine_prefix"), names=p.get("names"),
                               family_defaults=p.get("defaults"), stored_stages=stage_count(p, names),
                               rebind=p.get("rebind")))
    return ModelMap(spec["family"], parts, config)
