"""Verify one image file without decoding more than needed: format, size, EXIF orientation, truncated JPEGs."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

PIL_FORMATS = frozenset({"BMP", "JPEG", "MPO", "PNG", "TIFF", "WEBP"})
MIN_IMAGE_SIDE = 10
WIDE_TIFF_MODES = frozenset({"F", "I"})  # PIL's modes of 32-bit float and integer samples


class BadInputError(ValueError):
    """An image or label file that cannot be used; the message says why."""


def image_orientation(image: Image.Image, path: str | None = None) -> int:
    """Return the EXIF orientation tag (1 = upright) without decoding pixels.

    PIL's PNG getexif() decodes the whole image to look for a trailing eXIf chunk. We read an eXIf
    chunk placed before the pixel data, where the PNG spec puts it, else (given `path`) one after
    it by walking the chunk headers (OpenCV, which decodes for training, applies either).
    """
    if image.format == "PNG":
        raw = image.info.get("exif") or (_trailing_png_exif(path) if path is not None else None)
        if not raw:
            return 1
        exif = Image.Exif()
        exif.load(raw)
        return int(exif.get(0x0112, 1))
    return int(image.getexif().get(0x0112, 1))


def _trailing_png_exif(path: str) -> bytes | None:
    """The data of a PNG's eXIf chunk after its pixel data, or None; reads only chunk headers up to it."""
    with open(path, "rb") as file:
        file.seek(8)  # the signature
        while header := file.read(8):
            if len(header) < 8:
                return None
            length, kind = int.from_bytes(header[:4], "big"), header[4:]
            if kind == b"eXIf":
                return file.read(length)
            if kind == b"IEND":
                return None
            file.seek(length + 4, os.SEEK_CUR)  # the data and its CRC
    return None


def decodes_without_end_marker(path: str) -> bool:
    """Whether a JPEG that lacks its end-of-image marker still holds all of its scan data.

    The file is decoded three times with an end marker appended: right after its bytes, and
    after two different runs of filler bytes. A complete scan ignores the filler (the decoder
    has every block already); a truncated one decodes the filler as image data, so the pixels
    differ. PIL, not OpenCV: libjpeg's warnings would otherwise go to stderr once per file.
    """
    with open(path, "rb") as file:
        data = file.read()
    decoded = []
    for filler in (b"", b"\x00" * 64, b"\x55" * 64):
        try:
            with Image.open(io.BytesIO(data + filler + b"\xff\xd9")) as image:
                decoded.append(np.asarray(image))
        except Exception:  # any decoder failure means "not fully decodable"
            return False
    return all(np.array_equal(decoded[0], other) for other in decoded[1:])


def check_image(path: str) -> tuple[tuple[int, int], str]:
    """Return the EXIF-corrected (width, height) of an image and a note ('' or what was tolerated).

    Raises BadInputError saying why an image is unusable.
    """
    try:
        size = os.path.getsize(path)
        if size == 0:
            raise BadInputError("empty (0-byte) file")
        with Image.open(path) as image:
            image.verify()  # structural check; the object is unusable afterwards
        with Image.open(path) as image:
            image_format, mode, (width, height) = image.format, image.mode, image.size
            orientation = image_orientation(image, path)
    except BadInputError:
        raise
    except FileNotFoundError:  # a .txt image list can name files that are not there
        raise BadInputError("file not found") from None
    except Exception as error:  # PIL raises many types for bad bytes; all mean "not an image"
        raise BadInputError(f"not a readable image ({type(error).__name__}: {error})") from error
    if image_format not in PIL_FORMATS:
        raise BadInputError(f"unsupported image format {image_format}")
    if image_format == "TIFF" and mode in WIDE_TIFF_MODES:  # PIL reads them; OpenCV, which decodes for training, not
        raise BadInputError(f"TIFF with 32-bit samples (mode {mode}) that OpenCV cannot decode; save it as 8 or 16 bit")
    note = ""
    if image_format in ("JPEG", "MPO"):
        with open(path, "rb") as file:
            file.seek(max(0, size - 64))
            has_end_marker = b"\xff\xd9" in file.read()  # 0xFFD9 cannot occur inside entropy-coded data
        if not has_end_marker and not decodes_without_end_marker(path):
            raise BadInputError("truncated JPEG (no end-of-image marker, and image data is missing)")
        if not has_end_marker:
            note = "JPEG without end-of-image marker, but its image data is complete; kept"
    if orientation in (5, 6, 7, 8) and image_format == "TIFF":
        # Pillow (13, at least) reports some TIFFs' size already turned and others not: the decoder decides.
        width, height = _decoded_size(path)
    elif orientation in (5, 6, 7, 8):  # rotated by 90 degrees: the decoder swaps width and height
        width, height = height, width
    if min(width, height) < MIN_IMAGE_SIDE:
        raise BadInputError(f"image size {width}x{height} is below {MIN_IMAGE_SIDE} pixels")
    return (width, height), note


def _decoded_size(path: str) -> tuple[int, int]:
    """(width, height) of the image as training decodes it (OpenCV, EXIF orientation applied); raise if it cannot."""
    # Imported here: it brings in OpenCV and torch, which the scan's worker processes otherwise never load.
    from utils.data.cache import read_image

    decoded = read_image(path)
    if decoded is None:
        raise BadInputError("not a readable image (OpenCV cannot decode it)")
    return int(decoded.shape[1]), int(decoded.shape[0])
