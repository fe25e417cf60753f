"""The eos ids every engine reads (``engine.eos``): the generation config's, else the model
config's, as one id or a list."""

from __future__ import annotations

import json
from pathlib import Path

from tokenwire.engine.eos import eos_token_ids, generation_eos


def test_the_generation_config_wins_and_none_is_dropped() -> None:
    assert eos_token_ids([2, None, 7], 5) == (2, 7)
    assert eos_token_ids(3, 5) == (3,)
    assert eos_token_ids(None, [5, 6]) == (5, 6)
    assert eos_token_ids(None, None) == ()


def test_the_generation_config_is_read_when_there_is_one(tmp_path: Path) -> None:
    assert generation_eos(tmp_path) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert generation_eos(tmp_path) == [1, 2]
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_eos(tmp_path) is None
