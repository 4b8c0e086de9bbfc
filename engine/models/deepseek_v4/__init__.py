"""DeepSeek-V4 blocks: shared-KV attention with compressed branches, mHC, V4's MoE, norms and RoPE."""
