"""crop_flip and its draws: a real crop of the zero-padded image and a real flip, drawn from (seed, epoch, index) only."""

from __future__ import annotations

import typing

import pytest
import torch
import torch.nn.functional as F

from dptrain import config
from dptrain.config import DataConfig
from dptrain.data.augment import AUGMENTS, PAD, _mix32, _mul32, crop_flip, draws
from dptrain.errors import ConfigError

CPU = torch.device("cpu")


def reference(image: torch.Tensor, dy: int, dx: int, flip: bool) -> torch.Tensor:
    """torchvision's recipe for one (C, H, W) image: pad with zeros, crop at (PAD + dy, PAD + dx), then flip."""
    _, h, w = image.shape
    out = F.pad(image, (PAD, PAD, PAD, PAD))[:, PAD + dy : PAD + dy + h, PAD + dx : PAD + dx + w]
    return out.flip(-1) if flip else out


def distinct_images(n: int, shape=(3, 10, 12)) -> torch.Tensor:
    """Float images whose pixels are all different and nonzero: a crop-flip output names its own parameters."""
    return torch.arange(1, n * torch.Size(shape).numel() + 1, dtype=torch.float32).view(n, *shape)


def recover(out: torch.Tensor, image: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Every (dy, dx, flip) that maps image to out."""
    span = range(-PAD, PAD + 1)
    return [(dy, dx, fl) for dy in span for dx in span for fl in (False, True) if torch.equal(reference(image, dy, dx, fl), out)]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_each_output_is_one_crop_and_flip_of_its_own_image(fmt):
    source = distinct_images(40)
    rows = torch.tensor([5, 0, 39, 5, 17, 22, 8, 31])
    out = crop_flip(source, rows, rows + 1000, seed=3, epoch=2, memory_format=fmt)
    assert out.shape == (8, 3, 10, 12) and out.dtype == source.dtype and out.is_contiguous(memory_format=fmt)
    dy, dx, flip = draws(rows + 1000, 3, 2)
    for i, r in enumerate(rows.tolist()):
        # found from the pixels alone, without trusting draws(): exactly one crop and flip fits
        assert recover(out[i], source[r]) == [(int(dy[i]), int(dx[i]), bool(flip[i]))]


def test_a_flipped_sample_is_the_mirror_of_its_shifted_image():
    source = distinct_images(2000, (1, 8, 8))  # each (dy, dx, flip) has chance 1/162: some of each
    ids = torch.arange(2000)
    out = crop_flip(source, ids, ids, seed=0, epoch=0)
    dy, dx, flip = draws(ids, 0, 0)
    i = int(torch.nonzero(flip & (dx == 2) & (dy == -1))[0])
    # shift right by dx=2 columns' worth of source (content moves left), down by one row of zeros, then mirror
    shifted = torch.zeros(1, 8, 8)
    shifted[:, 1:, :6] = source[i, :, :7, 2:]
    assert torch.equal(out[i], torch.flip(shifted, dims=[-1]))
    j = int(torch.nonzero(~flip & (dx == 0) & (dy == 0))[0])
    assert torch.equal(out[j], source[j])  # no shift, no flip: untouched


def test_uint8_images_pad_with_zero_and_keep_their_dtype():
    source = torch.full((64, 1, 6, 6), 200, dtype=torch.uint8)
    ids = torch.arange(64)
    out = crop_flip(source, ids, ids, seed=1, epoch=0)
    dy, dx, _ = draws(ids, 1, 0)
    assert out.dtype == torch.uint8
    # the pixels that came from the padding are 0, the rest 200
    inside = (6 - dy.abs()).clamp(min=0) * (6 - dx.abs()).clamp(min=0)
    assert torch.equal((out == 200).sum(dim=(1, 2, 3)), inside) and bool(((out == 0) | (out == 200)).all())


def test_draws_cover_every_offset_and_flip_about_half():
    n = 18_000
    dy, dx, flip = draws(torch.arange(n), seed=0, epoch=0)
    for d in (dy, dx):
        counts = torch.bincount(d + PAD, minlength=2 * PAD + 1)
        assert len(counts) == 2 * PAD + 1 and int(d.min()) == -PAD and int(d.max()) == PAD
        assert bool((counts - n / 9).abs().max() < 0.1 * n / 9)  # 2000 each; sd ~ 42
    assert abs(int(flip.sum()) - n / 2) < 0.03 * n  # sd 67
    joint = torch.bincount((dy + PAD) * 9 + dx + PAD, minlength=81)  # dy and dx independent: all 81 pairs
    assert bool((joint - n / 81).abs().max() < 0.35 * n / 81)


def test_draws_are_a_pure_function_of_seed_epoch_and_index():
    ids = torch.tensor([0, 1, 7, 59_999, 12, 3])
    a = draws(ids, 5, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, draws(ids.clone(), 5, 3)))
    # one sample alone, or in another batch order: the same draws
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    assert all(torch.equal(x[perm], y) for x, y in zip(a, draws(ids[perm], 5, 3)))
    assert all(torch.equal(x[2:3], y) for x, y in zip(a, draws(ids[2:3], 5, 3)))
    big = torch.arange(2000)
    base = torch.stack(draws(big, 5, 3))
    for other in (draws(big, 5, 4), draws(big, 6, 3), draws(big, -5, 3)):
        assert (torch.stack(other) != base).any(dim=0).float().mean() > 0.9  # 1 - 1/162 expected


def test_the_hash_never_overflows_and_matches_python_integers():
    xs = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123_456_789])
    for c in (0x7FEB352D, 0x846CA68B, 2**32 - 1):
        assert _mul32(xs, c).tolist() == [(x * c) % 2**32 for x in xs.tolist()]
    assert _mix32(xs).tolist() == [_mix32(x) for x in xs.tolist()]
    assert bool((_mix32(xs) >= 0).all() and (_mix32(xs) < 2**32).all())
    assert len(set(_mix32(torch.arange(100_000)).tolist())) == 100_000  # a bijection


def test_empty_share_keeps_its_shape():
    source = distinct_images(4)
    none = torch.empty(0, dtype=torch.long)
    for fmt in (torch.contiguous_format, torch.channels_last):
        assert crop_flip(source, none, none, seed=0, epoch=0, memory_format=fmt).shape == (0, 3, 10, 12)


# ---------------------------------------------------------------- the option


def test_option_round_trips_and_defaults_to_none():
    assert DataConfig().augment == "none"
    assert typing.get_args(typing.get_type_hints(DataConfig)["augment"]) == AUGMENTS == ("none", "crop-flip")
    cfg = config.load(None, [("data.augment", "crop-flip")])
    assert cfg.data.augment == "crop-flip"
    assert config.from_dict(config.to_dict(cfg)) == cfg


def test_invalid_option_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"^data.augment = 'flip' is not one of none, crop-flip; pick one of them.$"):
        config.load(None, [("data.augment", "flip")])


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.slow  # -m "not slow" replaces the default -m "not gpu": GPU tests are slow ones too
def test_cuda_draws_and_crops_equal_the_cpu_ones():
    assert torch.cuda.is_available(), "the gpu marker was selected on a machine without CUDA"
    source = torch.randint(0, 256, (500, 3, 32, 32), dtype=torch.uint8)
    rows = torch.randperm(500)[:128]
    for fmt in (torch.contiguous_format, torch.channels_last):
        cpu = crop_flip(source, rows, rows, seed=9, epoch=4, memory_format=fmt)
        gpu = crop_flip(source.cuda(), rows.cuda(), rows.cuda(), seed=9, epoch=4, memory_format=fmt)
        assert gpu.is_contiguous(memory_format=fmt) and torch.equal(gpu.cpu(), cpu)
