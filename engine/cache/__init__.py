"""Decode caches two families share and their byte formats: the paged MLA latent cache (and its DSA key rows), the
row formats, paged rows and rings, the host tier, rewinding. A family's own cache lives in its package
(DeepSeek-V4's compressed cache, V4.1's built on it, Kimi Linear's KDA states)."""
