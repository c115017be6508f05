"""`--batched_crops`: the multi-crop of a batch of same-size images as tensor operations
(`MultiCropAugmentation.batch`) against the per-image PIL path it replaces, and the CPU bf16
attention path of `common.Attention`."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter
from torchvision.transforms import functional as TF

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402


class ColourImages(torch.utils.data.Dataset):
    """28 x 28 RGB images with smooth colour fields and sharp edges (so that hue, saturation,
    blur and resampling all change pixels), labelled by index."""

    def __init__(self, n=24, size=28, seed=0):
        rng = np.random.default_rng(seed)
        self.images = []
        for _ in range(n):
            field = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
            pixels = np.asarray(field).copy()
            x0, y0 = rng.integers(0, size // 2, 2)
            pixels[y0:y0 + size // 3, x0:x0 + size // 3] = rng.integers(0, 256, 3)
            self.images.append(Image.fromarray(pixels))

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i


def augmentation():
    return common.MultiCropAugmentation(local_crops_number=3, global_crop_size=32, local_crop_size=16)


def both_paths(n=24, seed=5, epoch=2):
    base, augment = ColourImages(n), augmentation()
    indices = [(i, epoch) for i in range(n)]
    pil = torch.utils.data.default_collate(common.SeededDataset(base, augment, seed=seed).__getitems__(indices))
    batched = common.SeededDataset(base, augment, seed=seed, batched=True).__getitems__(indices)
    return pil, batched


def levels(crop):
    """Normalised crops back to 0..255."""
    mean, std = torch.tensor(common.IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(common.IMAGENET_STD).view(1, 3, 1, 1)
    return (crop * std + mean) * 255


def test_batched_crops_have_the_pil_paths_geometry_and_labels():
    ((pil_crops, pil_geometry), pil_labels), ((crops, geometry), labels) = both_paths()
    assert torch.equal(pil_labels, labels)
    assert [c.shape for c in crops] == [c.shape for c in pil_crops]
    for ours, theirs in zip(geometry, pil_geometry):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


def test_batched_draws_consume_the_generator_as_the_pil_path():
    """Same draws in the same order: after one sample, torch's generator is where the PIL path
    leaves it, so every photometric parameter is the PIL path's too."""
    augment, image = augmentation(), ColourImages(1)[0][0]
    for seed in range(20):
        torch.manual_seed(seed)
        augment(image)
        after_pil = torch.get_rng_state()
        torch.manual_seed(seed)
        for _, scale, photometric in augment.plan():
            common.draw_crop(28, 28, scale, photometric)
        assert torch.equal(torch.get_rng_state(), after_pil), seed


def test_batched_pixels_agree_with_the_pil_path():
    """Same draws, torchvision's tensor operations instead of PIL's integer ones: the pixels differ by
    under a level of 255 on average and follow the same distribution (channel means and spreads)."""
    (((pil_crops, _), _), ((crops, _), _)) = both_paths()
    for theirs, ours in zip(pil_crops, crops):
        a, b = levels(theirs), levels(ours)
        diff = (a - b).abs()
        assert diff.max() <= 32 and diff.mean() <= 1.0, (diff.max(), diff.mean())
        for dims in ((0, 2, 3), (0, 1, 2, 3)):                     # per channel, and overall
            assert torch.allclose(a.mean(dims), b.mean(dims), atol=0.6)
            assert torch.allclose(a.std(dims), b.std(dims), atol=0.6)


def as_float(image):
    return TF.pil_to_tensor(image).float()[None] / 255


@pytest.mark.parametrize("op", range(4))
def test_each_colour_operation_is_torchvisions(op):
    """Per sample factors, torchvision's formulas (on levels 0..255; the blends truncated to whole
    levels, as PIL's are)."""
    x = as_float(ColourImages(1)[0][0]).repeat(2, 1, 1, 1)
    factors = [0.6, 1.4] if op < 3 else [-0.1, 0.07]
    tv_op = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue][op]
    theirs = torch.cat([tv_op(x[i:i + 1], f) for i, f in enumerate(factors)]) * 255
    ours = common.adjust_color(x * 255, op, torch.tensor(factors).view(-1, 1, 1, 1))
    assert (ours - theirs).abs().max() <= (1 if op < 3 else 1e-3), op
    assert torch.equal(common.color_jitter(x.clone(), [None, None]), x)


def test_grayscale_solarize_and_blur():
    image = ColourImages(1)[0][0].resize((32, 32), Image.BICUBIC)
    x = as_float(image) * 255
    assert torch.allclose(common.grayscale(x), TF.rgb_to_grayscale(x / 255) * 255, atol=1e-3)
    for radius in (0.02, 0.3, 1.0, 2.0):             # PIL approximates the Gaussian by three box blurs
        theirs = as_float(image.filter(ImageFilter.GaussianBlur(radius))) * 255
        ours = common.gaussian_blur(x, [radius])
        assert (ours - theirs).abs().max() <= 20 and (ours - theirs).abs().mean() <= 1, radius
    assert torch.equal(common.gaussian_blur(x, [None]), x)


def test_the_loader_gives_the_same_batches_and_leaves_the_global_generator_alone():
    base, augment = ColourImages(16), augmentation()
    batches = []
    for batched in (False, True):
        dataset = common.SeededDataset(base, augment, seed=1, batched=batched)
        loader, sampler = common.make_loader(dataset, 8, num_workers=0, seed=1)
        sampler.set_epoch(3)
        torch.manual_seed(0)
        state = torch.get_rng_state()
        batches.append(list(loader))
        assert torch.equal(torch.get_rng_state(), state), batched
    for ((pil_crops, pil_geometry), pil_labels), ((crops, geometry), labels) in zip(*batches):
        assert torch.equal(pil_labels, labels)
        assert all(torch.equal(a["box"], b["box"]) and torch.equal(a["flip"], b["flip"])
                   for a, b in zip(pil_geometry, geometry))
        assert all((levels(a) - levels(b)).abs().mean() < 1.0 for a, b in zip(pil_crops, crops))


def test_batched_crops_take_images_of_any_size():
    """Each image is cropped on its own: in a batch of two sizes every sample gets the PIL path's
    geometry (its box, flip and image size)."""
    class TwoSizes(ColourImages):
        def __getitem__(self, i):
            image, label = super().__getitem__(i)
            return (image.resize((20, 36)) if i == 1 else image), label
    batched = common.SeededDataset(TwoSizes(3), augmentation(), batched=True)
    plain = common.SeededDataset(TwoSizes(3), augmentation())
    (crops, geometry), _ = batched.__getitems__([0, 1, 2])
    for i in range(3):
        pil_crops, pil_geometry = plain[i][0]
        for view, pil_view, crop, pil_crop in zip(geometry, pil_geometry, crops, pil_crops):
            assert torch.allclose(view["box"][i], pil_view["box"])
            assert bool(view["flip"][i]) == bool(pil_view["flip"])
            assert torch.equal(view["image_size"][i], pil_view["image_size"])
            assert crop[i].shape == pil_crop.shape


def test_cpu_bf16_attention_is_the_explicit_one_and_agrees_with_the_fused_one(monkeypatch):
    torch.manual_seed(0)
    attention = common.build_backbone("vit_pico", 4, img_size=32).blocks[0].attn
    assert isinstance(attention, common.Attention)
    sdpa_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: sdpa_calls.append(1) or sdpa(*a, **k))
    x = torch.randn(4, 17, 64)
    results = []
    for bf16 in (False, True):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = attention(xi)
        out.float().sum().backward()
        results.append((out.float(), xi.grad))
        assert len(sdpa_calls) == 1          # fp32: timm's fused kernel; CPU bf16: the explicit matmuls
    (reference, reference_grad), (ours, grad) = results
    assert torch.allclose(ours, reference, atol=0.03, rtol=0.03)           # bf16 rounding only
    assert torch.allclose(grad, reference_grad, atol=0.03, rtol=0.03)
    attention.fused_attn = False             # as tests/test_trajectories.py sets it: the explicit path in fp32 too
    with torch.no_grad():
        attention(x)
    assert not attention.fused_attn and len(sdpa_calls) == 1
