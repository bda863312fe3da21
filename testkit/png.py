"""A small PNG reader for tests that look at screenshots (8-bit RGB/RGBA, not interlaced: what
headless Chromium writes). Pillow would do, but is not a dependency; numpy is.

Follows the PNG specification (RFC 2083 / W3C PNG, "Filter algorithms"): the IDAT stream is one
zlib stream of scanlines, each led by its filter type byte.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import numpy.typing as npt

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {2: 3, 6: 4}  # colour type -> bytes per pixel at bit depth 8


class PngError(ValueError):
    pass


def _paeth_row(row: bytearray, prev: bytes, bpp: int) -> None:
    for i in range(len(row)):
        a = row[i - bpp] if i >= bpp else 0
        b = prev[i]
        c = prev[i - bpp] if i >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        row[i] = (row[i] + pred) & 0xFF


def decode(data: bytes) -> npt.NDArray[np.uint8]:
    """The image as an array of shape (height, width, channels)."""
    if not data.startswith(SIGNATURE):
        raise PngError("not a PNG file")
    pos = len(SIGNATURE)
    ihdr = None
    idat = bytearray()
    while pos + 8 <= len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    if ihdr is None:
        raise PngError("no IHDR chunk")
    width, height, depth, colour, _, _, interlace = ihdr
    if depth != 8 or colour not in _CHANNELS or interlace:
        raise PngError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    bpp = _CHANNELS[colour]
    stride = width * bpp
    raw = zlib.decompress(bytes(idat))
    if len(raw) < height * (stride + 1):
        raise PngError("truncated image data")
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        off = y * (stride + 1)
        ftype = raw[off]
        line = np.frombuffer(raw, dtype=np.uint8, count=stride, offset=off + 1)
        if ftype == 0:
            cur = line.copy()
        elif ftype == 1:  # Sub: a running sum along the row, per channel (mod 256)
            cur = (np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint64) & 0xFF).astype(np.uint8).ravel()
        elif ftype == 2:  # Up
            cur = line + prev
        elif ftype == 3:  # Average: sequential along the row
            row = bytearray(line.tobytes())
            pb = prev.tobytes()
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                row[i] = (row[i] + ((a + pb[i]) >> 1)) & 0xFF
            cur = np.frombuffer(bytes(row), dtype=np.uint8)
        elif ftype == 4:
            row = bytearray(line.tobytes())
            _paeth_row(row, prev.tobytes(), bpp)
            cur = np.frombuffer(bytes(row), dtype=np.uint8)
        else:
            raise PngError(f"bad filter type {ftype} on row {y}")
        out[y] = cur
        prev = out[y]
    return out.reshape(height, width, bpp)
