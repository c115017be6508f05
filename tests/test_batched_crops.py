"""`--batched_crops`: loader workers draw each sample's crops (`draw_multicrop`) and the
training device cuts them from the uint8 images (`multicrop_pixels`, via `crops_on_device`),
against the per-image PIL path it replaces: the same draws and geometry, pixels within the stated
tolerance on natural-looking JPEGs and on images of mixed sizes, a fixed number of operations
whatever the batch (the launch budget), bit for bit this version's crops (a pinned file), the same
batches with and without loader workers or prefetching, every tensor made on the images' device;
and the CPU bf16 attention path of `common.Attention`."""
import collections
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import functional as TF

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import device_crops  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(ROOT / "extras" / "perf"))
import jpeg_folder  # noqa: E402


class ColourImages(torch.utils.data.Dataset):
    """28 x 28 RGB images with smooth colour fields and sharp edges (so that hue, saturation,
    blur and resampling all change pixels), labelled by index."""

    def __init__(self, n=24, size=28, seed=0):
        rng = np.random.default_rng(seed)
        self.images = []
        for _ in range(n):
            colours = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            pixels = np.asarray(Image.fromarray(colours).resize((size, size), Image.BICUBIC)).copy()
            x0, y0 = rng.integers(0, size // 2, 2)
            pixels[y0:y0 + size // 3, x0:x0 + size // 3] = rng.integers(0, 256, 3)
            self.images.append(Image.fromarray(pixels))

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i


class MixedSizes(ColourImages):
    """ColourImages resized to three sizes in turn: wide, tall, square."""
    SIZES = [(44, 30), (20, 36), (28, 28)]

    def __getitem__(self, i):
        image, label = super().__getitem__(i)
        return image.resize(self.SIZES[i % 3], Image.BICUBIC), label


def augmentation():
    return common.MultiCropAugmentation(local_crops_number=3, global_crop_size=32,
                                        local_crop_size=16)


def both_paths(n=24, seed=5, epoch=2):
    """The PIL path's batch and the batched path's, its crops cut on the CPU, of MixedSizes."""
    base, augment = MixedSizes(n), augmentation()
    indices = [(i, epoch) for i in range(n)]
    pil = [common.SeededDataset(base, augment, seed=seed)[i] for i in indices]
    batched = device_crops.BatchedCrops(common.SeededDataset(base, augment, seed=seed), "cpu")
    views, labels = batched.__getitems__(indices)
    return torch.utils.data.default_collate(pil), (common.crops_on_device(views, "cpu"), labels)


def levels(crop):
    """Normalised crops back to 0..255."""
    mean = torch.tensor(common.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(common.IMAGENET_STD).view(1, 3, 1, 1)
    return (crop * std + mean) * 255


def test_batched_crops_have_the_pil_paths_geometry_and_labels():
    ((pil_crops, pil_geometry), pil_labels), ((crops, geometry), labels) = both_paths()
    assert torch.equal(pil_labels, labels)
    assert [c.shape for c in crops] == [c.shape for c in pil_crops]
    for ours, theirs in zip(geometry, pil_geometry):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert len({tuple(size) for size in geometry[0]["image_size"].tolist()}) == 3


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
            device_crops.draw_crop(28, 28, scale, photometric)
        assert torch.equal(torch.get_rng_state(), after_pil), seed


def pixel_differences(pil_crops, crops):
    """|difference| in levels of 255 of every pixel of every view."""
    return torch.cat([(levels(a) - levels(b)).abs().flatten() for a, b in zip(pil_crops, crops)])


def test_batched_pixels_agree_with_the_pil_path_on_natural_jpegs():
    """The tolerance `--batched_crops` states (its help): on DINO's crops (2 x 224 +
    8 x 96) of ImageNet-sized JPEGs (extras/perf/jpeg_folder.py's, 400-640 x 300-500 px), a mean
    |difference| of at most 2 levels of 255 and a 99th percentile of at most 8 (measured 1.5 and
    7; on smaller images, more of the local crops are enlarged: bilinear, not bicubic, samples),
    and the same distribution (channel means and spreads)."""
    files = []
    for index in range(4):
        buffer = io.BytesIO()
        jpeg_folder.draw_image(index, 500, seed=3).save(buffer, "JPEG", quality=90)
        files.append((Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"), index))
    augment, indices = common.MultiCropAugmentation(), [(i, 1) for i in range(len(files))]
    pil = torch.utils.data.default_collate(
        [common.SeededDataset(files, augment, seed=2)[i] for i in indices])
    batched = device_crops.BatchedCrops(common.SeededDataset(files, augment, seed=2), "cpu")
    crops, _ = common.crops_on_device(batched.__getitems__(indices)[0], "cpu")
    diff = pixel_differences(pil[0][0], crops)
    assert diff.mean() <= 2 and np.percentile(diff.numpy(), 99) <= 8, diff.mean()
    for theirs, ours in zip(pil[0][0], crops):
        assert torch.allclose(levels(theirs).mean((0, 2, 3)), levels(ours).mean((0, 2, 3)), atol=2)
        assert torch.allclose(levels(theirs).std((0, 2, 3)), levels(ours).std((0, 2, 3)), atol=2)


def test_batched_pixels_agree_with_the_pil_path_on_small_images_of_three_sizes():
    """Images of 20-44 px with sharp edges, mostly enlarged: further from PIL's bicubic than
    natural ones, still within 2 levels on average."""
    (((pil_crops, _), _), ((crops, _), _)) = both_paths()
    diff = pixel_differences(pil_crops, crops)
    assert diff.mean() <= 2 and np.percentile(diff.numpy(), 99) <= 16, diff.mean()


class OperatorCount(TorchDispatchMode):
    """Every operator dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def test_the_crops_of_a_batch_cost_at_most_100_operators_whatever_the_batch():
    """The launch budget, counted for DINO's 2 x 224 + 8 x 96 on the `meta` device (the host-to-
    device copies counted, nothing computed). The cut issues the same operators whatever the
    batch: its loops run over the views' output sizes and the jitter slots only, every per-image
    or per-crop difference is in the numbers of the pack and the shapes of its tensors, not in
    which operators run. So images of 3 sizes, 4 or 12 of them (and of any content), give the
    count of 128 ImageNet images. Views (`view`, `expand`, `split`...) launch nothing: at most
    100 operators that compute; before this version: 5,360 for 128 images (10,400 with views)."""
    augment = common.MultiCropAugmentation()
    counts = []
    for n in (4, 12):
        dataset = device_crops.BatchedCrops(common.SeededDataset(MixedSizes(n), augment), "cpu")
        views, _labels = dataset.__getitems__(range(n))
        with OperatorCount() as count:
            common.crops_on_device(views, "meta")
        counts.append(count.ops)
    assert counts[0] == counts[1]
    computing = sum(n for op, n in counts[0].items() if not getattr(op, "is_view", False))
    assert computing <= 100, counts[0]
    assert sum(counts[0].values()) <= 150, counts[0]


def test_the_device_half_on_a_cpu_is_bit_for_bit_the_logged_runs_batched_crops():
    """tests/data/batched_crops_golden.pt: the crops and geometry that this version cuts (the
    tiles of one `roi_align`, the jitter slots) of two images (44 x 30 and 26 x 40) whose 10 views
    flip, jitter, turn grey, blur and solarize: a change of the pixels shows here first (the
    geometry is the PIL path's, tested above)."""
    golden = torch.load(ROOT / "tests" / "data" / "batched_crops_golden.pt")
    batch = device_crops.draw_multicrop(augmentation(), golden["images"], golden["seeds"])
    crops, geometry = common.crops_on_device(batch, "cpu")
    for ours, theirs in zip(crops, golden["crops"], strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(geometry, golden["geometry"], strict=True):
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def six_samples():
    """A batched path's batch of 6 MixedSizes, (`UncroppedBatch`, geometry), some of its crops
    jittered and some blurred."""
    dataset = device_crops.BatchedCrops(common.SeededDataset(MixedSizes(6), augmentation()), "cpu")
    views, _labels = dataset.__getitems__(range(6))
    return views


def test_the_device_half_makes_every_tensor_on_the_images_device():
    """On the `meta` device a tensor made on the host (torch.tensor without `device`) would meet
    the images in an operation and raise: the GPU path's device placement, checked on a CPU."""
    crops, geometry = common.crops_on_device(six_samples(), "meta")
    assert [c.shape for c in crops] == [(6, 3, 32, 32)] * 2 + [(6, 3, 16, 16)] * 3
    assert all(c.device.type == "meta" for c in crops)
    assert all(v.device.type == "meta" for g in geometry for v in g.values())


def test_the_device_half_never_makes_the_host_wait():
    """extras/perf/sync_counter.py counts on a CPU what would make the host wait for a GPU (a
    value read, a data-dependent shape, a blocking copy): cutting the crops has none, so the host
    queues them while the GPU still runs the step before."""
    sys.path.insert(0, str(ROOT / "extras" / "perf"))
    from sync_counter import SyncCounter
    views = six_samples()
    with SyncCounter() as counter:
        common.crops_on_device(views, "cpu")
    assert counter.count == 0, counter.sites


def as_float(image):
    return TF.pil_to_tensor(image).float()[None] / 255


def one_slot(op, factors, x):
    """A blend slot's parameters [K, 1, 1] for tiles that are whole images [K, 3, L]."""
    pixels = x.shape[-1]
    slots = [[f, (1 - f) * (op == 2), (1 - f) / pixels * (op == 1), 0.0] for f in factors]
    return [torch.tensor(column, dtype=torch.float32).view(-1, 1, 1) for column in zip(*slots)]


@pytest.mark.parametrize("op", range(4))
def test_each_colour_operation_is_torchvisions(op):
    """Per sample factors, torchvision's formulas (on levels 0..255; the blends truncated to whole
    levels, as PIL's are)."""
    x = as_float(ColourImages(1)[0][0]).repeat(2, 1, 1, 1)
    factors = [0.6, 1.4] if op < 3 else [-0.1, 0.07]
    tv_op = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue][op]
    theirs = torch.cat([tv_op(x[i:i + 1], f) for i, f in enumerate(factors)]) * 255
    tiles = (x * 255).flatten(2)
    luma = torch.tensor(device_crops.LUMA).view(1, 1, 3).expand(2, 1, 3)
    if op < 3:
        ours = device_crops.blend(tiles, one_slot(op, factors, tiles), luma, torch.arange(2),
                                  torch.zeros(2, 1, 1))
    else:
        phases = torch.tensor([[5.0, 3, 1]]) + 6 * torch.tensor(factors)[:, None]
        mix = torch.tensor([[0.0, 1, -1], [-1, 0, 1], [1, -1, 0]]).expand(2, 3, 3)
        ours = device_crops.shift_hue(tiles, phases[..., None], mix)
    assert (ours.view_as(theirs) - theirs).abs().max() <= (1 if op < 3 else 1e-3), op


def loader_batches(batched, num_workers, n=16, prefetched=False):
    """The crops, geometry and labels of an epoch of MixedSizes, cut on the CPU."""
    dataset = common.SeededDataset(MixedSizes(n), augmentation(), seed=1)
    if batched:
        dataset = device_crops.BatchedCrops(dataset, "cpu")
    loader, sampler = common.make_loader(dataset, 8, num_workers=num_workers, seed=1)
    sampler.set_epoch(3)
    if prefetched:  # as the training scripts wrap it; on a CPU each batch is cut in line
        loader = device_crops.Prefetched(loader, torch.device("cpu"))
        assert len(loader) == 2 and loader.dataset is dataset
    return [(common.crops_on_device(views, "cpu"), labels) for views, labels in loader]


def test_the_loader_gives_the_same_batches_and_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    batches = [loader_batches(batched, num_workers=0) for batched in (False, True)]
    assert torch.equal(torch.get_rng_state(), state)
    for ((pil_crops, pil_geometry), pil_labels), ((crops, geometry), labels) in zip(*batches):
        assert torch.equal(pil_labels, labels)
        assert all(torch.equal(a["box"], b["box"]) and torch.equal(a["flip"], b["flip"])
                   for a, b in zip(pil_geometry, geometry))
        # the PIL path's crops: another sample's would differ by tens of levels
        assert all((levels(a) - levels(b)).abs().mean() < 2 for a, b in zip(pil_crops, crops))


def test_a_loader_worker_gives_the_batches_of_the_main_process():
    """The draws made in a worker process, the images shipped uint8: the same crops, geometry
    and labels, bit for bit, as without a worker."""
    in_worker, in_main = (loader_batches(True, num_workers=workers) for workers in (1, 0))
    prefetched = loader_batches(True, num_workers=0, prefetched=True)
    assert len(in_worker) == len(in_main) == len(prefetched) == 2
    for ((crops, geometry), labels), ((crops0, geometry0), labels0) in [
            *zip(in_worker, in_main), *zip(prefetched, in_main)]:
        assert torch.equal(labels, labels0)
        assert all(torch.equal(a, b) for a, b in zip(crops, crops0, strict=True))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(geometry, geometry0) for k in a)


def test_cpu_bf16_attention_is_the_explicit_one_and_agrees_with_the_fused_one(monkeypatch):
    torch.manual_seed(0)
    attention = common.build_backbone("vit_pico", 4, img_size=32).blocks[0].attn
    assert isinstance(attention, common.Attention)
    sdpa_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa_calls.append(1) or sdpa(*a, **k))
    x = torch.randn(4, 17, 64)
    results = []
    for bf16 in (False, True):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = attention(xi)
        out.float().sum().backward()
        results.append((out.float(), xi.grad))
        assert len(sdpa_calls) == 1  # fp32: timm's fused kernel; CPU bf16: the explicit matmuls
    (reference, reference_grad), (ours, grad) = results
    assert torch.allclose(ours, reference, atol=0.03, rtol=0.03)           # bf16 rounding only
    assert torch.allclose(grad, reference_grad, atol=0.03, rtol=0.03)
    attention.fused_attn = False  # as tests/test_trajectories.py sets it: explicit in fp32 too
    with torch.no_grad():
        attention(x)
    assert not attention.fused_attn and len(sdpa_calls) == 1
