"""Reading a checkpoint for a weight reload: into memory the tensors own, refusing a file changed
under the reader, NaN or infinity, and files that are not safetensors (each a ``WeightsError``,
which the control routes answer with a 400 while the old weights stay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenwire.engine import checkpoint
from tokenwire.engine.base import WeightsError
from tokenwire.engine.checkpoint import read_checkpoint

TENSORS = {
    "f32": torch.randn(64, 32),
    "bf16": torch.randn(7, 3).to(torch.bfloat16),
    "f16": torch.randn(5).to(torch.float16),
    "i64": torch.arange(9).reshape(3, 3),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


def write(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model") -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.safetensors"
    save_file(tensors, path)
    return path


def test_reads_what_safetensors_reads(tmp_path: Path) -> None:
    write(tmp_path, dict(list(TENSORS.items())[:4]), "model-00001")
    write(tmp_path, dict(list(TENSORS.items())[4:]), "model-00002")
    read = read_checkpoint(tmp_path)
    expected = {**load_file(tmp_path / "model-00001.safetensors")}
    expected.update(load_file(tmp_path / "model-00002.safetensors"))
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name


_TOUCH_AFTER_TRUNCATION = """
import os, sys
from pathlib import Path
from tokenwire.engine.checkpoint import read_checkpoint
tensors = read_checkpoint(Path(sys.argv[1]))
os.truncate(sys.argv[2], 64)  # the trainer rewrites the file before the swap copies it
print(float(sum(t.float().sum() for t in tensors.values())))
"""


def test_the_tensors_outlive_a_rewrite_of_their_file(tmp_path: Path) -> None:
    # safetensors' load_file maps the file: touching its tensors after this truncation was a
    # SIGBUS (exit -7) that killed the server mid-reload.
    path = write(tmp_path, {"w": torch.ones(256, 1024)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _TOUCH_AFTER_TRUNCATION, str(tmp_path), str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert float(done.stdout) == 256 * 1024


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_a_file_changed_while_it_is_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    path = write(tmp_path, {"w": torch.ones(64, 64)})
    read_whole = checkpoint.read_whole

    def read_then_change(handle, size):  # type: ignore[no-untyped-def]
        data = read_whole(handle, size)
        if change == "truncate":
            os.truncate(path, 100)
        else:  # same size, new bytes, as a trainer saving its next step in place
            path.write_bytes(bytes(reversed(path.read_bytes())))
            os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1))
        return data

    monkeypatch.setattr(checkpoint, "read_whole", read_then_change)
    with pytest.raises(WeightsError, match="changed while it was read"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_weights_are_refused_unless_allowed(
    tmp_path: Path, bad: float, dtype: torch.dtype
) -> None:
    weights = torch.zeros(4, 4, dtype=dtype)
    weights[2, 3] = bad
    write(tmp_path, {"good": torch.ones(3), "layer.weight": weights})
    with pytest.raises(WeightsError, match=r"layer\.weight holds NaN or infinite values"):
        read_checkpoint(tmp_path)
    loaded = read_checkpoint(tmp_path, allow_nonfinite=True)["layer.weight"]
    assert torch.equal(loaded.isnan(), weights.isnan())


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


@pytest.mark.parametrize(
    "content",
    [
        b"not a checkpoint",
        b"\x01\x02",
        (2**40).to_bytes(8, "little") + b"{}",
        _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"1234"),
        _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"12345678"),
        _safetensors({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"x" * 8),
        _safetensors({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"x" * 8),
        _safetensors({"w": {"dtype": "F32", "shape": [2]}}, b"x" * 8),
        _safetensors({"w": "F32"}),
        _safetensors([1, 2]),  # type: ignore[arg-type]
        b"\x02\x00\x00\x00\x00\x00\x00\x00{x",
    ],
)
def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(WeightsError, match=r"model\.safetensors is not a readable safetensors"):
        read_checkpoint(tmp_path)


def test_a_directory_without_checkpoint_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="holds no"):
        read_checkpoint(tmp_path)
    with pytest.raises(WeightsError, match="is not a directory"):
        read_checkpoint(tmp_path / "missing")


def test_a_padded_file_is_refused_before_its_bytes_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes past the last tensor (a small file padded to gigabytes, sparse): refused once the
    header is read, as safetensors refuses them, without reading the rest."""
    path = write(tmp_path, {"w": torch.ones(4)})
    os.truncate(path, 2 * 2**30)
    reads: list[int] = []
    read_whole = checkpoint.read_whole

    def counted(handle, size):  # type: ignore[no-untyped-def]
        reads.append(size)
        return read_whole(handle, size)

    monkeypatch.setattr(checkpoint, "read_whole", counted)
    with pytest.raises(WeightsError, match="not what its header gives"):
        read_checkpoint(tmp_path)
    assert sum(reads) < 4096


def test_an_error_quotes_none_of_the_file(tmp_path: Path) -> None:
    """A file that is not safetensors is refused without its bytes or size in the message (its
    first 8 bytes used to come back as the header size)."""
    secret = b"root:x:0:0:root:/root:/bin/bash\n"
    (tmp_path / "model.safetensors").write_bytes(secret)
    with pytest.raises(WeightsError) as refused:
        read_checkpoint(tmp_path)
    message = str(refused.value)
    for leak in (str(int.from_bytes(secret[:8], "little")), str(len(secret)), "root"):
        assert leak not in message
