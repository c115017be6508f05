"""`--batched_crops`: DINO's multi-crop cut on the training device, for speed only.

The loader workers decode each image (on a GPU they only read baseline JPEGs, which the device
decodes with nvJPEG) and make the PIL path's random draws from the same per-sample seeds; the
training device cuts, colours, blurs and normalises the crops with tensor operations. The draws,
and so the crop geometry, are the PIL path's; the pixels differ by rounding and resampling.

Optional: `common.py` never imports this file. A fork may delete it with the lines that call it
(marked `# device_crops`) and `--batched_crops` goes with it.
"""
import contextlib
import dataclasses
import io
import multiprocessing
import re
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import io as tv_io
from torchvision import transforms
from torchvision.transforms import functional as TF

import common


def add_args(parser):
    """The `--batched_crops` flag, in the multi-crop group when the parser has one."""
    groups = [g for g in parser._action_groups if g.title == "multi-crop augmentation"]
    group = groups[0] if groups else parser
    group.add_argument("--batched_crops", default=False, type=common.bool_flag,
                       help="loader workers only decode the images (on a GPU: read baseline "
                            "JPEGs, which nvJPEG decodes there) and make the PIL path's draws; "
                            "the training device cuts the crops with tensor operations: pixels "
                            "within 1 level of 255 of the PIL path's on average, at most 32")


class BatchedCrops(common.SeededDataset):
    """A `SeededDataset` whose batches are uint8 images and their draws (`UncroppedBatch`), cut
    on `device` by `common.crops_on_device`."""

    def __init__(self, seeded, device):
        super().__init__(seeded.base, seeded.transform, seeded.seed)
        self.host_decoded = None  # files decoded by the workers, when the device decodes JPEGs
        if torch.device(device).type == "cuda":
            self.decode_jpegs_on_device()

    collate = staticmethod(torch.utils.data.default_convert)  # the batch is made here

    def __getitems__(self, indices):
        """((`UncroppedBatch`, geometry), labels) of a batch."""
        pairs = [i if isinstance(i, tuple) else (i, self.epoch) for i in indices]
        images, labels = zip(*(self.base[i] for i, _ in pairs))
        pixels = [TF.pil_to_tensor(image.convert("RGB")) if isinstance(image, Image.Image)
                  else image for image in images]  # an `EncodedJpeg` is decoded on the device
        if self.host_decoded is not None:
            with self.host_decoded.get_lock():
                self.host_decoded.value += sum(torch.is_tensor(image) for image in pixels)
        seeds = [common.sample_seed(self.seed, epoch, index) for index, epoch in pairs]
        in_main_process = torch.utils.data.get_worker_info() is None
        with torch.random.fork_rng(devices=[], enabled=in_main_process):
            return draw_multicrop(self.transform, pixels, seeds), torch.tensor(labels)

    def decode_jpegs_on_device(self):
        """On a GPU: an image folder's workers read its JPEGs, the device decodes them
        (`images_on_device`); the files they decode themselves are counted (`host_decoded`)."""
        folder = self.base
        while isinstance(folder, torch.utils.data.Subset):  # --holdout
            folder = folder.dataset
        if isinstance(folder, common.ImageFolderSafe):
            folder.loader = read_jpeg_or_decode
            self.host_decoded = multiprocessing.Value("l", 0)


def host_decoded_images(dataset, device):
    """Collective: {"host_decoded_images": n}, the files of all ranks that the loader workers
    decoded as the device's decoder cannot read them; {} where the device decodes no JPEGs."""
    if getattr(dataset, "host_decoded", None) is None:
        return {}
    count = torch.tensor([dataset.host_decoded.value], device=device)
    return {"host_decoded_images": int(common.all_reduce_sum(count).item())}



@dataclasses.dataclass
class UncroppedBatch:
    """`--batched_crops`: a batch as loader workers make it (`draw_multicrop`), its crops not yet
    cut: uint8 images [3, H, W] of any sizes (on a GPU also `EncodedJpeg` files), each view's
    draws (plain data), the normalisation."""
    images: list
    views: list
    mean: tuple
    std: tuple

    def cut(self, device):
        """The crops on `device` (`common.crops_on_device` calls it)."""
        threads = torch.get_num_threads()
        if torch.device(device).type == "cpu":  # thousands of small operations: more threads
            torch.set_num_threads(1)              # only add synchronisation
        try:
            return multicrop_pixels(self, device)
        finally:
            torch.set_num_threads(threads)

    def pin_memory(self):
        """The DataLoader pins (on a GPU) the decoded images only: the draws stay plain data, the
        JPEG files' bytes go to nvJPEG, which reads them from the host."""
        images = [image.pin_memory() if torch.is_tensor(image) else image for image in self.images]
        return dataclasses.replace(self, images=images)


def draw_multicrop(augment, images, seeds):
    """The loader worker's half: (`UncroppedBatch`, geometry) of images [3, H, W] (any sizes), with
    the PIL path's draws from each image's seed, as one dict of per-sample lists a view."""
    draws = []
    heights_widths = [image_size(image) for image in images]
    for (height, width), seed in zip(heights_widths, seeds):
        torch.default_generator.manual_seed(seed)
        draws.append([draw_crop(height, width, scale, photometric)
                      for _, scale, photometric in augment.plan()])
    sizes = torch.tensor([[w, h] for h, w in heights_widths], dtype=torch.float64)  # W, H
    width, height = sizes.unbind(1)
    views, geometry = [], []
    for k, (size, _, _) in enumerate(augment.plan()):
        view = {name: [sample[k][name] for sample in draws] for name in draws[0][k]}
        views.append(dict(view, size=size))
        top, left, h, w = torch.tensor(view["box"], dtype=torch.float64).unbind(1)
        box = torch.stack([left / width, top / height, w / width, h / height], 1).float()
        geometry.append({"box": box, "flip": torch.tensor(view["flip"]),
                         "image_size": sizes.float()})
    return UncroppedBatch(images, views, augment.mean, augment.std), geometry


def multicrop_pixels(batch, device):
    """The training device's half: an `UncroppedBatch`'s crops, cut on `device` by torchvision's
    tensor operations (an exact Gaussian for PIL's box blur). Against the PIL path's pixels: a
    mean |difference| under 1 level of 255 (0.5 to 0.8 on 500 x 375 JPEGs), at most 32."""
    images = images_on_device(batch.images, device)
    mean = on_device(batch.mean, device).view(1, 3, 1, 1)
    std = on_device(batch.std, device).view(1, 3, 1, 1)
    crops = []
    for view in batch.views:
        x = torch.cat([F.interpolate(image[None, :, top:top + h, left:left + w].float(),
                                     size=(view["size"],) * 2, mode="bicubic", antialias=True)
                       for image, (top, left, h, w) in zip(images, view["box"])])  # levels 0..255
        flip = on_device(view["flip"], device).view(-1, 1, 1, 1)
        x = torch.where(flip, x.flip(-1), x).clamp(0, 255)
        x = color_jitter(x, view["jitter"])
        gray = on_device(view["gray"], device).view(-1, 1, 1, 1)
        x = torch.where(gray, grayscale(x).expand_as(x), x)
        x = gaussian_blur(x, view["blur"])
        solarize = on_device(view["solarize"], device).view(-1, 1, 1, 1)
        x = torch.where(solarize & (x >= 128), 255 - x, x)
        crops.append((x.round() / 255 - mean) / std)  # 8-bit levels, as PIL's images
    return crops


def on_device(values, device):
    """`values` (a list or a host tensor) on `device`, through pinned memory to a GPU: a copy from
    pageable memory (`torch.tensor(values, device=device)`) waits for every queued kernel."""
    values = torch.as_tensor(values)
    pinned = values.pin_memory() if torch.device(device).type == "cuda" else values
    return pinned.to(device, non_blocking=True)


@dataclasses.dataclass
class EncodedJpeg:
    """A JPEG file read but not decoded, for the training device's decoder (nvJPEG on a GPU)."""
    data: torch.Tensor  # the file's bytes, uint8 [n]
    height: int  # from its header
    width: int
    path: str


def image_size(image):
    """(height, width) of a uint8 [3, H, W] image or an `EncodedJpeg`."""
    if isinstance(image, EncodedJpeg):
        return image.height, image.width
    return tuple(image.shape[1:])


def read_jpeg_or_decode(path):
    """An image folder's loader when the device decodes (`SeededDataset.decode_jpegs_on_device`):
    a whole (ending in its EOI marker) baseline 8-bit RGB JPEG as `EncodedJpeg`, read in about
    0.1 ms; any other file (PNG, CMYK, grayscale, progressive) as `load_image` decodes it."""
    with contextlib.suppress(Exception):  # unreadable: `load_image` names the file
        data = Path(path).read_bytes()
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            baseline = img.format == "JPEG" and not img.info.get("progressive")
            # a marker inside the (last) scan but restarts, or none ending it: damaged? PIL decides
            scan = data[data.rfind(b"\xff\xda") + 2:]  # (an EXIF thumbnail's scan comes first)
            marker = re.search(rb"\xff[^\x00\xd0-\xd7]", scan[:-2])
            whole = scan.endswith(b"\xff\xd9") and not marker
            if baseline and img.mode == "RGB" and whole:
                pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return EncodedJpeg(pixels, img.height, img.width, str(path))
    return common.load_image(path)


def images_on_device(images, device):
    """uint8 [3, H, W] images on `device`: tensors copied, `EncodedJpeg`s decoded there in one
    call (batched by nvJPEG on a GPU); a file that decoder refuses is decoded by PIL, with a
    warning naming it."""
    jpegs = [i for i, image in enumerate(images) if isinstance(image, EncodedJpeg)]
    out = [image if i in jpegs else image.to(device, non_blocking=True)
           for i, image in enumerate(images)]
    if not jpegs:
        return out
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders (for TorchCodec)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            decoded = tv_io.decode_jpeg([images[i].data for i in jpegs], device=device,
                                        mode=tv_io.ImageReadMode.RGB)
        except RuntimeError:  # one file it cannot read stops the batched call: each alone
            decoded = [decode_jpeg_or_warn(images[i], device) for i in jpegs]
    for i, image in zip(jpegs, decoded):
        out[i] = image
    return out


def decode_jpeg_or_warn(jpeg, device):
    """One `EncodedJpeg` decoded on `device`, or by PIL when the device's decoder refuses it."""
    try:
        return tv_io.decode_jpeg(jpeg.data, device=device, mode=tv_io.ImageReadMode.RGB)
    except RuntimeError as e:
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        common.log(f"warning: {jpeg.path}: the {torch.device(device).type} JPEG decoder refused it "
            f"({reason}); decoded on the CPU by PIL")
        return TF.pil_to_tensor(common.load_image(jpeg.path)).to(device)


def draw_crop(height, width, scale, photometric):
    """One crop's parameters, drawn as `crop_and_flip` and the `photometric` pipeline draw them."""
    empty = torch.empty(0, height, width)
    box = transforms.RandomResizedCrop.get_params(empty, list(scale), [3 / 4, 4 / 3])
    crop = dict(box=box, flip=bool(torch.rand(1).item() < 0.5), jitter=None, gray=False,
                blur=None, solarize=False)
    for t in photometric.transforms:
        if isinstance(t, transforms.RandomApply):  # the colour jitter
            if not t.p < torch.rand(1).item():
                j = t.transforms[0]
                order, *factors = j.get_params(j.brightness, j.contrast, j.saturation, j.hue)
                crop["jitter"] = (order.tolist(), factors)
        elif isinstance(t, transforms.RandomGrayscale):
            crop["gray"] = torch.rand(1).item() < t.p
        elif isinstance(t, common.RandomGaussianBlur):
            crop["blur"] = t.draw()
        elif isinstance(t, transforms.RandomSolarize):
            crop["solarize"] = torch.rand(1).item() < t.p
    return crop


# The pixel operations of `multicrop_pixels`: float images [N, 3, h, w] of levels 0..255, on any
# device (host data reaches it by `on_device`).
def grayscale(x):
    """torchvision's luma, [N, 1, h, w]."""
    return (x * on_device([0.2989, 0.587, 0.114], x.device).view(1, 3, 1, 1)).sum(1, keepdim=True)


def shift_hue(x, shift):
    """torchvision's adjust_hue per sample: hue rotated by `shift` (of the circle) in HSV."""
    maxc = x.amax(1, keepdim=True)
    minc = x.amin(1, keepdim=True)
    chroma = maxc - minc
    rc, gc, bc = ((maxc - x) / torch.where(chroma > 0, chroma, 1.0)).unbind(1)
    r = x[:, 0] == maxc[:, 0]
    g = x[:, 1] == maxc[:, 0]
    hue = torch.where(r, bc - gc, torch.where(g, 2 + rc - bc, 4 + gc - rc))[:, None]
    hue = torch.remainder(hue / 6 + shift.view(-1, 1, 1, 1), 1)
    phases = on_device([5.0, 3.0, 1.0], x.device).view(1, 3, 1, 1)
    k = torch.remainder(phases + 6 * hue, 6)  # HSV -> RGB
    return maxc - chroma * torch.minimum(k, 4 - k).clamp(0, 1)


def adjust_color(x, op, f):
    """torchvision's brightness, contrast, saturation or hue (op 0-3) by f [N, 1, 1, 1]; blends
    truncated to levels, as PIL's."""
    if op == 3:
        return shift_hue(x, f)
    if op == 0:
        degenerate = 0.0
    elif op == 1:
        degenerate = grayscale(x).mean((1, 2, 3), keepdim=True)
    else:
        degenerate = grayscale(x)
    return torch.floor((degenerate + f * (x - degenerate)).clamp(0, 255))


def color_jitter(x, jitters):
    """torchvision's ColorJitter per sample, in each sample's order with its factors (None:
    unchanged)."""
    factors = [j[1] if j is not None else [1.0, 1.0, 1.0, 0.0] for j in jitters]
    factors = on_device(factors, x.device)
    for position in range(4):
        for op in range(4):  # which samples, in plain Python: the device is never waited for
            chosen = [i for i, j in enumerate(jitters) if j is not None and j[0][position] == op]
            if chosen:
                rows = on_device(chosen, x.device)
                x[rows] = adjust_color(x[rows], op, factors[rows, op].view(-1, 1, 1, 1))
    return x


def gaussian_blur(x, sigmas):
    """Gaussian blur per sample (None: none) as [N, size, size] matrices: one matmul, not a call
    per image."""
    blurred = [i for i, s in enumerate(sigmas) if s is not None]
    if not blurred:
        return x
    sigma = on_device([sigmas[i] for i in blurred], x.device)[:, None]
    radius = int(3 * np.float32(max(sigmas[i] for i in blurred))) + 1  # float32, as the logged runs
    size = x.shape[-1]
    offsets = torch.arange(-radius, radius + 1, device=x.device)
    weights = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    weights = weights / weights.sum(1, keepdim=True)  # [n, K]
    source = (torch.arange(size, device=x.device)[:, None] + offsets).clamp(0, size - 1)  # [s, K]
    m = torch.zeros(len(blurred), size, size, device=x.device).scatter_add_(
        2, source.expand(len(blurred), -1, -1), weights[:, None].expand(-1, size, -1))[:, None]
    rows = on_device(blurred, x.device)
    x = x.clone()
    x[rows] = m @ x[rows] @ m.transpose(-1, -2)
    return x
