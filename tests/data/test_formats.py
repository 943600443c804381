"""read_idx and read_cifar_batch on real files: exact round trips, and every kind of bad file -> DataError naming it."""

from __future__ import annotations

import gzip
import os
import codecs
import pickle
import struct
import threading
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from dptrain.data.formats import read_cifar_batch, read_idx
from dptrain.errors import DataError

from .datafiles import cifar_batch_bytes, idx_bytes, py2_cifar_batch_bytes, write_cifar_batch, write_idx

RNG = np.random.default_rng(1234)
IMAGES = RNG.integers(0, 256, (57, 28, 28), dtype=np.uint8)
LABELS = RNG.integers(0, 10, 57, dtype=np.uint8)


def assert_names_file(exc_info: pytest.ExceptionInfo, path) -> str:
    message = str(exc_info.value)
    assert str(path) in message, message
    return message


# ---------------------------------------------------------------- IDX: good files


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_read_idx_images_round_trip(tmp_path, gz):
    path = write_idx(tmp_path / ("images.gz" if gz else "images"), IMAGES, gz=gz)
    out = read_idx(path, 3)
    assert out.dtype == torch.uint8
    assert tuple(out.shape) == (57, 28, 28)
    assert np.array_equal(out.numpy(), IMAGES)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_read_idx_labels_round_trip(tmp_path, gz):
    path = write_idx(tmp_path / "labels", LABELS, gz=gz)
    assert path.read_bytes()[:2] == b"\x1f\x8b" if gz else path.read_bytes()[:4] == b"\x00\x00\x08\x01"
    out = read_idx(path, 1)
    assert out.dtype == torch.uint8 and tuple(out.shape) == (57,)
    assert out.tolist() == LABELS.tolist()


def test_read_idx_detects_gzip_by_content_not_name(tmp_path):
    gz_without_suffix = write_idx(tmp_path / "train-labels-idx1-ubyte", LABELS, gz=True)
    raw_with_gz_suffix = write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", LABELS, gz=False)
    assert read_idx(gz_without_suffix, 1).tolist() == LABELS.tolist()
    assert read_idx(raw_with_gz_suffix, 1).tolist() == LABELS.tolist()


def test_read_idx_header_is_big_endian(tmp_path):
    # 2 x 3 x 1 images: a little-endian reader would see 2**25 images and call the file truncated.
    array = np.arange(6, dtype=np.uint8).reshape(2, 3, 1)
    path = tmp_path / "be"
    path.write_bytes(struct.pack(">IIII", 0x803, 2, 3, 1) + array.tobytes())
    assert read_idx(path, 3).tolist() == array.tolist()


def test_read_idx_result_does_not_alias_a_read_only_buffer(tmp_path):
    out = read_idx(write_idx(tmp_path / "l", LABELS), 1)
    out[0] = 255  # np.frombuffer over bytes is read-only; the reader must hand back its own copy
    assert int(out[0]) == 255


# ---------------------------------------------------------------- IDX: bad files


def test_read_idx_wrong_magic(tmp_path):
    path = tmp_path / "bad-magic"
    path.write_bytes(b"\x00\x00\x0d\x03" + idx_bytes(IMAGES)[4:])  # type 0x0d = float, not ubyte
    with pytest.raises(DataError) as info:
        read_idx(path, 3)
    assert "magic" in assert_names_file(info, path)


def test_read_idx_nonzero_leading_magic_bytes(tmp_path):
    path = tmp_path / "bad-lead"
    path.write_bytes(b"\x01\x00\x08\x01" + idx_bytes(LABELS)[4:])
    with pytest.raises(DataError) as info:
        read_idx(path, 1)
    assert_names_file(info, path)


def test_read_idx_wrong_ndim(tmp_path):
    labels_file = write_idx(tmp_path / "labels", LABELS)  # magic 0x00000801
    with pytest.raises(DataError) as info:
        read_idx(labels_file, 3)
    message = assert_names_file(info, labels_file)
    assert "00000801" in message and "00000803" in message


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_read_idx_truncated_data(tmp_path, gz):
    data = idx_bytes(IMAGES)[:-100]
    path = tmp_path / "truncated"
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(DataError) as info:
        read_idx(path, 3)
    assert "truncated" in assert_names_file(info, path)


def test_read_idx_longer_than_header(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(idx_bytes(LABELS) + b"\x00")
    with pytest.raises(DataError) as info:
        read_idx(path, 1)
    assert "longer than its header says" in assert_names_file(info, path)


@pytest.mark.parametrize("dims", [(0xFFFFFFFF, 0xFFFFFFFF), (0x80000000, 0x80000000, 2), (0xFFFFFFFF,) * 3],
                         ids=["wraps-negative-in-int64", "is-int64-min", "wraps-to-a-wrong-positive"])
def test_read_idx_header_sizes_too_large_for_fixed_width_ints(tmp_path, dims):
    """A corrupt header's byte count is the exact product of its sizes, in one sentence, not an int64 wrap-around."""
    path = tmp_path / "corrupt-header"
    path.write_bytes(struct.pack(">I", 0x00000800 | len(dims)) + struct.pack(f">{len(dims)}I", *dims) + bytes(10))
    with pytest.raises(DataError) as info:
        read_idx(path, len(dims))
    expected = 1
    for d in dims:
        expected *= d
    assert str(info.value) == (f"{path} is truncated: its header promises {'x'.join(map(str, dims))} = {expected} bytes "
                               f"of data but it holds 10; download it again.")


@pytest.mark.parametrize("keep", [0, 3, 4, 9, 15])
def test_read_idx_truncated_header(tmp_path, keep):
    path = tmp_path / f"header-{keep}"
    path.write_bytes(idx_bytes(IMAGES)[:keep])  # full header is 4 + 3 * 4 = 16 bytes
    with pytest.raises(DataError) as info:
        read_idx(path, 3)
    assert_names_file(info, path)


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_read_idx_damaged_gzip(tmp_path, damage):
    blob = bytearray(gzip.compress(idx_bytes(IMAGES)))
    if damage == "cut":
        blob = blob[: len(blob) // 2]
    else:  # corrupt the deflate stream in the middle
        for i in range(len(blob) // 2, len(blob) // 2 + 16):
            blob[i] ^= 0xFF
    path = tmp_path / "images.gz"
    path.write_bytes(bytes(blob))
    with pytest.raises(DataError) as info:
        read_idx(path, 3)
    assert "gzip" in assert_names_file(info, path)


# ---------------------------------------------------------------- IDX: gzip bombs

BOMB_ZEROS = 64 << 20  # unpacks from about 64 KB; the reader must never hold it all
BOMB_SLACK = 4 << 20  # what reading a few bytes through gzip may cost on top of the promised payload


def zeros_gzip(header: bytes, zero_bytes: int) -> bytes:
    """header then zero_bytes zeros as one gzip member (about 1000:1), built 1 MiB at a time."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    chunk = bytes(1 << 20)
    parts = [compressor.compress(header)]
    parts += [compressor.compress(chunk) for _ in range(zero_bytes // len(chunk))]
    parts.append(compressor.flush())
    return b"".join(parts)


def refusal_and_peak_bytes(path, ndim: int) -> tuple[str, int]:
    """read_idx's DataError message, and the peak Python-heap bytes (bytes objects, numpy buffers) it allocated
    above what was live before: tracemalloc counts allocations, so the bound holds on any machine."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        with pytest.raises(DataError) as info:
            read_idx(path, ndim)
        return str(info.value), tracemalloc.get_traced_memory()[1] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()


def test_read_idx_gzip_bomb_after_a_short_header_is_refused_without_unpacking_it(tmp_path):
    """A header promising 10 labels, then 64 MiB of zeros: refused after one byte past the promise."""
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(zeros_gzip(struct.pack(">II", 0x801, 10) + bytes(10), BOMB_ZEROS))
    assert path.stat().st_size < BOMB_ZEROS // 500
    message, peak = refusal_and_peak_bytes(path, 1)
    assert peak < BOMB_SLACK
    assert message == (f"{path} is longer than its header says: its header promises 10 = 10 bytes of data "
                       f"but it holds more; download it again.")


def test_read_idx_gzip_header_promising_more_than_the_file_can_unpack_to(tmp_path):
    """4 GiB promised by a 64 KB gzip: deflate expands at most 1032-fold, so no byte of the payload is unpacked."""
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(zeros_gzip(struct.pack(">II", 0x801, 0xFFFFFFFF), BOMB_ZEROS))
    size = path.stat().st_size
    message, peak = refusal_and_peak_bytes(path, 1)
    assert peak < BOMB_SLACK
    assert message == (f"{path} is truncated: its header promises 4294967295 = 4294967295 bytes of data "
                       f"but a gzip file of {size} bytes unpacks to at most {1032 * size}; download it again.")


def test_read_idx_gzip_of_all_zeros_compressed_as_hard_as_zlib_can_still_loads(tmp_path):
    """zlib's best ratio (about 1029:1 on zeros) stays under the 1032:1 bound that refuses impossible headers."""
    images = np.zeros((8 * 1024, 32, 32), np.uint8)
    path = tmp_path / "zeros.gz"
    path.write_bytes(zeros_gzip(struct.pack(">IIII", 0x803, *images.shape), images.size))
    assert images.size / path.stat().st_size > 1000
    out = read_idx(path, 3)
    assert tuple(out.shape) == images.shape and not out.any()


def test_read_idx_plain_file_longer_than_its_header_is_refused_before_its_payload_is_read(tmp_path):
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(struct.pack(">II", 0x801, 10) + bytes(BOMB_ZEROS))
    message, peak = refusal_and_peak_bytes(path, 1)
    assert peak < BOMB_SLACK
    assert message == (f"{path} is longer than its header says: its header promises 10 = 10 bytes of data "
                       f"but it holds {BOMB_ZEROS}; download it again.")


def test_read_idx_payload_larger_than_memory_is_one_sentence(tmp_path, monkeypatch):
    path = write_idx(tmp_path / "images.gz", IMAGES, gz=True)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(np, "empty", no_memory)  # what a header promising more than RAM + swap meets
    with pytest.raises(DataError) as info:
        read_idx(path, 3)
    assert str(info.value) == (f"{path} cannot be loaded: its header promises 57x28x28 = 44688 bytes of data, more than "
                               f"this machine can allocate; check that it is the right file, or load it on a machine "
                               f"with more memory.")


def test_read_idx_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "train-images-idx3-ubyte"
    with pytest.raises(DataError) as info:
        read_idx(path, 3)
    assert "does not exist" in assert_names_file(info, path)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------------- CIFAR-10 batches


def cifar_images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)


@pytest.mark.parametrize("protocol", [3, 4])
def test_read_cifar_round_trip(tmp_path, protocol):
    images, labels = cifar_images(23), list(range(10)) * 2 + [9, 0, 5]
    path = write_cifar_batch(tmp_path / "data_batch_1", images, labels, protocol=protocol)
    out_images, out_labels = read_cifar_batch(path)
    assert out_images.dtype == torch.uint8 and tuple(out_images.shape) == (23, 3, 32, 32)
    assert out_labels.dtype == torch.int64 and out_labels.tolist() == labels
    assert np.array_equal(out_images.numpy(), images)


def test_read_cifar_layout_is_channel_major(tmp_path):
    # Build the 3072-byte rows by hand, as the CIFAR page describes them: 1024 R, 1024 G, 1024 B, each row-major.
    n = 4
    rng = np.random.default_rng(7)
    red, green, blue = (rng.integers(0, 256, (n, 32, 32), dtype=np.uint8) for _ in range(3))
    rows = np.concatenate([red.reshape(n, 1024), green.reshape(n, 1024), blue.reshape(n, 1024)], axis=1)
    assert rows.shape == (n, 3072)
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({b"data": rows, b"labels": [1, 2, 3, 4], b"batch_label": b"x"}, protocol=4))
    images, labels = read_cifar_batch(path)
    assert torch.equal(images[:, 0], torch.from_numpy(red))
    assert torch.equal(images[:, 1], torch.from_numpy(green))
    assert torch.equal(images[:, 2], torch.from_numpy(blue))
    # One pixel spelled out: image 2, green, row 5, column 17 is byte 1024 + 5 * 32 + 17 of its row.
    assert int(images[2, 1, 5, 17]) == int(rows[2, 1024 + 5 * 32 + 17])
    assert labels.tolist() == [1, 2, 3, 4]


def test_read_cifar_python2_pickle_as_in_the_official_files(tmp_path):
    # The official batches were pickled by Python 2: strings as BINSTRING, numpy.core.multiarray._reconstruct.
    images, labels = cifar_images(5, seed=3), [4, 1, 0, 9, 3]
    raw = py2_cifar_batch_bytes(images, labels)
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in raw and b"_codecs" not in raw
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    out_images, out_labels = read_cifar_batch(path)
    assert np.array_equal(out_images.numpy(), images)
    assert out_labels.tolist() == labels


def test_read_cifar_numpy1_module_names(tmp_path):
    # Files pickled under numpy 1 name numpy.core.multiarray; numpy 2 writes numpy._core.multiarray.
    images = cifar_images(3, seed=4)
    raw = cifar_batch_bytes(images, [0, 1, 2], protocol=3)  # protocol 3: GLOBAL opcodes, plain text names
    assert b"cnumpy._core.multiarray\n" in raw or b"cnumpy.core.multiarray\n" in raw
    raw = raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    path = tmp_path / "old"
    path.write_bytes(raw)
    out_images, out_labels = read_cifar_batch(path)
    assert np.array_equal(out_images.numpy(), images) and out_labels.tolist() == [0, 1, 2]


def test_read_cifar_truncated_pickle(tmp_path):
    raw = cifar_batch_bytes(cifar_images(8), list(range(8)))
    path = tmp_path / "data_batch_2"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    assert "not a readable CIFAR-10 batch" in assert_names_file(info, path)


def test_read_cifar_not_a_pickle(tmp_path):
    path = tmp_path / "data_batch_3"
    path.write_bytes(idx_bytes(LABELS))
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    assert_names_file(info, path)


@pytest.mark.parametrize(
    "batch",
    [
        {b"labels": [1, 2]},
        {b"data": np.zeros((2, 3072), np.uint8)},
        {"data": np.zeros((2, 3072), np.uint8), "labels": [1, 2]},  # str keys: not the CIFAR file's bytes keys
        [np.zeros((2, 3072), np.uint8), [1, 2]],
    ],
    ids=["no-data", "no-labels", "str-keys", "not-a-dict"],
)
def test_read_cifar_missing_keys(tmp_path, batch):
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps(batch, protocol=4))
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    assert "b'data'" in assert_names_file(info, path)


@pytest.mark.parametrize(
    "data",
    [np.zeros((2, 3000), np.uint8), np.zeros((2, 3, 32, 32), np.uint8), np.zeros((2, 3072), np.int64), [[0] * 3072] * 2],
    ids=["short-rows", "4d", "int64", "list"],
)
def test_read_cifar_wrong_data_shape(tmp_path, data):
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({b"data": data, b"labels": [0, 1]}, protocol=4))
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    assert "3072" in assert_names_file(info, path)


def test_read_cifar_label_count_mismatch(tmp_path):
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2]}, protocol=4))
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    message = assert_names_file(info, path)
    assert "4 images" in message and "3 labels" in message


def test_read_cifar_missing_file(tmp_path):
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    assert "does not exist" in assert_names_file(info, path)


# ---------------------------------------------------------------- CIFAR-10: pickles that would run code

class Payload:
    """A class of this test module: pickled by reference, and its __setstate__ writes a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __setstate__(self, state: dict) -> None:  # runs on unpickling if the class is ever loaded
        open(state["marker"], "w").close()  # noqa: SIM115
        self.__dict__.update(state)


class SystemCall:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class ExecCall:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def test_payload_class_really_would_run(tmp_path):
    # Control for the refusals below: with the plain unpickler the marker does get written.
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()


@pytest.mark.parametrize("protocol", [2, 4])  # 2: Python 3 writes bytes through _codecs.encode, admitted for data only
@pytest.mark.parametrize("kind", ["module-class", "os.system", "builtins.exec"])
def test_read_cifar_refuses_disallowed_globals(tmp_path, kind, protocol):
    marker = tmp_path / f"pwned-{kind}"
    evil = {
        "module-class": lambda: Payload(str(marker)),
        "os.system": lambda: SystemCall(f"touch '{marker}'"),
        "builtins.exec": lambda: ExecCall(f"open({str(marker)!r}, 'w').close()"),
    }[kind]()
    # The payload sits inside an otherwise valid batch, where a careless loader would run it.
    raw = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"batch_label": evil}, protocol=protocol)
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    message = assert_names_file(info, path)
    assert "refusing to load" in message
    assert not marker.exists(), "the pickle's code ran"


def test_read_cifar_batch_pickled_with_protocol_5(tmp_path):
    images = np.arange(2 * 3 * 32 * 32, dtype=np.uint8).reshape(2, 3, 32, 32)
    path = write_cifar_batch(tmp_path / "p5", images, [3, 4], protocol=5)
    got_images, got_labels = read_cifar_batch(path)
    assert torch.equal(got_images, torch.from_numpy(images)) and got_labels.tolist() == [3, 4]


@pytest.mark.parametrize("labels", [5, "ab", [0.5, 1.5]])
def test_read_cifar_batch_labels_of_the_wrong_type(tmp_path, labels):
    path = tmp_path / "bad_labels"
    data = np.zeros((2, 3 * 32 * 32), np.uint8)
    path.write_bytes(pickle.dumps({b"data": data, b"labels": labels}))
    with pytest.raises(DataError, match="labels of type .* but a list of integers was expected") as info:
        read_cifar_batch(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------- CIFAR-10: protocol 2 pickles written by Python 3


def test_python3_protocol_2_pickles_bytes_through_codecs_encode():
    # Why the reader admits _codecs.encode: Python 3 has no protocol-2 opcode for bytes.
    raw = cifar_batch_bytes(cifar_images(1), [0], protocol=2)
    assert b"c_codecs\nencode\n" in raw and b"latin1" in raw


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_read_cifar_batches_of_every_python3_protocol_load_alike(tmp_path, protocol):
    images, labels = cifar_images(6, seed=protocol), [7, 0, 3, 3, 9, 1]
    path = write_cifar_batch(tmp_path / f"data_batch_p{protocol}", images, labels, protocol=protocol)
    out_images, out_labels = read_cifar_batch(path)
    assert out_images.dtype == torch.uint8 and tuple(out_images.shape) == (6, 3, 32, 32)
    assert np.array_equal(out_images.numpy(), images) and out_labels.tolist() == labels


def test_read_cifar_protocol_2_empty_batch_and_numpy_labels(tmp_path):
    # Python 3 pickles b"" under protocol 2 as __builtin__.bytes(), and numpy integers through numpy's scalar().
    path = tmp_path / "empty"
    path.write_bytes(pickle.dumps({b"data": np.zeros((0, 3072), np.uint8), b"labels": np.zeros(0, np.int64),
                                   b"batch_label": b""}, protocol=2))
    assert b"c__builtin__\nbytes\n" in path.read_bytes()
    images, labels = read_cifar_batch(path)
    assert tuple(images.shape) == (0, 3, 32, 32) and labels.tolist() == []
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [np.int64(4), np.uint8(2)]},
                                  protocol=2))
    assert read_cifar_batch(path)[1].tolist() == [4, 2]


class CodecCall:
    def __init__(self, *args) -> None:
        self.args = args

    def __reduce__(self):
        return (codecs.encode, self.args)


class BytesCall:
    def __reduce__(self):
        return (bytes, (1 << 40,))  # a terabyte of zeros, if honoured


@pytest.mark.parametrize("call", [CodecCall("text", "rot13"), CodecCall(b"data", "latin1"), CodecCall("text"),
                                  BytesCall()], ids=["other-codec", "bytes-argument", "no-encoding", "bytes-of-size"])
def test_read_cifar_admits_only_the_calls_protocol_2_writes(tmp_path, call):
    raw = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"batch_label": call}, protocol=2)
    assert b"c_codecs\nencode\n" in raw or b"c__builtin__\nbytes\n" in raw
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    with pytest.raises(DataError) as info:
        read_cifar_batch(path)
    assert "refusing to call" in assert_names_file(info, path)




# ---------------------------------------------------------------- what is no regular file

def returns_within(call, seconds: float = 30.0):
    """call()'s outcome (its value or the exception it raised), from a thread: a read that blocks on a FIFO or runs
    on through a device never returns, and the bound says so instead of hanging the suite."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"{call} did not return within {seconds:g} s"
    return outcome[0]


@pytest.mark.parametrize("reader, name, planted", [
    (lambda path: read_idx(path, 3), "train-images-idx3-ubyte", "fifo"),
    (lambda path: read_idx(path, 1), "t10k-labels-idx1-ubyte.gz", "link to /dev/zero"),
    (read_cifar_batch, "data_batch_1", "fifo"),  # (not /dev/zero: before the fix it read on until memory ran out)
], ids=["idx fifo", "idx link to /dev/zero", "cifar fifo"])
def test_a_dataset_file_that_is_no_regular_file_is_refused_without_waiting_on_it(tmp_path, reader, name, planted):
    # A FIFO named as a dataset file hung `dptrain train` and `dptrain doctor` for ever (the open waited for a writer).
    path = tmp_path / name
    if planted == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    error = returns_within(lambda: reader(path))
    kind = "a FIFO" if planted == "fifo" else "a character device"
    assert isinstance(error, DataError) and str(error) == (f"{path} is {kind}, not a regular file; put the dataset's own "
                                                           f"file there, or give another --data.root.")
