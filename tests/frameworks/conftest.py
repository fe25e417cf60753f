"""The framework senders' server: one for every test here (``make test-frameworks``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import RL_SERVER_ARGS, Server, _start


@pytest.fixture(scope="session")
def frameworks_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``rl_server``'s flags without an API key: skyrl-train's and AReaL's remote engines send
    no Authorization header."""
    yield from _start(tmp_path_factory, "frameworks", RL_SERVER_ARGS)
