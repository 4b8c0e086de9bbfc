"""Quantization schemes: one module per scheme (what it takes, stores, and how it quantizes and
dequantizes), the registry that lists them, the policy that picks tensors, and the helpers they
share (chunked kernels, int4 packings). `shard`, `export`, `plan` and the catalog all ask here.

Adding a scheme: a module beside fp8_block.py (a `Scheme` subclass and `SCHEME = ...`) and one line in
registry.py; a new *source* format it can copy losslessly is its `lossless_copy`."""
