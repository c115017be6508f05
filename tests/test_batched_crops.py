"""`--batched_crops`: the multi-crop of a batch of same-size images as tensor operations
(`MultiCropAugmentation.batch`) against the per-image PIL path it replaces, and the CPU bf16
attention path of `common.Attention`."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter, ImageOps
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
            augment.draw_crop(28, 28, scale, photometric)
        assert torch.equal(torch.get_rng_state(), after_pil), seed


def test_batched_pixels_agree_with_the_pil_path():
    (((pil_crops, _), _), ((crops, _), _)) = both_paths()
    for theirs, ours in zip(pil_crops, crops):
        a, b = levels(theirs), levels(ours)
        diff = (a - b).abs()
        assert diff.max() <= 8 and diff.mean() <= 0.5, (diff.max(), diff.mean())
        for dims in ((0, 2, 3), (0, 1, 2, 3)):                     # per channel, and overall
            assert torch.allclose(a.mean(dims), b.mean(dims), atol=0.5)
            assert torch.allclose(a.std(dims), b.std(dims), atol=0.5)


def pil_and_tensor(image):
    return TF.pil_to_tensor(image).float()[None]


def test_resampling_matches_pils_bicubic_crop_and_resize():
    image = ColourImages(1)[0][0]
    rng = np.random.default_rng(0)
    for _ in range(40):
        h, w = (int(v) for v in rng.integers(4, 29, 2))
        top, left = int(rng.integers(0, 29 - h)), int(rng.integers(0, 29 - w))
        size = int(rng.choice([16, 32]))
        shrinks_both = h > size and w > size        # Pillow's pass order there is not always ours
        theirs = pil_and_tensor(TF.resized_crop(image, top, left, h, w, [size, size], TF.InterpolationMode.BICUBIC))
        box = torch.tensor([[top, left, h, w]], dtype=torch.float64)
        for flip in (False, True):
            ours = common.resample_crops(pil_and_tensor(image), box, size, torch.tensor([flip]))
            expected = theirs.flip(-1) if flip else theirs
            assert (ours - expected).abs().max() <= (12 if shrinks_both else 2), (top, left, h, w, size)


@pytest.mark.parametrize("op", range(4))
def test_each_colour_operation_matches_torchvisions_pil_one(op):
    image = ColourImages(1)[0][0]
    factors = [0.6, 1.4] if op < 3 else [-0.1, 0.07]
    for factor in factors:
        pil_op = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue][op]
        theirs = pil_and_tensor(pil_op(image, factor))
        ours = common.adjust_color(pil_and_tensor(image), op, torch.tensor(factor).view(1, 1, 1, 1))
        diff = (ours - theirs).abs()
        if op < 3:
            assert diff.max() <= 1, (op, factor)
        else:                                # hue: PIL's 8-bit HSV rounds a few pixels otherwise
            assert diff.max() <= 4 and diff.mean() < 0.01, (factor, diff.max(), diff.mean())


def test_grayscale_solarize_and_blur_match_pil():
    image = ColourImages(1)[0][0]
    x = pil_and_tensor(image)
    assert torch.equal(common.luma(x), pil_and_tensor(image.convert("L")))
    assert torch.equal(torch.where(x >= 128, 255 - x, x), pil_and_tensor(ImageOps.solarize(image, 128)))
    crop = image.resize((32, 32), Image.BICUBIC)
    for radius in (0.02, 0.3, 1.0, 2.0):
        theirs = pil_and_tensor(crop.filter(ImageFilter.GaussianBlur(radius)))
        ours = common.box_blur(pil_and_tensor(crop), [radius])
        assert (ours - theirs).abs().max() <= 2, radius
    assert torch.equal(common.box_blur(x, [None]), x)


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
        assert all((levels(a) - levels(b)).abs().mean() < 0.5 for a, b in zip(pil_crops, crops))


def test_batched_crops_need_images_of_one_size():
    class TwoSizes(ColourImages):
        def __getitem__(self, i):
            image, label = super().__getitem__(i)
            return (image.resize((20, 20)) if i == 1 else image), label
    dataset = common.SeededDataset(TwoSizes(3), augmentation(), batched=True)
    with pytest.raises(SystemExit, match="--batched_crops needs images of one size"):
        dataset.__getitems__([0, 1, 2])


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


def test_crop_boxes_are_torchvisions_for_every_seed_and_shape():
    """`random_resized_crop_box` draws as RandomResizedCrop.get_params does: same box, same
    generator state after, also where ten misses fall back to the central crop (extreme shapes)."""
    from torchvision import transforms
    for seed in range(300):
        for height, width, scale in ((28, 28, (0.05, 0.4)), (28, 28, (0.4, 1.0)), (10, 300, (0.9, 1.0)),
                                     (300, 10, (0.9, 1.0)), (375, 500, (0.14, 1.0))):
            torch.manual_seed(seed)
            expected = transforms.RandomResizedCrop.get_params(torch.empty(0, height, width), list(scale),
                                                               [3 / 4, 4 / 3])
            state = torch.get_rng_state()
            torch.manual_seed(seed)
            assert common.random_resized_crop_box(height, width, scale) == tuple(expected)
            assert torch.equal(torch.get_rng_state(), state)
