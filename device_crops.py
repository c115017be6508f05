"""`--batched_crops`: DINO's multi-crop cut on the training device, for speed only. Loader
workers read the images (nvJPEG decodes JPEGs on a GPU) and make the PIL path's draws; the device
cuts, colours, blurs and normalises all crops in a fixed number of batched operations: the PIL
path's geometry, its pixels within `TOLERANCE`. Optional: delete it with the lines marked
`# device_crops`, and `--batched_crops` goes with it."""
import contextlib
import dataclasses
import io
import math
import multiprocessing
import typing
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
    """A `SeededDataset` whose batches are `UncroppedBatch`es (cut by `crops_on_device`)."""

    def __init__(self, seeded, device):
        super().__init__(seeded.base, seeded.transform, seeded.seed)
        self.host_decoded = None  # files decoded by the workers, when the device decodes JPEGs
        folder = self.base
        while isinstance(folder, torch.utils.data.Subset):  # --holdout
            folder = folder.dataset
        if torch.device(device).type == "cuda" and isinstance(folder, common.ImageFolderSafe):
            folder.loader = read_jpeg_or_decode  # workers read JPEGs, the device decodes them
            self.host_decoded = multiprocessing.Value("l", 0)

    collate = staticmethod(torch.utils.data.default_convert)  # the batch is made here

    def __getitems__(self, indices):
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


def host_decoded_images(dataset, device):
    """Collective: {"host_decoded_images": files workers decoded}; {} if the device decodes none."""
    if getattr(dataset, "host_decoded", None) is None:
        return {}
    count = torch.tensor([dataset.host_decoded.value], device=device)
    return {"host_decoded_images": int(common.all_reduce_sum(count).item())}


class UncroppedBatch(typing.NamedTuple):  # the DataLoader pins its tensors (on a GPU)
    """A worker's batch: images in 1 px borders of their edges on a uint8 canvas, every draw in
    one float32 `pack` and its `shape`, the (`EncodedJpeg`, top, left) the device decodes."""
    canvas: torch.Tensor
    pack: torch.Tensor
    shape: dict
    jpegs: list

    def cut(self, device):
        threads = torch.get_num_threads()
        if torch.device(device).type == "cpu":  # more threads only add synchronisation and
            torch.set_num_threads(1)              # contend with the loader workers
        try:
            return multicrop_pixels(self, torch.device(device))
        finally:
            torch.set_num_threads(threads)


def draw_multicrop(augment, images, seeds):
    """(`UncroppedBatch`, None: the geometry comes with the crops) of images [3, H, W] or
    `EncodedJpeg`s, with the PIL path's draws from each image's seed."""
    sizes = [(i.height, i.width) if isinstance(i, EncodedJpeg) else tuple(i.shape[1:])
             for i in images]
    draws = []
    for (height, width), seed in zip(sizes, seeds):
        torch.default_generator.manual_seed(seed)
        draws.append([draw_crop(height, width, scale, photometric)
                      for _, scale, photometric in augment.plan()])
    bordered = [(h + 2, w + 2) for h, w in sizes]  # shelves of the tallest first: little padding
    width = max(max(w for _, w in bordered), math.isqrt(sum(h * w for h, w in bordered)) + 1)
    corners = [None] * len(sizes)
    x = y = shelf = 0
    for i in sorted(range(len(sizes)), key=lambda i: -bordered[i][0]):
        if x + bordered[i][1] > width:
            y += shelf
            x = shelf = 0
        corners[i] = (y, x)
        x += bordered[i][1]
        shelf = max(shelf, bordered[i][0])
    canvas = torch.zeros(3, y + shelf, width, dtype=torch.uint8)
    for image, (top, left) in zip(images, corners):
        if torch.is_tensor(image):
            canvas[:, top:top + image.shape[1] + 2, left:left + image.shape[2] + 2] = F.pad(
                image[None], (1, 1, 1, 1), mode="replicate")[0]
    jpegs = [(i, *c) for i, c in zip(images, corners) if isinstance(i, EncodedJpeg)]
    return UncroppedBatch(canvas, *pack_draws(augment, draws, sizes, corners), jpegs), None


def pack_draws(augment, draws, image_sizes, corners):
    """Every draw in one float32 tensor, and its shape. Crops are cut in square tiles (the sizes'
    common divisor), so one `roi_align` cuts all, colours see one tensor [tiles, 3, pixels]."""
    plan = augment.plan()
    sizes = [size for size, _, _ in plan]
    groups = sorted(set(sizes), key=sizes.index)
    tile = math.gcd(*sizes)
    radius = int(3 * max(t.sigma[1] for _, _, p in plan for t in p.transforms
                         if isinstance(t, common.RandomGaussianBlur))) + 1
    rois, tiles, per_crop, weights, solarize = [], [], [], [], []
    geometry = np.zeros((len(plan), len(draws), 7), np.float32)
    for m, (k, n) in enumerate((k, n) for g in groups for k in range(len(plan)) if sizes[k] == g
                               for n in range(len(draws))):
        d, side, (height, width) = draws[n][k], sizes[k] // tile, image_sizes[n]
        top, left, h, w = d["box"]
        geometry[k, n] = [left / width, top / height, w / width, h / height, d["flip"], width,
                          height]  # float64 rounded to float32, as the PIL path's
        for ty, tx in np.ndindex(side, side):
            x = left + corners[n][1] + 1 + (side - 1 - tx if d["flip"] else tx) * w / side
            y = top + corners[n][0] + 1 + ty * h / side  # a mirrored crop: its tiles' order
            rois.append([0, x, y, x + w / side, y + h / side])
        tiles += [m] * side ** 2
        shift = 6 * d["jitter"][1][3] if d["jitter"] else 0.0
        slots = [[1.0, 0.0, 0.0, 0.5] for _ in range(SLOTS)]  # an empty slot rounds
        order, factors = d["jitter"] or ([3], [])  # blends before the hue end at slot 3
        for slot, op in zip([*range(3 - order.index(3), 6)], [o for o in order if o != 3]):
            f = factors[op]  # factor, saturation and contrast weights, offset
            slots[slot] = [f, (1 - f) * (op == 2), (1 - f) / sizes[k] ** 2 * (op == 1), 0.0]
        per_crop.append([*np.ravel(slots), d["flip"], 5 + shift, 3 + shift,
                         1 + shift, *(np.outer(np.ones(3), LUMA) if d["gray"] else np.eye(3)).flat])
        sigma = np.exp(-0.5 * np.arange(-radius, radius + 1) ** 2 / (d["blur"] or 1e-4) ** 2)
        weights += [sigma / sigma.sum()] * 3  # no blur: the identity
        solarize.append(128 if d["solarize"] else 256)
    per_tile = np.asarray(per_crop, np.float64)[tiles]
    std = np.asarray(augment.std)
    parts = [np.asarray(rois), per_tile[:, :4 * SLOTS + 1].T, per_tile[:, 4 * SLOTS + 1:],
             np.asarray(tiles), np.asarray(weights), np.asarray(solarize), geometry,
             np.concatenate([LUMA, [0, 1, -1, -1, 0, 1, 1, -1, 0], 1 / (255 * std),
                             -np.asarray(augment.mean) / std])]  # HSV phases; normalisation
    pack = torch.from_numpy(np.concatenate([p.astype(np.float32).ravel() for p in parts]))
    return pack, dict(split=[p.size for p in parts], tile=tile, tiles=len(tiles),
                      n=len(draws), radius=radius, groups=[(g, sizes.count(g)) for g in groups],
                      views=[groups.index(size) for size in sizes],
                      group_tiles=[len(draws) * sizes.count(g) * (g // tile) ** 2 for g in groups])


def multicrop_pixels(batch, device):
    """(crops, geometry) of an `UncroppedBatch`, in as many operations whatever the batch."""
    s = batch.shape
    pack = batch.pack.to(device, non_blocking=True)
    canvas = batch.canvas.to(device, non_blocking=True)
    for image, (_, top, left) in zip(images_on_device([j for j, _, _ in batch.jpegs], device),
                                     batch.jpegs):  # one copy each: the decoder's own tensors
        canvas[:, top:top + image.shape[1] + 2, left:left + image.shape[2] + 2] = F.pad(
            image[None], (1, 1, 1, 1), mode="replicate")[0]
    canvas = canvas.float()
    rois, scalars, matrices, tiles, weights, threshold, geometry, const = pack.split(s["split"])
    luma, mix, scale, shift = const.split([3, 9, 3, 3])
    scalars = scalars.view(-1, s["tiles"], 1, 1).unbind(0)
    hue, gray = matrices.view(s["tiles"], 12, 1).split([3, 9], 1)
    t = s["tile"]
    x = roi_align(canvas[None], rois.view(-1, 5), t, 1.0, 0, True)  # the antialiased resize
    x = torch.where(scalars[-1][..., None] > 0, x.flip(-1), x).view(-1, 3, t * t)
    tiles = tiles.long()
    luma = luma.expand(s["tiles"], 1, 3)
    zeros = pack.new_zeros(s["n"] * len(s["views"]), 1, 1)
    blends = [scalars[4 * j:4 * j + 4] for j in range(SLOTS)]
    for slot in blends[:3]:
        x = blend(x, slot, luma, tiles, zeros)
    x = shift_hue(x, hue, mix.view(1, 3, 3).expand(s["tiles"], 3, 3))
    for slot in blends[3:]:
        x = blend(x, slot, luma, tiles, zeros)
    x = torch.bmm(gray.view(-1, 3, 3), x)  # grayscale or not
    crops = []
    group_crops = [s["n"] * count for _, count in s["groups"]]
    weights = weights.view(-1, 1, 2 * s["radius"] + 1, 1).split([3 * n for n in group_crops])
    parts = zip(s["groups"], x.split(s["group_tiles"]), weights,
                threshold.view(-1, 1, 1, 1).split(group_crops))
    for (size, count), y, w, solarize in parts:
        side = size // t
        y = y.view(-1, side, side, 3, t, t).permute(0, 3, 1, 4, 2, 5).reshape(1, -1, size, size)
        y = F.conv2d(F.pad(y, (s["radius"],) * 4, mode="replicate"), w, groups=len(w))
        y = F.conv2d(y, w.transpose(2, 3), groups=len(w)).view(-1, 3, size, size).round()
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
    """f x + s gray + c (the crop's gray summed) + offset, clipped and truncated as PIL's."""
    f, saturation, contrast, offset = slot
    gray = torch.bmm(luma, x)  # a 1x1 convolution is slower on a CPU
    sums = zeros.index_add(0, tiles, gray.sum(-1, keepdim=True))
    bias = torch.addcmul(offset, contrast, sums.index_select(0, tiles))
    return torch.addcmul(torch.addcmul(bias, saturation, gray), f, x).clamp(0, 255).floor()


def shift_hue(x, phases, mix):
    """adjust_hue (HSV) per tile: the hue from the largest channel, shifted by `phases`."""
    top, channel = x.max(1, keepdim=True)
    chroma = top - x.amin(1, keepdim=True)
    hue = torch.bmm(mix, x).gather(1, channel) / chroma.clamp_min(1e-6)
    k = torch.remainder(torch.add(phases, channel, alpha=2) + hue, 6)
    return torch.addcmul(top, chroma, torch.minimum(k, 4 - k).clamp(0, 1), value=-1)


@dataclasses.dataclass
class Prefetched:
    """The loader, its batches cut: on a GPU batch n + 1 on a side stream while step n computes;
    on a CPU in line."""
    loader: torch.utils.data.DataLoader
    device: torch.device

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        ready = []
        for views, labels in self.loader:
            with side_stream(self.device, "crops"):
                ready.append((common.crops_on_device(views, self.device), labels))
            if self.device.type != "cuda" or len(ready) == 2:
                yield hand_over(ready.pop(0), self.device, "crops")
        yield from (hand_over(batch, self.device, "crops") for batch in ready)


def side_stream(device, role):
    """Work queued on the CUDA device's side stream `role` (one each); elsewhere in line."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(_STREAMS.setdefault((device, role), torch.cuda.Stream(device)))


def hand_over(out, device, role):
    """`out` of side stream `role`: the current stream waits, and records its tensors (their
    memory is not reused while it reads them)."""
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        current.wait_stream(_STREAMS[device, role])
        for x in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(x) and x.device == device:
                x.record_stream(current)
    return out


@dataclasses.dataclass
class EncodedJpeg:
    """A JPEG file read but not decoded, for the training device's decoder (nvJPEG on a GPU)."""
    data: torch.Tensor  # the file's bytes, uint8 [n]
    height: int  # from its header
    width: int
    path: str


def read_jpeg_or_decode(path):
    """A whole (ending in EOI) baseline RGB JPEG as `EncodedJpeg`, read in about 0.1 ms; any
    other file as `load_image` decodes it."""
    with contextlib.suppress(Exception):  # unreadable: `load_image` names the file
        data = Path(path).read_bytes()
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            baseline = img.format == "JPEG" and not img.info.get("progressive")
            if baseline and img.mode == "RGB" and data.endswith(b"\xff\xd9"):
                pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return EncodedJpeg(pixels, img.height, img.width, str(path))
    return common.load_image(path)


def images_on_device(jpegs, device):
    """`EncodedJpeg`s decoded on `device` in one call, on a stream that runs nothing else: the
    decoder allocates on the current stream but writes from its own, which waits for none of the
    current one's queued work (pytorch/vision#9606)."""
    device = torch.device(device)
    with side_stream(device, "decode"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29: use TorchCodec
        try:
            decoded = tv_io.decode_jpeg([jpeg.data for jpeg in jpegs], device=device,
                                        mode=tv_io.ImageReadMode.RGB) if jpegs else []
        except RuntimeError:  # one file it cannot read stops the batched call: each alone
            decoded = [decode_jpeg_or_warn(jpeg, device) for jpeg in jpegs]
    return hand_over(decoded, device, "decode")


def decode_jpeg_or_warn(jpeg, device):
    """One `EncodedJpeg` decoded on `device`, or by PIL (with a warning) if that refuses it."""
    try:
        return tv_io.decode_jpeg(jpeg.data, device=device, mode=tv_io.ImageReadMode.RGB)
    except RuntimeError as e:
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        common.log(f"warning: {jpeg.path}: the {device.type} JPEG decoder refused it "
                   f"({reason}); decoded on the CPU by PIL")
        return TF.pil_to_tensor(common.load_image(jpeg.path)).to(device)


def draw_crop(height, width, scale, photometric):
    """One crop's parameters, drawn as `crop_and_flip` and `photometric` draw them."""
    empty = torch.empty(0, height, width)
    box = transforms.RandomResizedCrop.get_params(empty, list(scale), [3 / 4, 4 / 3])
    crop = dict(box=box, flip=bool(torch.rand(1).item() < 0.5), jitter=None, gray=False,
                blur=None, solarize=False)
    for t in photometric.transforms:
        if isinstance(t, transforms.RandomApply) and not t.p < torch.rand(1).item():  # jitter
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
