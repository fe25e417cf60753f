"""Every benchmark's ``--smoke`` run: a benchmark that errors, or counts failed requests (its
exit status), fails the suite instead of rotting until someone next runs it.

Each script runs as a subprocess on this tree's sources (the installed package may be another
checkout's) at its smoke sizes: seconds of work, plus the start of whatever servers and models it
needs. Those that load no model are marked ``bench`` and run in ``make test``; those that run a
real model are marked ``model`` and ``bench_model``: starting their servers takes minutes in all,
more than CI's budget holds, so ``make bench-smoke`` runs every one. A script that needs vLLM is
skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# Not benchmarks: the shared helpers (the engine that costs nothing among them), and the bare
# server bench_tokenize starts.
HELPERS = {"serverbench.py", "bare_tokenize_app.py", "cheap_engine.py"}
# Benchmarks that load no model weights (tokenizers and the fake engine only).
MODEL_FREE = {
    "bench_big_tools.py",
    "bench_body_checks.py",
    "bench_derender.py",
    "bench_extend.py",
    "bench_frontend_idle.py",
    "bench_pipeline_http.py",
    "bench_process_ceiling.py",
    "bench_render.py",
    "bench_small_request.py",
}
NEEDS_VLLM = {"bench_vs_vllm.py"}
SMOKE_TIMEOUT_S = 900  # a loaded 2-core machine takes minutes to start a model server


def _param(script: Path) -> object:
    marks = (
        [pytest.mark.bench]
        if script.name in MODEL_FREE
        else [pytest.mark.model, pytest.mark.bench_model]
    )
    if script.name in NEEDS_VLLM and importlib.util.find_spec("vllm") is None:
        marks.append(pytest.mark.skip(reason="vLLM is not installed"))
    return pytest.param(script, marks=marks, id=script.stem)


SCRIPTS = [_param(path) for path in sorted(BENCH.glob("*.py")) if path.name not in HELPERS]


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_succeeds(script: Path) -> None:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{script.name} --smoke exited {done.returncode}\n"
        f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    )
