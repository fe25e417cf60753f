"""Decode fetched image bytes, refusing bombs and anything we do not decode.

Every failure is a ``MediaRefused`` (400): the bytes came from the client or a URL it chose.
Images only: audio and video parts are refused (400) by the media service before any fetch.
"""

from __future__ import annotations

import io

from PIL import Image

from tokenwire.media.errors import MediaRefused, Rule

# Only formats Pillow decodes itself; notably not EPS (which runs Ghostscript) or exotic plugins.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")
# Any one image, whatever the request's pixel budget: the bomb guard.
MAX_IMAGE_PIXELS = 64_000_000


def load_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """An RGB image; the size is checked from the header before any pixel is decoded."""
    return decode_image(open_image(data, max_pixels=max_pixels))


def open_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The image's header only: format and size are known (and checked), no pixel is decoded.

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
    return image


def decode_image(image: Image.Image) -> Image.Image:
    """Decode an ``open_image`` result to RGB: the costly step, for a worker thread."""
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
