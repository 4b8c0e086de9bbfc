"""DeepSeek-V3 / V3.2 / Kimi-K2 text blocks: MLA, the DSA lightning indexer, the DeepSeek MoE, the MTP draft head."""
