"""`kconvert serve-check`: exports as vLLM itself loads and runs them. `env` finds the vLLM environment and starts
`driver` there (with `vllm_claims`, `vllm_load`, `vllm_dequant`: they import vLLM, never kconvert); `check` compares
what vLLM loaded or computed with kconvert's own reading. docs/EXPORT.md "Checked by vLLM itself"."""
