"""The catalog: where each dataset's files are found, what load() returns, and which folders are refused."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.config import DataConfig
from dptrain.data.catalog import DATASETS, Split, candidate_dirs, idx_file, load, locate
from dptrain.errors import DataError

from .datafiles import CIFAR_DIR, IDX_STEMS, write_cifar_batch, write_cifar_dataset, write_idx, write_idx_dataset

MNIST, FASHION, CIFAR = DATASETS["mnist"], DATASETS["fashion-mnist"], DATASETS["cifar10"]


def no_system_dirs(spec):
    """The spec as it is, less the system folders (which may really exist on the test machine)."""
    return dataclasses.replace(spec, system_dirs=())


def test_no_system_dir_for_mnist_or_cifar_on_this_machine():
    # The "missing" tests below rely on this; fashion-mnist's system dir may exist and is avoided.
    for spec in (MNIST, CIFAR):
        for d in spec.system_dirs:
            assert not Path(d, "train-labels-idx1-ubyte.gz").exists()


# ---------------------------------------------------------------- locate


@pytest.mark.parametrize(
    "spec,sub",
    [(FASHION, "FashionMNIST/raw"), (FASHION, "fashion-mnist"), (MNIST, "MNIST/raw"), (MNIST, "mnist"), (MNIST, ""), (FASHION, "")],
)
@pytest.mark.parametrize("gz", [False, True], ids=["raw-only", "gz-only"])
def test_locate_idx_layouts(tmp_path, spec, sub, gz):
    folder = tmp_path / sub if sub else tmp_path
    write_idx_dataset(folder, 5, 3, gz=gz)
    assert locate(spec, tmp_path) == folder


def test_locate_idx_mixed_raw_and_gz(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    arrays = write_idx_dataset(folder, 5, 3, gz=True)
    # torchvision keeps both; here two of the four also exist unpacked
    for stem, array in list(zip(IDX_STEMS, arrays))[:2]:
        write_idx(folder / stem, array)
    assert locate(MNIST, tmp_path) == folder
    assert idx_file(folder, IDX_STEMS[0]) == folder / IDX_STEMS[0]
    assert idx_file(folder, IDX_STEMS[2]) == folder / f"{IDX_STEMS[2]}.gz"


def test_locate_cifar_layout(tmp_path):
    write_cifar_dataset(tmp_path / CIFAR_DIR, 2, 2)
    assert locate(CIFAR, tmp_path) == tmp_path / CIFAR_DIR


def test_locate_cifar_files_directly_in_root(tmp_path):
    write_cifar_dataset(tmp_path, 2, 2)
    assert locate(CIFAR, tmp_path) == tmp_path


def test_locate_prefers_torchvision_layout_over_root(tmp_path):
    write_idx_dataset(tmp_path, 5, 3)
    write_idx_dataset(tmp_path / "MNIST" / "raw", 5, 3)
    assert locate(MNIST, tmp_path) == tmp_path / "MNIST" / "raw"


def test_root_is_searched_before_system_dirs(tmp_path):
    # Whether or not /usr/share/datasets/fashion-mnist exists here, a copy under root wins.
    dirs = candidate_dirs(FASHION, tmp_path)
    assert dirs == [tmp_path / "FashionMNIST/raw", tmp_path / "fashion-mnist", tmp_path, Path("/usr/share/datasets/fashion-mnist")]
    write_idx_dataset(tmp_path / "FashionMNIST" / "raw", 5, 3, gz=True)
    assert locate(FASHION, tmp_path) == tmp_path / "FashionMNIST" / "raw"


def test_system_dir_is_used_when_root_is_empty(tmp_path):
    system = tmp_path / "usr-share" / "fashion-mnist"
    write_idx_dataset(system, 5, 3, gz=True)  # Debian's package ships the .gz files only
    spec = dataclasses.replace(FASHION, system_dirs=(str(system),))
    assert locate(spec, tmp_path / "empty-root") == system


def test_locate_incomplete_folder_is_not_found(tmp_path):
    write_idx_dataset(tmp_path / "MNIST" / "raw", 5, 3)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError):
        locate(MNIST, tmp_path)


def test_locate_cifar_incomplete_folder_is_not_found(tmp_path):
    write_cifar_dataset(tmp_path / CIFAR_DIR, 2, 2)
    (tmp_path / CIFAR_DIR / "data_batch_4").unlink()
    with pytest.raises(DataError):
        locate(CIFAR, tmp_path)


@pytest.mark.parametrize("spec", [MNIST, CIFAR], ids=["mnist", "cifar10"])
def test_locate_missing_lists_searched_folders_and_hint(tmp_path, spec):
    with pytest.raises(DataError) as info:
        locate(spec, tmp_path)
    message = str(info.value)
    for folder in candidate_dirs(spec, tmp_path):
        assert str(folder) in message
    assert spec.howto in message
    assert "--data.download true" in message


def test_locate_missing_fashion_mnist_names_the_debian_package(tmp_path):
    spec = no_system_dirs(FASHION)
    with pytest.raises(DataError) as info:
        locate(spec, tmp_path)
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert str(tmp_path / "FashionMNIST/raw") in message and str(tmp_path / "fashion-mnist") in message


def test_load_missing_without_download_raises(tmp_path):
    with pytest.raises(DataError) as info:
        load(DataConfig(name="mnist", root=str(tmp_path)))
    assert str(tmp_path / "MNIST/raw") in str(info.value)


# ---------------------------------------------------------------- load


@pytest.mark.parametrize("name,sub", [("mnist", "MNIST/raw"), ("fashion-mnist", "FashionMNIST/raw"), ("mnist", "")])
@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_load_idx(tmp_path, name, sub, gz):
    train_images, train_labels, test_images, test_labels = write_idx_dataset(tmp_path / sub if sub else tmp_path, 50, 17, gz=gz, seed=5)
    spec, train, test = load(DataConfig(name=name, root=str(tmp_path)))
    assert spec is DATASETS[name]
    assert isinstance(train, Split) and isinstance(test, Split)
    assert len(train) == 50 and len(test) == 17
    assert tuple(train.images.shape) == (50, 1, 28, 28) and tuple(test.images.shape) == (17, 1, 28, 28)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert np.array_equal(train.images[:, 0].numpy(), train_images)
    assert np.array_equal(test.images[:, 0].numpy(), test_images)
    assert train.labels.tolist() == train_labels.tolist() and test.labels.tolist() == test_labels.tolist()


def test_load_cifar(tmp_path):
    train_batches, (test_images, test_labels) = write_cifar_dataset(tmp_path / CIFAR_DIR, 7, 9, seed=2)
    spec, train, test = load(DataConfig(name="cifar10", root=str(tmp_path)))
    assert spec is CIFAR
    assert tuple(train.images.shape) == (35, 3, 32, 32) and tuple(test.images.shape) == (9, 3, 32, 32)
    # the five training batches, in order data_batch_1..5
    assert np.array_equal(train.images.numpy(), np.concatenate([b[0] for b in train_batches]))
    assert train.labels.tolist() == sum((b[1] for b in train_batches), [])
    assert np.array_equal(test.images.numpy(), test_images) and test.labels.tolist() == test_labels
    assert train.labels.dtype == torch.int64


def test_load_prefers_raw_file_over_gz(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx_dataset(folder, 10, 4, gz=True, seed=1)
    raw_arrays = write_idx_dataset(folder, 12, 4, gz=False, seed=2)
    _, train, _ = load(DataConfig(name="mnist", root=str(tmp_path)))
    assert len(train) == 12 and train.labels.tolist() == raw_arrays[1].tolist()


@pytest.mark.parametrize("prefix", ["train", "t10k"])
def test_load_images_labels_count_mismatch(tmp_path, prefix):
    folder = tmp_path / "MNIST" / "raw"
    write_idx_dataset(folder, 20, 10)
    labels_path = folder / f"{prefix}-labels-idx1-ubyte"
    write_idx(labels_path, np.zeros(7, np.uint8))
    with pytest.raises(DataError) as info:
        load(DataConfig(name="mnist", root=str(tmp_path)))
    message = str(info.value)
    assert str(labels_path) in message and str(folder / f"{prefix}-images-idx3-ubyte") in message
    assert "7 labels" in message


def test_load_idx_labels_out_of_range(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx_dataset(folder, 20, 10)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 10], np.uint8))
    with pytest.raises(DataError) as info:
        load(DataConfig(name="mnist", root=str(tmp_path)))
    message = str(info.value)
    assert str(folder) in message and "10" in message and "test" in message


def test_load_cifar_labels_out_of_range(tmp_path):
    folder = tmp_path / CIFAR_DIR
    write_cifar_dataset(folder, 3, 3)
    write_cifar_batch(folder / "data_batch_3", np.zeros((3, 3, 32, 32), np.uint8), [0, 12, 1])
    with pytest.raises(DataError) as info:
        load(DataConfig(name="cifar10", root=str(tmp_path)))
    message = str(info.value)
    assert "training" in message and "12" in message and str(folder) in message


def test_load_labels_at_the_top_class_are_accepted(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx_dataset(folder, 20, 10)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.full(10, 9, np.uint8))
    _, _, test = load(DataConfig(name="mnist", root=str(tmp_path)))
    assert test.labels.tolist() == [9] * 10


def test_load_wrong_image_size_is_another_dataset(tmp_path):
    write_idx_dataset(tmp_path / "MNIST" / "raw", 6, 4, size=32)
    with pytest.raises(DataError) as info:
        load(DataConfig(name="mnist", root=str(tmp_path)))
    assert "(1, 32, 32)" in str(info.value) and "(1, 28, 28)" in str(info.value)


def test_load_corrupt_file_is_named(tmp_path):
    folder = tmp_path / "MNIST" / "raw"
    write_idx_dataset(folder, 6, 4, gz=True)
    bad = folder / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:40])
    with pytest.raises(DataError) as info:
        load(DataConfig(name="mnist", root=str(tmp_path)))
    assert str(bad) in str(info.value)



def test_load_negative_cifar_labels_are_corrupt(tmp_path):
    folder = tmp_path / CIFAR_DIR
    write_cifar_dataset(folder, 3, 3)
    write_cifar_batch(folder / "test_batch", np.zeros((3, 3, 32, 32), np.uint8), [0, -1, 2])
    with pytest.raises(DataError, match=r"test labels in .* range over -1\.\.2 but cifar10 has classes 0\.\.9"):
        load(DataConfig(name="cifar10", root=str(tmp_path)))


@pytest.mark.timeout(60)  # in this process: a command that opened a FIFO would wait there for ever
def test_fifos_named_as_the_dataset_files_are_one_sentence_not_a_hang(tmp_path, monkeypatch, capsys):
    """`mkfifo` the four IDX names under --data.root: `dptrain train` waited for ever, printing nothing."""
    from dptrain.cli import main

    (tmp_path / "data").mkdir()
    for stem in IDX_STEMS:
        os.mkfifo(tmp_path / "data" / stem)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--data.name", "mnist", "--data.root", "data"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [f"dptrain: error: {Path('data') / IDX_STEMS[1]} is a FIFO, not a regular "
                                                f"file; put the dataset's own file there, or give another --data.root."]
    assert not (tmp_path / "runs").exists()  # refused before anything was written
