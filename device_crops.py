"""`--batched_crops`: DINO's multi-crop cut on the training device, for speed only.

The loader workers read each image (on a GPU they only read baseline JPEGs, which the device
decodes with nvJPEG on a stream of its own), make the PIL path's random draws from the same
per-sample seeds and pack a batch into two tensors: its images side by side on one uint8 canvas, and
every draw as numbers. The device cuts the crops of all views of one output size in one batched
resize (`roi_align`), then colours, blurs and normalises them with per-sample parameters in tensor
operations of fixed shapes. The draws, and so the crop geometry, are the PIL path's; the pixels
differ by resampling and rounding. `Prefetched` cuts the next batch while the GPU computes.

Optional: `common.py` never imports this file. A fork may delete it with the lines that call it
(marked `# device_crops`) and `--batched_crops` goes with it.
"""
import contextlib
import dataclasses
import io
import math
import multiprocessing
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import io as tv_io
from torchvision import transforms
from torchvision.ops import roi_align
from torchvision.transforms import functional as TF

import common

TOLERANCE = "pixels within 2 levels of 255 of the PIL path's on average, 99%% within 8"
LUMA = (0.2989, 0.587, 0.114)  # torchvision's
SLOTS = 6  # colour jitter: 3 blends before the hue, 3 after (one sample's order fills some)
_STREAMS = {}  # (device, role) -> the side stream


def add_args(parser):
    """The `--batched_crops` flag, in the multi-crop group when the parser has one."""
    groups = [g for g in parser._action_groups if g.title == "multi-crop augmentation"]
    group = groups[0] if groups else parser
    group.add_argument("--batched_crops", default=False, type=common.bool_flag,
                       help="loader workers only read the images (on a GPU: baseline JPEGs, "
                            "which nvJPEG decodes there) and make the PIL path's draws; the "
                            f"training device cuts the crops in batched operations: {TOLERANCE}")


class BatchedCrops(common.SeededDataset):
    """A `SeededDataset` whose batches are `UncroppedBatch`es, cut on the device by
    `common.crops_on_device` (or `Prefetched`)."""

    def __init__(self, seeded, device):
        super().__init__(seeded.base, seeded.transform, seeded.seed)
        self.host_decoded = None  # files decoded by the workers, when the device decodes JPEGs
        if torch.device(device).type == "cuda":
            self.decode_jpegs_on_device()

    collate = staticmethod(torch.utils.data.default_convert)  # the batch is made here

    def __getitems__(self, indices):
        """((`UncroppedBatch`, None), labels) of a batch: the geometry comes with the crops."""
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
    """A batch as a loader worker makes it (`draw_multicrop`): `canvas`, uint8 [3, H, W], every
    image in a 1 px border of its edge pixels (the resize reads no neighbour); `pack`, float32,
    every draw and geometry (`pack_draws`), one copy to the device; `jpegs`, the (`EncodedJpeg`,
    top, left) the device decodes into the canvas; `shape`, plain numbers."""
    canvas: torch.Tensor
    pack: torch.Tensor
    jpegs: list
    shape: dict

    def cut(self, device):
        """(crops, geometry) on `device` (`common.crops_on_device` calls it)."""
        threads = torch.get_num_threads()
        if torch.device(device).type == "cpu":  # small operations: more threads only add
            torch.set_num_threads(1)              # synchronisation (and contend with the loader)
        try:
            return multicrop_pixels(self, torch.device(device))
        finally:
            torch.set_num_threads(threads)

    def pin_memory(self):
        """The DataLoader pins (on a GPU) the canvas and the draws; JPEG bytes go to nvJPEG."""
        return dataclasses.replace(self, canvas=self.canvas.pin_memory(),
                                   pack=self.pack.pin_memory())


def draw_multicrop(augment, images, seeds):
    """The loader worker's half: (`UncroppedBatch`, None) of images [3, H, W] (any sizes) or
    `EncodedJpeg`s, with the PIL path's draws from each image's seed."""
    draws = []
    heights_widths = [image_size(image) for image in images]
    for (height, width), seed in zip(heights_widths, seeds):
        torch.default_generator.manual_seed(seed)
        draws.append([draw_crop(height, width, scale, photometric)
                      for _, scale, photometric in augment.plan()])
    corners, canvas_size = place(heights_widths)
    canvas = torch.zeros(3, *canvas_size, dtype=torch.uint8)
    jpegs = []
    for image, (top, left) in zip(images, corners):
        if isinstance(image, EncodedJpeg):
            jpegs.append((image, top, left))
        else:
            bordered = F.pad(image[None], (1, 1, 1, 1), mode="replicate")[0]
            canvas[:, top:top + bordered.shape[1], left:left + bordered.shape[2]] = bordered
    pack, shape = pack_draws(augment, draws, heights_widths, corners)
    return UncroppedBatch(canvas, pack, jpegs, shape), None


def place(heights_widths):
    """The top-left corner of each image with its border on one canvas, in shelves of the
    tallest first (little padding), and the canvas's (height, width)."""
    sizes = [(h + 2, w + 2) for h, w in heights_widths]
    width = max(max(w for _, w in sizes), math.isqrt(sum(h * w for h, w in sizes)) + 1)
    corners = [None] * len(sizes)
    x = y = shelf = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i][0]):
        if x + sizes[i][1] > width:
            y += shelf
            x = shelf = 0
        corners[i] = (y, x)
        x += sizes[i][1]
        shelf = max(shelf, sizes[i][0])
    return corners, (y + shelf, width)


def pack_draws(augment, draws, heights_widths, corners):
    """Every draw as one float32 tensor and the shapes to read it. The crops of one output size
    are cut as tiles of the sizes' common divisor, so that one `roi_align` cuts them all and the
    colour operations see one tensor [tiles, 3, pixels]; `multicrop_pixels` reads the parts."""
    plan = augment.plan()
    sizes = [size for size, _, _ in plan]
    groups = sorted(set(sizes), key=sizes.index)
    tile = math.gcd(*sizes)
    crops = [(k, n) for size in groups for k in range(len(plan)) if sizes[k] == size
             for n in range(len(draws))]
    rois, tiles, scalars, hue, gray, coef, threshold = [], [], [], [], [], [], []
    for m, (k, n) in enumerate(crops):
        d, side = draws[n][k], sizes[k] // tile
        top, left, h, w = d["box"]
        top, left = top + corners[n][0] + 1, left + corners[n][1] + 1
        for ty in range(side):
            for tx in range(side):
                sx = side - 1 - tx if d["flip"] else tx
                rois.append([0, left + sx * w / side, top + ty * h / side,
                             left + (sx + 1) * w / side, top + (ty + 1) * h / side])
        tiles += [m] * side ** 2
        scalars.append(jitter_slots(d["jitter"], sizes[k]) + [float(d["flip"])])
        shift = d["jitter"][1][3] if d["jitter"] else 0.0
        hue.append([5 + 6 * shift, 3 + 6 * shift, 1 + 6 * shift])  # HSV -> RGB phases
        gray.append(np.outer(np.ones(3), LUMA) if d["gray"] else np.eye(3))
        coef.append(-0.5 / d["blur"] ** 2 if d["blur"] else -1e9)  # exp(-1e9 k^2): no blur
        threshold.append(128.0 if d["solarize"] else 256.0)
    repeat = np.asarray(tiles)
    radius = int(3 * max(t.sigma[1] for _, _, p in plan for t in p.transforms
                         if isinstance(t, common.RandomGaussianBlur))) + 1
    weights = np.exp(np.asarray(coef)[:, None] * np.arange(-radius, radius + 1) ** 2)
    weights = np.repeat(weights / weights.sum(1, keepdims=True), 3, axis=0)  # each channel
    std = np.asarray(augment.std)
    sizes_hw = np.asarray([[w, h] for h, w in heights_widths], dtype=np.float64)
    geometry = []
    for k in range(len(plan)):
        top, left, h, w = np.asarray([draws[n][k]["box"] for n in range(len(draws))]).T
        geometry.append(np.stack([left / sizes_hw[:, 0], top / sizes_hw[:, 1], w / sizes_hw[:, 0],
                                  h / sizes_hw[:, 1], [draws[n][k]["flip"] for n in
                                                       range(len(draws))],
                                  *sizes_hw.T], 1).astype(np.float32))  # as the PIL path rounds
    parts = [np.asarray(rois), np.asarray(scalars)[repeat].T, np.asarray(hue)[repeat],
             np.asarray(gray)[repeat], repeat, weights, np.asarray(threshold),
             np.stack(geometry), np.concatenate([LUMA, [0, 1, -1, -1, 0, 1, 1, -1, 0],
                                                 1 / (255 * std), -np.asarray(augment.mean) / std])]
    pack = torch.from_numpy(np.concatenate([p.astype(np.float32).ravel() for p in parts]))
    return pack, dict(split=[p.size for p in parts], tile=tile, tiles=len(tiles),
                      groups=[(size, sizes.count(size)) for size in groups],
                      views=[groups.index(size) for size in sizes], n=len(draws),
                      crops=len(crops), radius=radius,
                      group_crops=[len(draws) * sizes.count(size) for size in groups],
                      group_tiles=[len(draws) * sizes.count(size) * (size // tile) ** 2
                                   for size in groups])


def jitter_slots(jitter, size):
    """(factor, saturation weight, contrast weight, offset) of each of the `SLOTS` blends of a
    crop: its blends before the hue fill the first three slots from the end, those after it the
    last three from the start; an empty slot rounds (its input may be off a level by a hair)."""
    slots = [[1.0, 0.0, 0.0, 0.5] for _ in range(SLOTS)]
    if jitter is not None:
        order, factors = jitter
        q = order.index(3)
        for slot, op in zip([*range(3 - q, 3), *range(3, 6)], [*order[:q], *order[q + 1:]]):
            f = factors[op]
            slots[slot] = [f, (1 - f) * (op == 2), (1 - f) / size ** 2 * (op == 1), 0.0]
    return [value for slot in slots for value in slot]


def multicrop_pixels(batch, device):
    """The training device's half: (crops, geometry) of an `UncroppedBatch`, in a fixed number of
    operations whatever the images or draws (tests/test_batched_crops.py counts them)."""
    s = batch.shape
    pack = batch.pack.to(device, non_blocking=True)
    canvas = canvas_on_device(batch, device).float()
    rois, scalars, hue, gray, tiles, weights, threshold, geometry, const = pack.split(s["split"])
    luma, mix, scale, shift = const.split([3, 9, 3, 3])
    scalars = scalars.view(-1, s["tiles"], 1, 1).unbind(0)
    t = s["tile"]
    x = roi_align(canvas[None], rois.view(-1, 5), t, 1.0, 0, True)  # the antialiased resize
    x = torch.where(scalars[-1][..., None] > 0, x.flip(-1), x).view(-1, 3, t * t)
    tiles = tiles.long()
    luma = luma.expand(s["tiles"], 1, 3)
    zeros = pack.new_zeros(s["crops"], 1, 1)
    blends = [scalars[4 * j:4 * j + 4] for j in range(SLOTS)]
    for slot in blends[:3]:
        x = blend(x, slot, luma, tiles, zeros)
    x = shift_hue(x, hue.view(-1, 3, 1), mix.view(1, 3, 3).expand(s["tiles"], 3, 3))
    for slot in blends[3:]:
        x = blend(x, slot, luma, tiles, zeros)
    x = torch.bmm(gray.view(-1, 3, 3), x)  # grayscale or not
    crops = []
    weights = weights.view(-1, 1, 2 * s["radius"] + 1, 1).split([3 * n for n in s["group_crops"]])
    parts = zip(s["groups"], x.split(s["group_tiles"]), weights,
                threshold.view(-1, 1, 1, 1).split(s["group_crops"]))
    for (size, count), y, w, solarize in parts:
        side = size // t
        y = y.view(-1, side, side, 3, t, t).permute(0, 3, 1, 4, 2, 5).reshape(1, -1, size, size)
        y = blur(y, w, s["radius"]).view(-1, 3, size, size).round()
        y = torch.where(y >= solarize, 255 - y, y)
        y = torch.addcmul(shift.view(1, 3, 1, 1), y, scale.view(1, 3, 1, 1))
        crops.append(y.view(count, s["n"], 3, size, size).unbind(0))
    views = [iter(group) for group in crops]
    geometry = geometry.view(-1, s["n"], 7)
    boxes = geometry[..., :4].unbind(0)
    flips = geometry[..., 4].bool().unbind(0)
    image_size = geometry[0, :, 5:]
    return ([next(views[g]) for g in s["views"]],
            [{"box": b, "flip": f, "image_size": image_size} for b, f in zip(boxes, flips)])


def blend(x, slot, luma, tiles, zeros):
    """One colour jitter slot on tiles [K, 3, L] of levels: f x + s gray + c (sum of the crop's
    gray) + offset, clipped and truncated as PIL's blends; (1, 0, 0, 0.5) rounds."""
    f, saturation, contrast, offset = slot
    gray = torch.bmm(luma, x)  # a 1x1 convolution is slower on a CPU
    sums = zeros.index_add(0, tiles, gray.sum(-1, keepdim=True))
    bias = torch.addcmul(offset, contrast, sums.index_select(0, tiles))
    return torch.addcmul(torch.addcmul(bias, saturation, gray), f, x).clamp(0, 255).floor()


def shift_hue(x, phases, mix):
    """torchvision's adjust_hue per tile (HSV): the hexagonal hue read from the largest channel
    (`mix` gives each channel's next minus previous), shifted by `phases` (5, 3, 1 + 6 shift)."""
    top, channel = x.max(1, keepdim=True)
    chroma = top - x.amin(1, keepdim=True)
    hue = torch.bmm(mix, x).gather(1, channel) / chroma.clamp_min(1e-6)
    k = torch.remainder(torch.add(phases, channel, alpha=2) + hue, 6)
    return torch.addcmul(top, chroma, torch.minimum(k, 4 - k).clamp(0, 1), value=-1)


def blur(y, weights, radius):
    """Each crop's Gaussian [1, 3n, S, S] (PIL extends the edges), one separable pass each way."""
    y = F.pad(y, (radius,) * 4, mode="replicate")
    y = F.conv2d(y, weights, groups=len(weights))
    return F.conv2d(y, weights.transpose(2, 3), groups=len(weights))


class Prefetched:
    """A loader whose `UncroppedBatch`es come cut: on a GPU batch n + 1 is decoded and cut on a
    side stream while step n computes, then handed over (`wait_stream`, `record_stream`); on a
    CPU each is cut in line when asked for. Anything else is the loader's."""

    def __init__(self, loader, device):
        self.loader = loader
        self.device = torch.device(device)

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        side = stream(self.device, "crops")
        ready = None
        for views, labels in self.loader:
            with torch.cuda.stream(side) if side else contextlib.nullcontext():
                batch = (common.crops_on_device(views, self.device), labels)
            if side is None:
                yield batch
                continue
            if ready is not None:
                yield hand_over(ready, side)
            ready = batch
        if ready is not None:
            yield hand_over(ready, side)


def stream(device, role):
    """The side stream `role` of a CUDA device (made once); None elsewhere: the work runs in line."""
    if device.type != "cuda":
        return None
    return _STREAMS.setdefault((device, role), torch.cuda.Stream(device))


def hand_over(batch, side):
    """The current stream waits for `side`'s work on `batch`, whose tensors are recorded on it
    (their memory is not reused while it reads them)."""
    current = torch.cuda.current_stream(side.device)
    current.wait_stream(side)
    (crops, geometry), _labels = batch
    for tensor in [*crops, *(v for g in geometry for v in g.values())]:
        tensor.record_stream(current)
    return batch


def canvas_on_device(batch, device):
    """The canvas on `device`, with the JPEGs that device decodes (`images_on_device`) put in
    their places, each in its border (one copy each: the decoder gives one tensor per file)."""
    canvas = batch.canvas.to(device, non_blocking=True)
    decoded = images_on_device([jpeg for jpeg, _, _ in batch.jpegs], device)
    for image, (_, top, left) in zip(decoded, batch.jpegs):
        bordered = F.pad(image[None], (1, 1, 1, 1), mode="replicate")[0]
        canvas[:, top:top + bordered.shape[1], left:left + bordered.shape[2]] = bordered
    return canvas


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
            if baseline and img.mode == "RGB" and data.endswith(b"\xff\xd9"):
                pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return EncodedJpeg(pixels, img.height, img.width, str(path))
    return common.load_image(path)


def images_on_device(jpegs, device):
    """`EncodedJpeg`s decoded on `device` in one call (batched by nvJPEG on a GPU); a file that
    decoder refuses is decoded by PIL, with a warning naming it. On a GPU the decoder runs on a
    stream of its own that runs nothing else: torchvision's decoder allocates its outputs on the
    caller's stream but writes them from a private stream that waits for none of the caller's
    queued work (pytorch/vision#9606), so memory that queued kernels still read could be written.
    The current stream waits for the decode, and the images are recorded on it."""
    device = torch.device(device)
    if not jpegs:
        return []
    side = stream(device, "decode")
    with torch.cuda.stream(side) if side else contextlib.nullcontext(), \
            warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders (TorchCodec)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            decoded = tv_io.decode_jpeg([jpeg.data for jpeg in jpegs], device=device,
                                        mode=tv_io.ImageReadMode.RGB)
        except RuntimeError:  # one file it cannot read stops the batched call: each alone
            decoded = [decode_jpeg_or_warn(jpeg, device) for jpeg in jpegs]
    if side is not None:
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)
        for image in decoded:
            image.record_stream(current)
    return decoded


def decode_jpeg_or_warn(jpeg, device):
    """One `EncodedJpeg` decoded on `device`, or by PIL when the device's decoder refuses it."""
    try:
        return tv_io.decode_jpeg(jpeg.data, device=device, mode=tv_io.ImageReadMode.RGB)
    except RuntimeError as e:
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        common.log(f"warning: {jpeg.path}: the {device.type} JPEG decoder refused it "
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
