"""kconvert's inference engine: MLA + DSA sparse attention + MoE + MoonViT, over converted checkpoints."""
