"""A model's end-of-sequence ids, read the one way every engine reads them: the generation
config's ``eos_token_id``, else the model config's (an id or a list of ids in either). The
engines stop on these ids (``stopping``), so they must agree on them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def eos_token_ids(generation_eos: Any, config_eos: Any) -> tuple[int, ...]:
    """The ids from the generation config's ``eos_token_id`` unless it is None, else from the
    model config's; None entries dropped."""
    eos = config_eos if generation_eos is None else generation_eos
    eos_list = eos if isinstance(eos, list | tuple) else [eos]
    return tuple(int(e) for e in eos_list if e is not None)


def generation_eos(model_dir: Path) -> Any:
    """``model_dir``'s generation config's ``eos_token_id``; None without a readable one."""
    from transformers import GenerationConfig

    with contextlib.suppress(OSError, ValueError):
        return GenerationConfig.from_pretrained(model_dir).eos_token_id
    return None
