"""Decode caches and their byte formats: the paged MLA latent cache, DeepSeek-V4's compressed cache, the host tier."""
