"""Decode fetched media bytes into arrays, refusing bombs and anything we do not decode.

Every failure is a ``MediaRefused`` (400): the bytes came from the client or a URL it chose.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import soundfile
from PIL import Image

from tokenwire.media.errors import MediaRefused, Rule

# Only formats Pillow decodes itself; notably not EPS (which runs Ghostscript) or exotic plugins.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")
AUDIO_FORMATS = frozenset({"WAV", "WAVEX", "FLAC", "OGG", "MP3"})

_AUDIO_BLOCK_FRAMES = 16_384
_AUDIO_MAX_CHANNELS = 32


def load_image(data: bytes, *, max_pixels: int = 64_000_000) -> Image.Image:
    """An RGB image; the size is checked from the header before any pixel is decoded.

    Pillow's own global guard (``Image.MAX_IMAGE_PIXELS``) still applies on top; the per-call
    ``max_pixels`` is what this server relies on, so lowering it never needs global state.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaRefused(Rule.IMAGE_TOO_LARGE) from None
    except Exception:  # Pillow raises many types for hostile input; none may become a 500
        raise MediaRefused(Rule.INVALID_IMAGE) from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaRefused(Rule.INVALID_IMAGE, "empty image")
    if width * height > max_pixels:
        raise MediaRefused(Rule.IMAGE_TOO_LARGE, f"{width}x{height} > {max_pixels} pixels")
    try:
        image.load()
        return _to_rgb(image)
    except Image.DecompressionBombError:
        raise MediaRefused(Rule.IMAGE_TOO_LARGE) from None
    except Exception:
        raise MediaRefused(Rule.INVALID_IMAGE) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """Transparent pixels become white (as vLLM does), not the black ``convert`` would give."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def load_audio(data: bytes, *, max_frames: int = 48_000 * 600) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the sample rate (WAV, FLAC, OGG, MP3 via libsndfile).

    Decoded in blocks and mixed down as it goes, counting real frames rather than trusting the
    header, so a small, highly compressed file cannot expand past ``max_frames``.
    """
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            if sound.format not in AUDIO_FORMATS:
                raise MediaRefused(Rule.INVALID_AUDIO, f"unsupported audio format {sound.format}")
            if not 0 < sound.channels <= _AUDIO_MAX_CHANNELS or sound.samplerate <= 0:
                raise MediaRefused(Rule.INVALID_AUDIO, "bad channel count or sample rate")
            if sound.frames > max_frames:
                raise MediaRefused(Rule.AUDIO_TOO_LONG, f"more than {max_frames} samples")
            sample_rate = int(sound.samplerate)
            blocks: list[np.ndarray] = []
            total = 0
            while True:
                block = sound.read(_AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if len(block) == 0:
                    break
                total += len(block)
                if total > max_frames:
                    raise MediaRefused(Rule.AUDIO_TOO_LONG, f"more than {max_frames} samples")
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except MediaRefused:
        raise
    except Exception:  # soundfile.LibsndfileError, RuntimeError, ValueError, ...
        raise MediaRefused(Rule.INVALID_AUDIO) from None
    if total == 0:
        raise MediaRefused(Rule.INVALID_AUDIO, "no samples")
    samples = np.concatenate(blocks).astype(np.float32, copy=False)
    return samples, sample_rate


def load_video(data: bytes, **_: Any) -> Any:
    """Always refused: no video decoder is installed (PyAV would add ~100 MB of FFmpeg)."""
    raise MediaRefused(Rule.VIDEO_UNSUPPORTED)
