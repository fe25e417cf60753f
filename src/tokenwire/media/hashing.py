"""Content hashes that name media items in the cache and in render's ``features.mm_hashes``.

Fetched media is named by the sha256 of its bytes: cheap, stable across processes and known
before any decoding, so a cache hit skips the decode and the processor entirely. Items that
arrive already processed (``features.kwargs_data``) have no source bytes; they are named by a
hash of their tensors in a separate domain, so a client can never make its tensors answer to
the name of somebody else's fetched image.
"""

from __future__ import annotations

import hashlib

import torch

_TENSOR_DOMAIN = b"tokenwire-processed-media-v1\0"


def hash_media_bytes(data: bytes) -> str:
    """sha256 hex digest of fetched media bytes (64 lowercase hex characters)."""
    return hashlib.sha256(data).hexdigest()


def hash_tensors(**tensors: torch.Tensor) -> str:
    """sha256 over names, dtypes, shapes and contents, in keyword order; for processed items."""
    digest = hashlib.sha256(_TENSOR_DOMAIN)
    for name, tensor in tensors.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()
