"""Read back the PNGs tracelake draws (``tracelake.drawing.heatmap_png``: 8-bit RGB, one
IDAT stream, filter 0 on every row), checking each chunk's CRC: for the tests."""

from __future__ import annotations

import struct
import zlib

import numpy as np


def png_pixels(data: bytes) -> np.ndarray:
    """The (height, width, 3) RGB pixels of ``data``."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, kinds = 8, b"", 0, 0, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        kinds.append(kind)
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2)  # 8-bit RGB
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, 3)
