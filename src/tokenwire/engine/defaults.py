"""Engine defaults the settings, the factory and the engines share.

A leaf module: the hf engine needs its default without importing the factory that imports it,
and the settings need it without importing an engine (torch) at start-up.
"""

import os

# The hf engine's prefix cache budget: about 23k tokens of SmolLM2-135M's float32 KV.
DEFAULT_PREFIX_CACHE_BYTES = 2**30

# Prompt tokens one hf prefill forward may hold (``--max-num-batched-tokens``): longer prompts
# prefill in chunks of this size. On CPU a forward's cost grows with its tokens from about 100
# (SmolLM2-135M, 2 cores: ~1.3 ms per token above 128), so 256 keeps each chunk near prefill's
# best cost per token while a decode step waits at most ~0.35 s behind one.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


def default_engine_threads() -> int:
    """Torch threads for the hf engine's forwards: the usable cores but one, at least 1.

    The spare core is the event loop's (HTTP, JSON, tokenizing): when both want every core,
    torch's OpenMP threads wait on each other at every barrier. Measured on 2 loaded cores, a
    32-row decode step: 1 thread 7.4 ms of CPU per token, 2 threads 45 ms (bench/RESULTS.md).
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)
