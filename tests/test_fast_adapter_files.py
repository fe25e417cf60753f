"""Hostile adapter directories and path inputs, over the real app and adapter registry with a
fake engine (the registry reads every adapter file itself, so what a load opens is tested here
without a model): each is a 400 that quotes no file bytes, and nothing changes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import API_KEY, FAST_CONTROL_ARGS, assert_error
from tests.fast_app import FastApp, serve_fast
from tokenwire import adapter_files
from tokenwire.engine.base import WeightsError
from tokenwire.engine.lora_rules import check_config

FACTOR = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
CONFIG = {"r": 4, "lora_alpha": 8}
# What /etc/passwd starts with; its first 8 bytes read as a header size are this number.
SECRET = b"root:x:0:0:root:/root:/bin/bash\n" * 4
SECRET_AS_SIZE = str(int.from_bytes(SECRET[:8], "little"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the directory adapters may load from, a directory beside it holding a secret)."""
    base = tmp_path_factory.mktemp("adapter-files")
    allowed, outside = base / "allowed", base / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    adapter_files.write(outside / "adapter", CONFIG, {FACTOR: torch.zeros(4, 576)})
    return allowed, outside


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, roots: tuple[Path, Path]) -> Iterator[FastApp]:
    args = [*FAST_CONTROL_ARGS, "--allowed-lora-paths", str(roots[0])]
    yield from serve_fast(tmp_path_factory, args, API_KEY)


def _adapter(root: Path, name: str, config: str | dict[str, Any] = CONFIG) -> Path:
    """A well-formed adapter directory (the fake engine does not check its factors)."""
    path = root / name
    adapter_files.write(path, {}, {FACTOR: torch.zeros(4, 576)})
    (path / adapter_files.CONFIG_FILE).write_text(
        config if isinstance(config, str) else json.dumps(config)
    )
    return path


def _load(app: FastApp, path: Path | str, route: str = "/v1/load_lora_adapter") -> httpx.Response:
    return app.client.post(route, json={"lora_name": "hostile", "lora_path": str(path)})


def _refused(app: FastApp, path: Path, message: str) -> None:
    error = assert_error(_load(app, path), 400, message)
    assert error["param"] == "lora_path"
    for leak in (SECRET_AS_SIZE, "root:x", str(len(SECRET))):
        assert leak not in error["message"], error["message"]
    assert "hostile" not in app.client.get("/v1/models").text


def test_a_good_adapter_loads(app: FastApp, roots: tuple[Path, Path]) -> None:
    """The control case: the hostile cases below differ from it in one file each."""
    path = _adapter(roots[0], "good")
    assert _load(app, path).status_code == 200
    assert app.client.post("/v1/unload_lora_adapter", json={"lora_name": "hostile"}).is_success


@pytest.mark.parametrize("file", [adapter_files.CONFIG_FILE, adapter_files.WEIGHTS_FILE])
@pytest.mark.parametrize("target", ["passwd", "adapter"])
def test_a_symlink_out_of_the_allowed_root_is_refused(
    app: FastApp, roots: tuple[Path, Path], file: str, target: str
) -> None:
    allowed, outside = roots
    path = _adapter(allowed, f"link-{file}-{target}")
    (path / file).unlink()
    linked = outside / "passwd" if target == "passwd" else outside / "adapter" / file
    (path / file).symlink_to(linked)
    _refused(app, path, "--allowed-lora-paths")


def test_a_symlinked_adapter_directory_out_of_the_root_is_refused(
    app: FastApp, roots: tuple[Path, Path]
) -> None:
    allowed, outside = roots
    (allowed / "dir-link").symlink_to(outside / "adapter")
    _refused(app, allowed / "dir-link", "--allowed-lora-paths")


def test_a_file_that_is_not_safetensors_quotes_none_of_its_bytes(
    app: FastApp, roots: tuple[Path, Path]
) -> None:
    """The red team's leak: ``header of 3475222254926655346 bytes`` was ``root:x:0``."""
    path = _adapter(roots[0], "passwd-inside")
    (path / adapter_files.WEIGHTS_FILE).write_bytes(SECRET)
    _refused(app, path, "is not a readable safetensors file")
    (path / adapter_files.CONFIG_FILE).write_bytes(SECRET)
    _refused(app, path, "is not valid JSON")
    (path / adapter_files.CONFIG_FILE).write_bytes(b"\xff" + SECRET)
    _refused(app, path, "not UTF-8")


def test_a_padded_sparse_adapter_is_refused_unread(app: FastApp, roots: tuple[Path, Path]) -> None:
    """A 4 KB adapter padded to a 2 GiB sparse file: the header accounts for 4 KB, so the rest
    is never read (it was, and stayed resident)."""
    path = _adapter(roots[0], "sparse")
    os.truncate(path / adapter_files.WEIGHTS_FILE, 2 * 2**30)
    before = _peak_rss()
    _refused(app, path, "not what its header gives")
    assert _peak_rss() - before < 2**30


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"r": 4, "lora_alpha": NaN}', "NaN is not a finite number"),
        ('{"r": 4, "lora_alpha": Infinity}', "Infinity is not a finite number"),
        ('{"r": 4, "lora_alpha": -Infinity}', "Infinity is not a finite number"),
        ('{"r": 4, "lora_alpha": 1e999}', "overflows to infinity"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"r": ' + "9" * 5000 + "}", adapter_files.CONFIG_FILE),
        (" " * (adapter_files.MAX_CONFIG_BYTES + 1), "larger than"),
        ("[1, 2]", "must hold a JSON object"),
    ],
)
def test_a_hostile_config_is_refused(
    app: FastApp, roots: tuple[Path, Path], config: str, message: str
) -> None:
    path = _adapter(roots[0], f"config-{abs(hash(config))}", config)
    _refused(app, path, message)


def test_special_files_are_refused_without_blocking(app: FastApp, roots: tuple[Path, Path]) -> None:
    path = _adapter(roots[0], "fifo")
    (path / adapter_files.WEIGHTS_FILE).unlink()
    os.mkfifo(path / adapter_files.WEIGHTS_FILE)  # opening it to read would wait for a writer
    _refused(app, path, "is not a regular file")
    (path / adapter_files.WEIGHTS_FILE).unlink()
    _refused(app, path, f"has no {adapter_files.WEIGHTS_FILE}")
    (path / adapter_files.WEIGHTS_FILE).mkdir()
    _refused(app, path, "is not a regular file")


# Paths no OS call can take: NUL (was a 500 on every path route, schemathesis' finding), a
# component over 255 bytes (a 500 for lora_path), a path over 4096 bytes.
BAD_PATHS = ["/tmp/a\x00b", "/tmp/" + "a" * 256, "/tmp/" + "é" * 128, "/a" * 2049]
PATH_ROUTES = [
    ("/update_weights", "weight_dir"),
    ("/update_weights_from_disk", "model_path"),
    ("/v1/load_lora_adapter", "lora_path"),
    ("/skyrl/v1/load_lora_adapter", "lora_path"),
    ("/load_lora_adapter", "lora_path"),
]


@pytest.mark.parametrize("bad", BAD_PATHS, ids=["nul", "component", "utf8", "length"])
@pytest.mark.parametrize(("route", "field"), PATH_ROUTES)
def test_paths_the_os_cannot_take_are_a_400_on_every_route(
    app: FastApp, route: str, field: str, bad: str
) -> None:
    body = {field: bad, "lora_name": "hostile"}
    error = assert_error(app.client.post(route, json=body), 400, field)
    assert error["type"] == "BadRequestError"
    assert not app.engine.paused


def test_a_nonfinite_alpha_sent_with_tensors_is_refused() -> None:
    """The same rule for a config a trainer sends (JSON parsers that take NaN exist)."""
    for alpha in (float("nan"), float("inf"), -float("inf"), 10**400):
        with pytest.raises(WeightsError, match="lora_alpha must be a finite number"):
            check_config({"r": 4, "lora_alpha": alpha}, max_rank=8)
    assert check_config({"r": 4, "lora_alpha": 8}, max_rank=8) == (4, 2.0)


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (the app runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status")
