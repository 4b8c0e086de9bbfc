"""Calibrated INT4 (GPTQ) layer by layer through the engine: memory bounds, routing, work split."""
