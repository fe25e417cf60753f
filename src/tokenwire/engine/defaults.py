"""Engine defaults the settings, the factory and the engines share.

A leaf module: the hf engine needs its default without importing the factory that imports it,
and the settings need it without importing an engine (torch) at start-up.
"""

# The hf engine's prefix cache budget: about 23k tokens of SmolLM2-135M's float32 KV.
DEFAULT_PREFIX_CACHE_BYTES = 2**30
