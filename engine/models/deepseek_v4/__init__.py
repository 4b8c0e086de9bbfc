"""DeepSeek-V4: shared-KV attention with compressed branches (CSA / HCA) and their cache (`cache`, `entry_format`),
mHC, V4's MoE, norms and RoPE, and its draft heads: the MTP block (`mtp`) and the DSpark stage of the
V4-Flash-0731 layout (`dspark`)."""
