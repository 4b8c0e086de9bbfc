"""Test machinery shipped with the library: `standin`, a CPU-backed accelerator registered the way torch_musa
registers MUSA (for the device tests and the device check's dry run), and its streams and events."""
