"""Class probabilities for new inputs: what they must look like, how they are read, shared out and written.

    $ dptrain predict --checkpoint runs/fashion-mnist_mnist-cnn_ddp --input new.npy --nproc-per-node 2 --output predictions.csv

A snapshot's manifest records, under "input", what the model was trained on: image shape [C, H, W],
the per-channel mean and std of the normalisation, the number of classes and the dataset's name.
Inputs are an IDX images file (gzipped or raw), a `.npy` array of pixel values 0..255, or a folder
of PNG/JPEG images (resized to H x W; PNG or JPEG by content, whatever the suffix). Only regular files are read
(a symbolic link to one is followed): a FIFO would block the read for ever. They are normalised as the training
loader did (x/255 - mean) / std.
Each rank reads and predicts only its share of every batch (no collective inside the loop); rank 0
gathers the shares once at the end and writes one row per input, in input order, atomically.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol

import numpy as np
import torch
from torch import nn

from dptrain.config import RunConfig
from dptrain.data import input_record
from dptrain.data.formats import read_idx
from dptrain.data.sharding import num_batches, rank_batch_positions
from dptrain.data.spec import Normalise
from dptrain.errors import ConfigError, DataError
from dptrain.files import check_replaceable, written_atomically
from dptrain.read_back import NotRegularFile, open_regular, special_kind

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
IMAGE_FORMATS = ["PNG", "JPEG"]  # the Pillow decoders predict uses: never EPS (Ghostscript) or others, whatever the suffix
GIVE_INPUTS = "give an IDX images file, a .npy array or a folder of PNG/JPEG images"
FIRST_NAMED = 3  # unreadable inputs named in the error sentence; the rest are counted
IMAGE_MODES = {1: "L", 3: "RGB"}  # Pillow's mode for the model's number of channels


@dataclass(frozen=True)
class InputSpec:
    """What the model takes: the manifest's "input" entry, checked."""

    shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    dataset: str

    @classmethod
    def from_record(cls, record: Any, where: str) -> "InputSpec":
        """ConfigError if the record is not a well-formed "input" entry (where: what holds it, for the message)."""
        try:
            shape = tuple(int(x) for x in record["shape"])
            spec = cls(shape=shape, mean=tuple(float(x) for x in record["mean"]),  # type: ignore[arg-type]  # length checked below
                       std=tuple(float(x) for x in record["std"]), num_classes=int(record["num_classes"]),
                       dataset=str(record["dataset"]))
            good = (len(shape) == 3 and min(shape) > 0 and len(spec.mean) == len(spec.std) == shape[0]
                    and all(s > 0 and math.isfinite(s) for s in spec.std) and all(map(math.isfinite, spec.mean))
                    and spec.num_classes >= 1)
        except (KeyError, TypeError, ValueError):
            good = False
        if not good:
            raise ConfigError(f"{where} has a damaged \"input\" entry (shape, mean, std, num_classes, dataset); it cannot be used.")
        return spec

    def record(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "mean": list(self.mean), "std": list(self.std),
                "num_classes": self.num_classes, "dataset": self.dataset}


def snapshot_input(manifest: dict[str, Any], cfg: RunConfig, snapshot: Path) -> InputSpec:
    """The snapshot's "input" entry; for snapshots written before it existed, rebuilt from the run's config."""
    record = manifest["input"] if "input" in manifest else input_record(cfg.data)
    if record is None:
        raise ConfigError(f"snapshot {snapshot} was trained on data.name {cfg.data.name}, a Dataset of yours whose image "
                          f"size and normalisation dptrain does not know, so predict cannot prepare new inputs for it; "
                          f"run your own model on your own data loading instead.")
    return InputSpec.from_record(record, f"snapshot {snapshot}")


# ---------------------------------------------------------------- inputs


def resolve_input(raw: str) -> Path:
    """--input as an absolute path without symbolic links (the workers may start elsewhere); DataError for a link loop."""
    try:
        return Path(raw).resolve()
    except RuntimeError:  # Python < 3.13 reports a symbolic link loop as RuntimeError, not OSError
        raise DataError(loop_sentence(raw)) from None
    except OSError as exc:
        raise DataError(loop_sentence(raw) if exc.errno == errno.ELOOP else f"--input {raw} cannot be read "
                        f"({exc.strerror}); {GIVE_INPUTS}.") from None


def loop_sentence(path: str | Path) -> str:
    """The refusal of an --input that is a symbolic link loop (ELOOP), wherever it is met."""
    return f"--input {path} is a symbolic link that leads round a loop of links to no file; {GIVE_INPUTS}."


def input_kind(path: Path) -> int:
    """path's stat mode (following links): a folder or a regular file; DataError in one sentence for anything else."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"--input {path} does not exist; {GIVE_INPUTS}.") from None
    except OSError as exc:
        raise DataError(loop_sentence(path) if exc.errno == errno.ELOOP else f"--input {path} cannot be read "
                        f"({exc.strerror}); {GIVE_INPUTS}.") from None
    kind = special_kind(mode)
    if kind is not None and not stat.S_ISDIR(mode):
        raise DataError(f"--input {path} is {kind}, not a regular file; {GIVE_INPUTS}.")
    return mode


class Inputs(Protocol):
    """New inputs, read a slice at a time (each rank reads only its share)."""

    def __len__(self) -> int: ...

    def source(self, i: int) -> str:
        """What the CSV's source column says: the file name for images, empty for an array's rows."""
        ...

    def name(self, i: int) -> str:
        """The input as an error sentence names it."""
        ...

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, list[int], dict[int, str]]:
        """(float pixels 0..255 of the readable ones, N x C x H x W; their positions; {position: why} for the others)."""
        ...


class ArrayInputs:
    """Rows of an N x C x H x W array (a uint8 tensor from IDX, or a memory-mapped .npy) of pixel values 0..255."""

    def __init__(self, pixels: Any, path: Path) -> None:
        self.pixels, self.path = pixels, path

    def __len__(self) -> int:
        return len(self.pixels)

    def source(self, i: int) -> str:
        return ""

    def name(self, i: int) -> str:
        return f"{self.path.name}[{i}]"

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, list[int], dict[int, str]]:
        part = self.pixels[start:stop]
        # A copy either way: the memory map stays read-only, and only this slice of it is read.
        rows = part.float() if isinstance(part, torch.Tensor) else torch.from_numpy(np.array(part, dtype=np.float32))
        flat = rows.flatten(1)
        finite = flat.isfinite().all(1)
        in_range = ((flat >= 0) & (flat <= 255)).all(1) & finite
        bad = {start + i: ("NaN or infinite values" if not finite[i] else "values outside 0..255, where pixel values are expected")
               for i in (~in_range).nonzero().flatten().tolist()}
        return rows[in_range], [start + i for i in in_range.nonzero().flatten().tolist()], bad


class ImageFiles:
    """PNG/JPEG files, decoded with Pillow, turned upright, converted to the model's channels and resized to H x W."""

    def __init__(self, paths: list[Path], spec: InputSpec) -> None:
        self.paths, self.spec = paths, spec

    def __len__(self) -> int:
        return len(self.paths)

    def source(self, i: int) -> str:
        return self.paths[i].name

    def name(self, i: int) -> str:
        return self.paths[i].name

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, list[int], dict[int, str]]:
        from PIL import UnidentifiedImageError  # only predict on a folder needs Pillow

        images, ok, bad = [], [], {}
        for i in range(start, stop):
            try:
                file = open_regular(self.paths[i])
            except NotRegularFile as exc:  # a FIFO named x.png would block the read for ever
                bad[i] = str(exc.strerror)
                continue
            except OSError as exc:  # a broken or looping link, no permission
                bad[i] = f"cannot be opened: {exc.strerror}"
                continue
            with file:
                try:
                    images.append(self._decode(file))
                    ok.append(i)
                except UnidentifiedImageError:  # another format by content (GIF, BMP, EPS ...), whatever the suffix
                    bad[i] = "not a PNG or JPEG image by its content"
                except Exception as exc:  # noqa: BLE001 - a damaged file can raise almost anything from a decoder
                    bad[i] = f"not a readable PNG or JPEG image: {type(exc).__name__}"
        c, h, w = self.spec.shape
        return (torch.stack(images) if images else torch.empty(0, c, h, w)), ok, bad

    def _decode(self, file: BinaryIO) -> torch.Tensor:
        from PIL import Image, ImageOps

        c, h, w = self.spec.shape
        with Image.open(file, formats=IMAGE_FORMATS) as image:
            image = ImageOps.exif_transpose(image).convert(IMAGE_MODES[c])  # decodes it whole: a truncated file fails here
            if image.size != (w, h):
                image = image.resize((w, h), Image.Resampling.BILINEAR)  # stretched to the model's size, as documented
            pixels = np.asarray(image, dtype=np.float32)
        return torch.from_numpy(pixels.reshape(h, w, c).transpose(2, 0, 1).copy())


def open_inputs(path: Path, spec: InputSpec) -> Inputs:
    """The inputs at path, checked as a whole (DataError naming the file): a folder or single PNG/JPEG, a .npy, or IDX."""
    is_folder = stat.S_ISDIR(input_kind(path))  # a FIFO, device or link loop is refused here, before any open
    if is_folder or path.suffix.lower() in IMAGE_SUFFIXES:
        return _open_images(path, spec, is_folder)
    if path.suffix.lower() == ".npy":
        pixels = _open_npy(path)
    else:
        pixels = read_idx(path, 3 if spec.shape[0] == 1 else 4)
    if pixels.ndim == 3 and spec.shape[0] == 1:  # N x H x W: one channel, as MNIST's IDX files
        pixels = pixels[:, None]
    if tuple(pixels.shape[1:]) != spec.shape:
        want = "x".join(map(str, spec.shape))
        one = " (or N x H x W)" if spec.shape[0] == 1 else ""
        raise DataError(f"{path} holds an array of shape {'x'.join(map(str, pixels.shape))} but the snapshot's model takes "
                        f"N x {want}{one} images; give images of that size (a folder of PNG/JPEG images is resized).")
    if len(pixels) == 0:
        raise DataError(f"{path} holds no inputs.")
    return ArrayInputs(pixels, path)


def _open_images(path: Path, spec: InputSpec, is_folder: bool) -> ImageFiles:
    c = spec.shape[0]
    if c not in IMAGE_MODES:
        raise DataError(f"the snapshot's model takes {c}-channel images, but PNG/JPEG images give 1 (grey) or 3 (RGB); "
                        f"give the inputs as a .npy array of N x {'x'.join(map(str, spec.shape))} pixel values instead.")
    if not is_folder:
        return ImageFiles([path], spec)
    # Entries that are not regular files (a FIFO named x.png) are listed, and named as unreadable when read.
    paths = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
    if not paths:
        raise DataError(f"--input {path} holds no .png, .jpg or .jpeg files.")
    return ImageFiles(paths, spec)


def _open_npy(path: Path) -> np.ndarray:
    """A .npy of numbers, memory-mapped (each rank reads only its rows); pickled objects are refused unread.

    Mapped from the file whose header was read and checked (a regular file, opened once), never from the path again."""
    fmt = np.lib.format
    try:
        file = open_regular(path)
    except OSError as exc:  # NotRegularFile too, for a path swapped since input_kind checked it
        raise DataError(f"{path} is not a readable .npy array file ({exc.strerror or exc}).") from None
    with file:
        try:
            version = fmt.read_magic(file)
            shape, fortran_order, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(file)
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"{path} is not a readable .npy array file ({exc}).") from None
        shown = "x".join(map(str, shape))
        if dtype.hasobject:
            raise DataError(f"{path} holds Python objects (pickled), which could run code on load; it is not read, "
                            f"save the images as a plain numeric array instead.")
        if any(size < 0 for size in shape):
            raise DataError(f"{path} is a damaged .npy array file: its header gives the shape {shown}, with a negative "
                            f"size; save the array again.")
        # Python ints: a damaged header's sizes would overflow numpy's int64 product. Bounded by the file's own size
        # before mapping, so that an absurd shape is one sentence rather than an mmap error.
        expected, actual = math.prod(shape) * dtype.itemsize, os.fstat(file.fileno()).st_size - file.tell()
        if actual != expected:
            what = "truncated" if actual < expected else "longer than its header says"
            raise DataError(f"{path} is {what}: its header promises {shown} {dtype} values = {expected} bytes of data "
                            f"but it holds {actual}; save the array again.")
        if dtype.kind not in "uif" or len(shape) not in (3, 4):
            raise DataError(f"{path} holds a {dtype} array of shape {shown}, but numbers shaped N x C x H x W "
                            f"(or N x H x W) were expected.")
        try:  # the map holds its own reference to the file: closing this one leaves it valid
            return np.memmap(file, dtype=dtype, mode="r", offset=file.tell(), shape=shape,
                             order="F" if fortran_order else "C")
        except (ValueError, OSError) as exc:
            raise DataError(f"{path} is a damaged .npy array file ({exc}).") from None


# ---------------------------------------------------------------- prediction


def predict_share(model: nn.Module, inputs: Inputs, spec: InputSpec, *, rank: int, world_size: int, batch_size: int,
                  device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager]) -> dict[str, Any]:
    """This rank's share of every global batch of batch_size x world_size inputs: {"positions", "probs", "errors"}.

    No collective: a rank with an empty share skips the batch (the model is whole on every rank)."""
    model.eval()
    normalise = Normalise(spec.mean, spec.std, device)  # the training loader's
    n, global_batch = len(inputs), batch_size * world_size
    positions: list[int] = []
    probs: list[torch.Tensor] = []
    errors: dict[int, str] = {}
    with torch.no_grad():
        for k in range(num_batches(n, global_batch)):
            start, stop, _ = rank_batch_positions(n, global_batch, k, rank, world_size)
            if start == stop:
                continue
            pixels, ok, bad = inputs.read(start, stop)
            errors.update(bad)
            if ok:
                with autocast():
                    logits = model(normalise(pixels.to(device, non_blocking=True)))
                probs.append(torch.softmax(logits.float(), 1).cpu())  # .cpu() waits for the device: once per batch
                positions.extend(ok)
    return {"positions": positions, "probs": torch.cat(probs) if probs else torch.empty(0, spec.num_classes), "errors": errors}


def merge_shares(shares: list[dict[str, Any]], n: int, num_classes: int) -> tuple[torch.Tensor, dict[int, str]]:
    """(n x K probabilities in input order, NaN rows for the unreadable; {position: why}); every input exactly once."""
    probs = torch.full((n, num_classes), float("nan"))
    seen = torch.zeros(n, dtype=torch.long)
    errors: dict[int, str] = {}
    for share in shares:
        index = torch.tensor(share["positions"], dtype=torch.long)
        probs[index] = share["probs"]
        seen.index_add_(0, index, torch.ones_like(index))
        errors.update(share["errors"])
        seen.index_add_(0, torch.tensor(list(share["errors"]), dtype=torch.long), torch.ones(len(share["errors"]), dtype=torch.long))
    assert bool((seen == 1).all()), f"inputs not predicted exactly once: {(seen != 1).nonzero().flatten().tolist()[:10]}"
    return probs, errors


def unreadable_sentence(inputs: Inputs, errors: dict[int, str], path: Path) -> str:
    """One sentence naming the first few unreadable inputs and counting the rest."""
    bad = sorted(errors)
    named = ", ".join(f"{inputs.name(i)} ({errors[i]})" for i in bad[:FIRST_NAMED])
    more = f" and {len(bad) - FIRST_NAMED} more" if len(bad) > FIRST_NAMED else ""
    return (f"{len(bad)} of {len(inputs)} inputs in {path} cannot be read: {named}{more}; nothing was written "
            f"(--skip-bad predicts the others and marks these in the error column).")


# ---------------------------------------------------------------- the predictions file


def header(num_classes: int) -> list[str]:
    return ["index", "source", "predicted", *(f"prob_{k}" for k in range(num_classes)), "error"]


def check_output_path(path: Path) -> None:
    """Write over an earlier predictions file of `dptrain predict` only, never over another file."""
    check_replaceable(path, "--output", lambda first: first == header(len(first) - 4),
                      "a predictions file of dptrain predict")


def write_input_predictions(inputs: Inputs, probs: torch.Tensor, errors: dict[int, str], path: Path) -> None:
    """index,source,predicted,prob_0..prob_{K-1},error per input, in input order; written atomically, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    predicted = probs.nan_to_num(-1.0).argmax(1).tolist()
    with written_atomically(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header(probs.shape[1]))
        for i, row in enumerate(probs.tolist()):
            if i in errors:
                writer.writerow([i, inputs.source(i), "", *([""] * len(row)), errors[i]])
            else:  # 9 significant digits: a float32 written and read back is the same float32
                writer.writerow([i, inputs.source(i), predicted[i], *(f"{p:.9g}" for p in row), ""])
