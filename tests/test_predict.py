"""`dptrain predict`: every new input exactly once, in order, with the snapshot's own probabilities; bad inputs named."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dptrain import snapshots, config as config_mod
from dptrain.cli import main
from dptrain.data.catalog import DATASETS
from dptrain.errors import ConfigError, DataError
from dptrain.models import build_model
from dptrain.predict import InputSpec, input_record, open_inputs, resolve_input, snapshot_input
from dptrain.safe_load import dcp_load
from tests.conftest import run_cli
from tests.ranks import run_cli_on_ranks
from tests.idx_files import idx_bytes

NUM_INPUTS = 10  # not divisible by 3 workers, nor by the per-worker batch of 2 (shares of 2,2,2 then 2,1,1)
CLASSES = 5
RESIZED = 7  # this input's PNG is 33 x 40 RGB: converted to grey and resized to 28 x 28
TRAIN = ["train", "--data.name", "synthetic", "--data.synthetic_train_size", "64", "--data.synthetic_test_size", "8",
         "--data.synthetic_num_classes", str(CLASSES), "--strategy.name", "single", "--train.global_batch_size", "32",
         "--train.epochs", "1", "--train.eval_batch_size", "2", "--launch.nproc_per_node", "1"]
MEAN, STD = 0.5, 0.3  # synthetic_spec's normalisation for one channel
GIVE_INPUTS = "give an IDX images file, a .npy array or a folder of PNG/JPEG images"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder with one snapshot of mnist-cnn on 1x28x28 synthetic data with 5 classes, trained in this process."""
    run_dir = tmp_path_factory.mktemp("predict") / "run"
    assert main([*TRAIN, "--output.dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[dict[str, Path], dict[str, np.ndarray]]:
    """The same NUM_INPUTS images as IDX (gzipped), .npy and a folder of PNGs; and, by kind, the pixels the model should see."""
    root = tmp_path_factory.mktemp("inputs")
    pixels = np.random.default_rng(0).integers(0, 256, (NUM_INPUTS, 28, 28)).astype(np.uint8)
    (root / "images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(pixels)))
    np.save(root / "images.npy", pixels[:, None])
    folder = root / "pngs"
    folder.mkdir()
    seen = pixels.astype(np.float32)
    for i, image in enumerate(pixels):
        if i == RESIZED:
            rgb = Image.fromarray(np.stack([image] * 3, -1)).resize((33, 40))
            rgb.save(folder / f"img{i:02d}.png")
            # What the model is documented to see: grey, then stretched bilinearly to 28 x 28 (PNG is lossless).
            seen[i] = np.asarray(rgb.convert("L").resize((28, 28), Image.Resampling.BILINEAR), dtype=np.float32)
        else:
            Image.fromarray(image).save(folder / f"img{i:02d}.png")
    (folder / "notes.txt").write_text("not an image: ignored")
    return ({"idx": root / "images-idx3-ubyte.gz", "npy": root / "images.npy", "folder": folder},
            {"idx": pixels, "npy": pixels, "folder": seen})


def reference_probs(run_dir: Path, pixels: np.ndarray) -> np.ndarray:
    """The snapshot's model on all inputs at once, in this process, normalised as the synthetic data was."""
    cfg = config_mod.load(run_dir / "config.toml")
    model = build_model(cfg.model, (1, 28, 28), CLASSES)
    state = {"model": model.state_dict()}
    dcp_load(state, snapshots.find_snapshot(run_dir))
    model.load_state_dict(state["model"])
    model.eval()
    x = (torch.from_numpy(pixels).float()[:, None] / 255 - MEAN) / STD
    with torch.no_grad():
        return torch.softmax(model(x), 1).double().numpy()


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def probs_of(rows: list[dict[str, str]]) -> np.ndarray:
    return np.array([[float(r[f"prob_{k}"]) for k in range(CLASSES)] for r in rows])


def check_predictions(path: Path, kind: str, expected: np.ndarray) -> None:
    rows = read_rows(path)
    assert [int(r["index"]) for r in rows] == list(range(NUM_INPUTS))  # every input once, in input order
    assert [r["source"] for r in rows] == ([f"img{i:02d}.png" for i in range(NUM_INPUTS)] if kind == "folder" else [""] * NUM_INPUTS)
    assert all(r["error"] == "" for r in rows)
    probs = probs_of(rows)
    # softmax in float32: each p_k is e_k / s rounded (<= u = 2^-24 ~ 6e-8 relative), K = 5 of them summed, and each
    # written to 9 significant digits (<= 5e-10 relative): |sum - 1| <= ~5u + 3e-9 < 5e-7.
    assert np.abs(probs.sum(1) - 1).max() < 5e-7
    # Both are the same float32 model on the same pixels; they differ only in rounding: the reference runs one batch
    # of 10 and normalises as (x/255 - mean)/std, predict runs batches of 2 (other kernel blocking, so another
    # summation order) and normalises as the training loader does, x * 1/(255 std) - mean/std (<= 2 u per pixel,
    # u = 2^-24). The logits, of magnitude ~1, then differ by a few u times the partial sums' size; softmax's Jacobian
    # has norm <= 1/2, so a probability moves by at most half of that. Measured: 9e-8 (~1.5 ulp of 1.0 in float32);
    # 1e-6 leaves a factor 10 for another machine's kernels, and still fails any real change (another
    # normalisation, a missing resize; two of these inputs' rows differ by 4e-4 at least).
    assert probs == pytest.approx(expected, abs=1e-6)
    assert [int(r["predicted"]) for r in rows] == probs.argmax(1).tolist()


def predict_argv(run_dir: Path, input_path: Path, output: Path, *extra: str) -> list[str]:
    return ["predict", "--checkpoint", str(run_dir), "--input", str(input_path), "--output", str(output), *extra]


@pytest.mark.slow
def test_the_manifest_records_what_the_model_takes(run):
    manifest = json.loads((snapshots.find_snapshot(run) / "manifest.json").read_text())
    assert manifest["input"] == {"shape": [1, 28, 28], "mean": [MEAN], "std": [STD], "num_classes": CLASSES, "dataset": "synthetic"}
    mnist = DATASETS["mnist"]
    assert input_record(config_mod.load(None, [("data.name", "mnist")]).data) == {
        "shape": [1, 28, 28], "mean": list(mnist.mean), "std": list(mnist.std), "num_classes": 10, "dataset": "mnist"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["idx", "npy", "folder"])
def test_one_worker_predicts_every_input_once_in_order(run, inputs, tmp_path, kind):
    paths, seen = inputs
    output = tmp_path / "predictions.csv"
    assert main(predict_argv(run, paths[kind], output)) == 0
    check_predictions(output, kind, reference_probs(run, seen[kind]))
    assert main(predict_argv(run, paths[kind], output)) == 0  # an earlier predictions file is replaced


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_workers_predict_every_input_once_in_order(run, inputs, tmp_path):
    paths, seen = inputs
    kinds = ["idx", "npy", "folder"]
    # One process per rank, as torchrun starts them, for all three runs (one start of torch per rank).
    codes = run_cli_on_ranks(3, [predict_argv(run, paths[k], tmp_path / f"{k}.csv") for k in kinds], str(tmp_path), timeout=90)
    assert codes == [0, 0, 0]
    for kind in kinds:
        check_predictions(tmp_path / f"{kind}.csv", kind, reference_probs(run, seen[kind]))


@pytest.fixture
def with_corrupt_png(inputs, tmp_path) -> Path:
    folder = tmp_path / "pngs"
    shutil.copytree(inputs[0]["folder"], folder)
    whole = (folder / "img03.png").read_bytes()
    (folder / "img03.png").write_bytes(whole[: len(whole) // 2])  # truncated inside its image data
    return folder


def test_a_corrupt_png_is_named_and_nothing_is_written(run, with_corrupt_png, tmp_path, capsys):
    output = tmp_path / "predictions.csv"
    assert main(predict_argv(run, with_corrupt_png, output)) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dptrain: error: 1 of {NUM_INPUTS} inputs in {with_corrupt_png} cannot be read: img03.png (not a "
                   f"readable PNG or JPEG image: OSError); nothing was written (--skip-bad predicts the others and marks "
                   f"these in the error column).")
    assert not output.exists() and list(tmp_path.glob(".*.tmp")) == []


def test_skip_bad_marks_the_bad_inputs_and_predicts_the_rest(run, inputs, with_corrupt_png, tmp_path):
    paths, seen = inputs
    output = tmp_path / "predictions.csv"
    assert main(predict_argv(run, with_corrupt_png, output, "--skip-bad")) == 0
    rows = read_rows(output)
    assert [int(r["index"]) for r in rows] == list(range(NUM_INPUTS))
    assert rows[3]["predicted"] == "" and rows[3]["error"] == "not a readable PNG or JPEG image: OSError"
    good = [i for i in range(NUM_INPUTS) if i != 3]
    assert probs_of([rows[i] for i in good]) == pytest.approx(reference_probs(run, seen["folder"])[good], abs=1e-6)  # as in check_predictions
    # Rows of an array with values that are not pixels are marked too.
    array = np.load(paths["npy"]).astype(np.float32)
    array[2, 0, 5, 5], array[6, 0, 0, 0] = np.nan, 300.0
    np.save(tmp_path / "floats.npy", array)
    assert main(predict_argv(run, tmp_path / "floats.npy", output, "--skip-bad")) == 0
    rows = read_rows(output)
    assert [r["error"] for r in rows if r["error"]] == ["NaN or infinite values", "values outside 0..255, where pixel values are expected"]
    assert [int(r["index"]) for r in rows if r["error"]] == [2, 6] and len(rows) == NUM_INPUTS


def npy_with_header_shape(path: Path, shape: tuple[int, ...]) -> None:
    """A .npy of 2 x 1 x 28 x 28 zero bytes whose header claims another shape (numpy writes what it is given)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": shape})
    path.write_bytes(b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + bytes(2 * 28 * 28))


@pytest.mark.parametrize("make, message", [
    (lambda d: np.save(d / "x.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True),
     "{d}/x.npy holds Python objects (pickled), which could run code on load; it is not read, save the images as a plain numeric array instead."),
    (lambda d: np.save(d / "x.npy", np.zeros((4, 3, 28, 28), np.uint8)),
     "{d}/x.npy holds an array of shape 4x3x28x28 but the snapshot's model takes N x 1x28x28 (or N x H x W) images; "
     "give images of that size (a folder of PNG/JPEG images is resized)."),
    (lambda d: (d / "x-idx3-ubyte").write_bytes(idx_bytes(np.zeros((4, 28, 28), np.uint8))[:8] + b"\xff" * 8 + bytes(4 * 784)),
     "{d}/x-idx3-ubyte is truncated: its header promises 4x4294967295x4294967295 = %d bytes of data but it holds 3136; "
     "download it again." % (4 * (2**32 - 1) ** 2)),
    # A header's shape is checked against the file before it is mapped (a negative size was an OverflowError).
    (lambda d: npy_with_header_shape(d / "x.npy", (-2, 1, 28, 28)),
     "{d}/x.npy is a damaged .npy array file: its header gives the shape -2x1x28x28, with a negative size; save the array again."),
    (lambda d: npy_with_header_shape(d / "x.npy", (10**12, 1, 28, 28)),
     "{d}/x.npy is truncated: its header promises 1000000000000x1x28x28 uint8 values = %d bytes of data but it "
     "holds 1568; save the array again." % (10**12 * 784)),
    # A FIFO would block the read until something writes to it (it was called missing).
    (lambda d: os.mkfifo(d / "x.png"), "--input {d}/x.png is a FIFO, not a regular file; " + GIVE_INPUTS + "."),
    (lambda d: os.mkfifo(d / "x.npy"), "--input {d}/x.npy is a FIFO, not a regular file; " + GIVE_INPUTS + "."),
])
def test_an_unreadable_input_file_is_refused_in_one_sentence(run, tmp_path, capsys, make, message):
    make(tmp_path)
    name = next(p for p in tmp_path.iterdir() if p.name.startswith("x"))
    assert main(predict_argv(run, name, tmp_path / "predictions.csv")) == 2
    assert capsys.readouterr().err.strip() == "dptrain: error: " + message.format(d=tmp_path)
    assert not (tmp_path / "predictions.csv").exists()


@pytest.mark.slow
@pytest.mark.timeout(60)  # the old code waited for a writer on the FIFO for ever
def test_an_image_that_is_not_a_regular_file_or_not_png_or_jpeg_by_content_is_named(run, inputs, tmp_path, capsys):
    folder = tmp_path / "pngs"
    shutil.copytree(inputs[0]["folder"], folder)
    grey = Image.fromarray(np.full((28, 28), 200, np.uint8))
    grey.save(folder / "bmp.png", format="BMP")  # Pillow decoded it: the suffix chose nothing
    grey.save(folder / "eps.jpg", format="EPS")  # Pillow handed it to Ghostscript, where installed
    os.mkfifo(folder / "pipe.png")
    output = tmp_path / "predictions.csv"
    assert main(predict_argv(run, folder, output)) == 2
    assert capsys.readouterr().err.strip() == (
        f"dptrain: error: 3 of {NUM_INPUTS + 3} inputs in {folder} cannot be read: bmp.png (not a PNG or JPEG image by "
        f"its content), eps.jpg (not a PNG or JPEG image by its content), pipe.png (a FIFO, not a regular file); nothing "
        f"was written (--skip-bad predicts the others and marks these in the error column).")
    assert not output.exists()
    assert main(predict_argv(run, folder, output, "--skip-bad")) == 0
    rows = read_rows(output)
    assert [(r["source"], r["error"]) for r in rows if r["error"]] == [
        ("bmp.png", "not a PNG or JPEG image by its content"), ("eps.jpg", "not a PNG or JPEG image by its content"),
        ("pipe.png", "a FIFO, not a regular file")]
    assert len(rows) == NUM_INPUTS + 3


def test_a_symbolic_link_loop_as_input_is_refused_in_one_sentence(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    sentence = f"--input {loop} is a symbolic link that leads round a loop of links to no file; {GIVE_INPUTS}."
    # The CLI resolves --input first (Python < 3.13 raised RuntimeError there); open_inputs meets the loop itself
    # where resolve() lets it through (Python 3.13) or where a path comes unresolved.
    with pytest.raises(DataError) as refused:
        resolve_input(str(loop))
    assert str(refused.value) == sentence
    with pytest.raises(DataError) as refused:
        open_inputs(loop, InputSpec((1, 28, 28), (MEAN,), (STD,), CLASSES, "synthetic"))
    assert str(refused.value) == sentence


def test_a_symbolic_link_loop_given_to_the_cli_is_one_sentence(run, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    assert main(predict_argv(run, loop, tmp_path / "out.csv")) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: --input {loop} is a symbolic link that leads round a "
                                               f"loop of links to no file; {GIVE_INPUTS}.")


def test_refuses_to_write_over_a_file_that_is_not_a_predictions_file(run, inputs, capsys):
    config = run / "config.toml"
    before = config.read_text()
    assert main(predict_argv(run, inputs[0]["npy"], config)) == 2
    assert capsys.readouterr().err.strip() == (f"dptrain: error: --output {config} exists and is not a predictions file "
                                               f"of dptrain predict; choose another path.")
    assert config.read_text() == before


@pytest.mark.slow
def test_an_older_snapshot_without_input_gets_it_from_the_config(run, inputs, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(run, old, ignore=shutil.ignore_patterns("logs"))
    manifest_path = snapshots.find_snapshot(old) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["input"]
    manifest_path.write_text(json.dumps(manifest))
    assert main(predict_argv(old, inputs[0]["npy"], tmp_path / "old.csv")) == 0
    assert main(predict_argv(run, inputs[0]["npy"], tmp_path / "new.csv")) == 0
    assert (tmp_path / "old.csv").read_text() == (tmp_path / "new.csv").read_text()


def test_a_snapshot_of_a_users_dataset_is_refused_saying_why(tmp_path):
    cfg = config_mod.load(None, [("data.name", "tests.user_code:PatternDataset")])
    assert input_record(cfg.data) is None
    with pytest.raises(ConfigError) as refused:
        snapshot_input({"input": None}, cfg, tmp_path)
    assert str(refused.value) == (f"snapshot {tmp_path} was trained on data.name tests.user_code:PatternDataset, a Dataset "
                                  f"of yours whose image size and normalisation dptrain does not know, so predict cannot "
                                  f"prepare new inputs for it; run your own model on your own data loading instead.")


@pytest.mark.nightly  # the default run keeps three workers predicting every input once, in order
@pytest.mark.timeout(120)
def test_three_workers_through_the_launcher(run, inputs, with_corrupt_png, tmp_path):
    paths, seen = inputs
    output = tmp_path / "predictions.csv"
    result = run_cli(predict_argv(run, with_corrupt_png, output, "--nproc-per-node", "3", "--skip-bad"), tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(output)
    assert [int(r["index"]) for r in rows] == list(range(NUM_INPUTS))
    assert [i for i, r in enumerate(rows) if r["error"]] == [3]
    good = [i for i in range(NUM_INPUTS) if i != 3]
    assert probs_of([rows[i] for i in good]) == pytest.approx(reference_probs(run, seen["folder"])[good], abs=1e-6)  # as in check_predictions
