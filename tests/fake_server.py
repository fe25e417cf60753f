"""``tokenwire serve`` of qwen3-tiny over the project's fake engine (which answers the prompt's
ids back until the stop rule), in a process of its own: for tests that kill a server.

    python tests/fake_server.py PORT [SERVE FLAGS...]   # PYTHONPATH as serverbench.tree_env
"""

from __future__ import annotations

import sys

from serverbench import serve_fake_engine

from tests.fake_engine import FakeEngine

if __name__ == "__main__":
    serve_fake_engine(int(sys.argv[1]), FakeEngine.for_model, *sys.argv[2:], model="qwen3-tiny")
