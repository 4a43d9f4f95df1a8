"""A tiny PNG writer and a 5x7 bitmap font, so charts need no plotting library.

`Canvas` is an RGB pixel grid with rectangles and text; `Canvas.png()` encodes
it as an 8-bit truecolour PNG (one IDAT chunk, zlib, filter 0 on every row),
which every viewer reads. The font covers upper-case letters, digits and the
punctuation charts need; lower case is drawn as upper case.
"""

from __future__ import annotations

import struct
import zlib

# each glyph: 7 rows of 5 columns, "#" = ink
_GLYPHS = {
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "####.#...##...##...##...##...#####.",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#.#..#.#..#..##..",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##...##...##...##...#", "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#..#.#..", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    " ": "...................................", ".": "..........................##...##..",
    ",": ".....................##...#...#....", ":": ".....##...##.........##...##.......",
    "-": "................###................", "/": "....#...#....#...#...#....#...#....",
    "(": "...#...#...#....#....#.....#.....#.", ")": ".#.....#.....#....#....#...#...#...",
    "%": "##...##..#...#...#...#...#..##...##", "+": ".......#....#..#####..#....#.......",
    "=": "..........#####.....#####..........", "_": "..............................#####",
    "'": "..#....#...........................", "*": ".......#..#.#.#.###.#.#.#..#.......",
    "<": "...#...#...#...#.....#.....#.....#.", ">": ".#.....#.....#.....#...#...#...#...",
    "?": ".###.#...#....#...#...#.........#..", "[": ".###..#....#....#....#....#....###.",
    "]": ".###....#....#....#....#....#..###.", "!": "..#....#....#....#....#.........#..",
}
GLYPH_W, GLYPH_H = 5, 7


def _glyph_rows(ch: str) -> list[str]:
    bits = _GLYPHS.get(ch.upper(), _GLYPHS["?"]).ljust(35, ".")[:35]
    return [bits[r * 5:(r + 1) * 5] for r in range(7)]


class Canvas:
    """``width x height`` RGB pixels, white to start; coordinates from the top left."""

    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x: int, y: int, w: int, h: int, color) -> None:
        """A filled rectangle, clipped to the canvas."""
        x0, y0, x1, y1 = max(0, x), max(0, y), min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0 or y1 <= y0:
            return
        row = bytes(color) * (x1 - x0)
        for yy in range(y0, y1):
            start = (yy * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, color=(0, 0, 0), scale: int = 2) -> None:
        """``text`` with its top left at ``(x, y)``; each font pixel is ``scale`` x ``scale``."""
        for i, ch in enumerate(text):
            for r, bits in enumerate(_glyph_rows(ch)):
                for c, bit in enumerate(bits):
                    if bit == "#":
                        self.rect(x + (i * (GLYPH_W + 1) + c) * scale, y + r * scale, scale, scale, color)

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return max(len(text) * (GLYPH_W + 1) - 1, 0) * scale

    def png(self) -> bytes:
        """The canvas as PNG bytes."""
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
        return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """``(width, height, RGB bytes)`` of a PNG this module wrote (filter 0 only); for tests and checks."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if zlib.crc32(kind + body) & 0xFFFFFFFF != struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]:
            raise ValueError(f"bad CRC in chunk {kind!r}")
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * 3 + 1
    return width, height, b"".join(raw[y * stride + 1:(y + 1) * stride] for y in range(height))
