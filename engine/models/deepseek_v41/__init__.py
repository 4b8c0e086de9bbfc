"""DeepSeek-V4.1's decoder (block kind "v41"): V4's attention with compression by role, Engram, single-pass mHC."""
