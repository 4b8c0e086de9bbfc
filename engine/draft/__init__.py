"""Draft heads: the layers a release ships past its decoder layers to propose tokens the target then checks
(speculative decoding, engine/runtime/speculative.py). `registry` chooses a family's kind (its manifest's
`[part.family.engine] draft`; the kinds live in their family's package: DeepSeek-V3's MTP head, V4's MTP block and
DSpark stage, V4.1's DSpark stage), `drafter` runs a model's chained heads against its target's hidden states and
proposes greedy drafts, `dspark` runs the DSpark stages a block at a time (V4 and V4.1 alike)."""
