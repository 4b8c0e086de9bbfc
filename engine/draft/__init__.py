"""Draft heads: the layers a release ships past its decoder layers to propose tokens the target then checks
(speculative decoding, engine/runtime/speculative.py). `registry` chooses a family's kind (its manifest's
`[part.family.engine] draft`), `mtp` is DeepSeek-V3-style multi-token prediction, `v4_mtp` DeepSeek-V4's MTP
block, `drafter` runs a model's heads against its target's hidden states and proposes greedy drafts."""
