"""What the engine reads besides weights, for chat and verify alike: the tokenizer and its chat template (rendered,
sandboxed, in a throw-away process: `template`, `template_worker`) and image preprocessing (`image`: one processor
per family, the family's own rules in its package)."""
