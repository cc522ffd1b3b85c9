"""Opening (possibly compressed) input files so that a damaged file is an error naming it.

Python's decompressors report a damaged stream in five ways (``EOFError`` for a truncated gzip,
xz or bz2 stream, ``gzip.BadGzipFile``, ``lzma.LZMAError``, a bare ``OSError`` from bz2 and
``zstandard.ZstdError``), and one not at all: ``zstandard``'s stream reader across frames stops at
the end of the last *complete* frame of a truncated multi-frame ``.zst`` without a word, so the
documents of the cut frame are lost silently. :func:`open_input` wraps every decompressor in a
reader that turns each of those into :class:`~data_tools.errors.PreprocessError` naming the file,
the compression, how far it got, and the fix; zstd frames are decoded one by one so that a file
that ends inside a frame is detected.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from pathlib import Path
from typing import BinaryIO

from data_tools.errors import PreprocessError

__all__ = ["open_input"]

_READ = 1 << 20  # bytes of compressed input per read


def _damaged(path: Path, compression: str, produced: int, err: BaseException | str) -> PreprocessError:
    return PreprocessError(
        f"{path}: the {compression} stream is truncated or damaged after {produced:,} decompressed "
        f"bytes ({err}); nothing was written: re-copy or re-download the file (check it with "
        f"'{_TEST_COMMAND[compression]} {path}'), or leave it out of --input"
    )


_TEST_COMMAND = {"gzip": "gzip -t", "xz": "xz -t", "bz2": "bzip2 -t", "zstd": "zstd -t"}


class _CheckedReader(io.RawIOBase):
    """A raw reader over a decompressor file object that names the file when the stream is bad."""

    def __init__(self, inner: BinaryIO, path: Path, compression: str) -> None:
        self._inner, self._path, self._compression = inner, path, compression
        self._produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            n = self._inner.readinto(buffer)
        except (EOFError, OSError, lzma.LZMAError) as e:  # BadGzipFile is an OSError
            raise _damaged(self._path, self._compression, self._produced, e) from None
        self._produced += n
        return n

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            super().close()


class _ZstdFrames(io.RawIOBase):
    """Decompresses a ``.zst`` file frame after frame and refuses one that ends inside a frame.

    ``zstandard``'s ``stream_reader(read_across_frames=True)`` returns end-of-file at the end of
    the last complete frame of a truncated file; here each frame gets its own decompression object
    and the input must end exactly where a frame does (``eof`` set, no data left over).
    """

    def __init__(self, path: Path) -> None:
        import zstandard

        self._zstd = zstandard
        self._path = path
        self._raw = open(path, "rb")  # noqa: SIM115 (closed in close())
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False  # some bytes of the current frame were fed in
        self._pending = b""
        self._produced = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        """Decompress until some output is pending or the file ends (checked)."""
        while not self._pending and not self._done:
            chunk = self._raw.read(_READ)
            if not chunk:
                if self._in_frame:
                    raise _damaged(self._path, "zstd", self._produced, "the file ends inside a frame")
                self._done = True
                return
            while chunk:
                self._in_frame = True
                try:
                    self._pending += self._obj.decompress(chunk)
                except self._zstd.ZstdError as e:
                    raise _damaged(self._path, "zstd", self._produced, e) from None
                if not self._obj.eof:
                    break
                # The frame is complete: what followed it starts the next frame.
                chunk = self._obj.unused_data
                self._obj = self._dctx.decompressobj()
                self._in_frame = False

    def readinto(self, buffer) -> int:
        self._fill()
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._produced += n
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def open_input(path: Path, compression: str | None) -> BinaryIO:
    """Open an input file for binary reading, decompressing ``gzip`` / ``xz`` / ``bz2`` / ``zstd``.

    Args:
        path: the input file.
        compression: ``None`` or one of ``"gzip"``, ``"xz"``, ``"bz2"``, ``"zstd"``.

    Returns:
        A buffered binary reader (1 MiB buffer).

    Raises:
        PreprocessError: while reading, for a stream that is not of its compression (a fake
            ``.gz``) or ends early (a truncated file, a ``.zst`` cut inside a frame); the message
            names the file, how many bytes were decompressed and the fix.
    """
    if compression is None:
        return open(path, "rb", buffering=1 << 20)
    if compression == "zstd":
        return io.BufferedReader(_ZstdFrames(path), buffer_size=1 << 20)
    opener = {"gzip": gzip.open, "xz": lzma.open, "bz2": bz2.open}[compression]
    return io.BufferedReader(_CheckedReader(opener(path, "rb"), path, compression), buffer_size=1 << 20)
