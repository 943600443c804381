"""Readers for the tutorials' file formats -> uint8 tensors, checking everything a bad file can get wrong.

IDX (MNIST, FashionMNIST): a 4-byte magic (0, 0, type 0x08 = ubyte, number of dimensions), then
one big-endian int32 per dimension, then the data. Gzipped or raw; gzip is detected by content, and the
header is checked before the data is unpacked, so a gzip bomb costs no more memory than its header promises.
CIFAR-10 python batches: pickled dicts with b"data" (N x 3072 uint8, channel-major) and b"labels".
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import io
import math
import os
import pickle
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from dptrain.errors import DataError
from dptrain.read_back import NotRegularFile, not_regular_problem, open_regular

GZIP_MAGIC = b"\x1f\x8b"
IDX_UBYTE = 0x08
CIFAR_IMAGE_BYTES = 3 * 32 * 32
# Deflate cannot expand its input more than 1032-fold (one 258-byte match per 2 bits), so a gzip file of C bytes
# unpacks to at most DEFLATE_MAX_RATIO * C: a header promising more is refused before anything is unpacked.
DEFLATE_MAX_RATIO = 1032
# The payload is unpacked into its tensor this many bytes at a time: reading in chunks keeps only the bytes the
# stream really holds resident, and costs one small temporary bytes object per chunk.
READ_CHUNK_BYTES = 1 << 20


def open_data_file(path: Path) -> BinaryIO:
    """A dataset file opened for reading, if it is a regular file (after links): a FIFO would block the read for ever,
    a link to /dev/zero never end it. DataError in one sentence otherwise, read_back.open_regular's check."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; check data.root or use --data.download true.") from None
    except NotRegularFile as exc:
        raise DataError(f"{path} {not_regular_problem(exc)}; put the dataset's own file there, or give another "
                        f"--data.root.") from None
    except OSError as exc:
        raise DataError(f"{path} cannot be read ({exc.strerror or type(exc).__name__}); make it readable for you, or "
                        f"give another --data.root.") from None


def read_idx(path: str | Path, expect_ndim: int) -> torch.Tensor:
    """An IDX file of unsigned bytes as a uint8 tensor of expect_ndim dimensions.

    The header is read and checked first, then exactly the bytes it promises: a gzip bomb (a short header followed
    by gigabytes of zeros) is refused after unpacking one byte more than the header promised, not all of it.
    """
    path = Path(path)
    with open_data_file(path) as file:
        file_size = os.fstat(file.fileno()).st_size
        is_gzip = file.read(2) == GZIP_MAGIC
        file.seek(0)
        stream = gzip.GzipFile(fileobj=file, mode="rb") if is_gzip else file
        try:
            return _read_idx_stream(path, stream, expect_ndim, file_size, is_gzip)
        except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError; a cut stream an EOFError
            if not is_gzip:
                raise
            raise DataError(f"{path} is a damaged gzip file ({exc}); delete it and download it again.") from None


def _read_idx_stream(path: Path, stream: BinaryIO, expect_ndim: int, file_size: int, is_gzip: bool) -> torch.Tensor:
    magic = stream.read(4)
    if len(magic) < 4:
        raise DataError(f"{path} is too short to be an IDX file ({len(magic)} bytes); download it again.")
    zero1, zero2, dtype, ndim = magic
    if zero1 or zero2 or dtype != IDX_UBYTE or ndim != expect_ndim:
        raise DataError(
            f"{path} has IDX magic {magic.hex()} but 0000080{expect_ndim} was expected "
            f"(unsigned bytes, {expect_ndim} dimensions); it is not the right file or is corrupt."
        )
    sizes = stream.read(4 * ndim)
    if len(sizes) < 4 * ndim:
        raise DataError(f"{path} is truncated inside its header; download it again.")
    dims = [int.from_bytes(sizes[4 * i : 4 * i + 4], "big") for i in range(ndim)]
    # Python ints: np.prod multiplies in a fixed-width int (int64, or int32 on Windows under numpy 1),
    # and a corrupt header's sizes (0xFFFFFFFF each) wrap it to a wrong or negative byte count.
    expected = math.prod(dims)
    promise = f"its header promises {'x'.join(map(str, dims))} = {expected} bytes of data"
    if not is_gzip:  # a plain file's payload size is known before reading it
        actual = file_size - 4 - 4 * ndim
        if actual != expected:
            what = "truncated" if actual < expected else "longer than its header says"
            raise DataError(f"{path} is {what}: {promise} but it holds {actual}; download it again.")
    elif expected > DEFLATE_MAX_RATIO * file_size:
        raise DataError(f"{path} is truncated: {promise} but a gzip file of {file_size} bytes unpacks to at most "
                        f"{DEFLATE_MAX_RATIO * file_size}; download it again.")
    try:  # np.empty only reserves address space; pages become resident as the stream fills them
        array = np.empty(expected, dtype=np.uint8)
    except MemoryError:
        raise DataError(f"{path} cannot be loaded: {promise}, more than this machine can allocate; "
                        f"check that it is the right file, or load it on a machine with more memory.") from None
    actual = _fill(stream, memoryview(array))
    if actual < expected:
        raise DataError(f"{path} is truncated: {promise} but it holds {actual}; download it again.")
    if stream.read(1):  # one byte past the promise is enough to know; the rest is never unpacked
        raise DataError(f"{path} is longer than its header says: {promise} but it holds more; download it again.")
    return torch.from_numpy(array.reshape(dims))


def _fill(stream: BinaryIO, buffer: memoryview) -> int:
    """Reads into buffer until it is full or the stream ends; returns the number of bytes read."""
    filled = 0
    while filled < len(buffer):
        n = stream.readinto(buffer[filled : filled + READ_CHUNK_BYTES])
        if not n:
            break
        filled += n
    return filled


def _latin1_bytes(*args: object) -> bytes:
    """Stands in for _codecs.encode, which Python 3 names to pickle bytes under protocol 2:
    bytes b are written as _codecs.encode(b.decode("latin1"), "latin1"). Only that call is honoured: the real
    _codecs.encode would run whichever registered codec the file names (third-party packages register their own)."""
    if len(args) != 2 or not isinstance(args[0], str) or args[1] != "latin1":
        kinds = ", ".join(type(arg).__name__ for arg in args)  # types only: the arguments may be megabytes long
        raise pickle.UnpicklingError(f"refusing to call _codecs.encode({kinds}) other than on a str with encoding 'latin1'")
    return args[0].encode("latin1")


def _empty_bytes(*args: object) -> bytes:
    """Stands in for bytes, which Python 3 names to pickle b"" under protocol 2 (as bytes()): only the call without
    arguments is honoured, since bytes(n) with n from a hostile file would allocate n bytes."""
    if args:
        raise pickle.UnpicklingError(f"refusing to call bytes with {len(args)} arguments")
    return b""


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a CIFAR file cannot run code on load."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),  # arrays pickled with protocol 5
        ("numpy._core.numeric", "_frombuffer"),
    }
    # Globals answered by a checked stand-in rather than the real function.
    SUBSTITUTES = {
        ("_codecs", "encode"): _latin1_bytes,  # bytes (an array's data, a batch's keys) pickled with protocol 2 by Python 3
        ("__builtin__", "bytes"): _empty_bytes,  # b"" (the data of an empty array) likewise; Python 3 name mapped to 2's
        ("builtins", "bytes"): _empty_bytes,  # the same, pickled with fix_imports=False
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's signature
        if (module, name) in self.SUBSTITUTES:
            return self.SUBSTITUTES[module, name]
        if (module, name) in self.ALLOWED:
            # Files pickled under numpy 1 name numpy.core, under numpy 2 numpy._core; take whichever exists.
            for candidate in (module.replace("numpy.core.", "numpy._core."), module.replace("numpy._core.", "numpy.core.")):
                with contextlib.suppress(ImportError, AttributeError):
                    return getattr(importlib.import_module(candidate), name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_cifar_batch(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 python batch -> (N x 3 x 32 x 32 uint8, N int64 labels)."""
    path = Path(path)
    with open_data_file(path) as file:
        raw = file.read()
    try:
        batch = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # truncation surfaces as EOFError, UnpicklingError, ValueError...
        raise DataError(f"{path} is not a readable CIFAR-10 batch ({type(exc).__name__}: {exc}); download it again.") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path} lacks the b'data' and b'labels' entries of a CIFAR-10 batch; it is not the right file.")
    data, labels = batch[b"data"], batch[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != CIFAR_IMAGE_BYTES:
        shape = getattr(data, "shape", None)
        raise DataError(f"{path} holds data of shape {shape} but N x {CIFAR_IMAGE_BYTES} uint8 was expected; download it again.")
    if not isinstance(labels, (list, tuple, np.ndarray)) or not all(isinstance(x, (int, np.integer)) for x in labels):
        raise DataError(f"{path} holds labels of type {type(labels).__name__} but a list of integers was expected; download it again.")
    if len(labels) != data.shape[0]:
        raise DataError(f"{path} holds {data.shape[0]} images but {len(labels)} labels; download it again.")
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return images, torch.as_tensor(np.asarray(labels, dtype=np.int64))
