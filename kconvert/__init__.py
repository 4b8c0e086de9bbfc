"""kconvert: inspect, plan, reshard + quantize, load and verify DeepSeek-V3.2 / Kimi-K2.5-class checkpoints.

The library never prints: it returns values and raises `kconvert.errors.KConvertError` subclasses.
"""

__version__ = "0.1.0"
