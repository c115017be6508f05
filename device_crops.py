"""`--batched_crops`: loader workers read the images and make the PIL path's draws; the device
decodes (nvJPEG on a GPU) and cuts all crops in a fixed number of batched operations (the PIL
path's geometry, pixels within the flag's tolerance). Optional: delete it with the lines marked
`# device_crops`."""
import contextlib
import dataclasses
import math
import re
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

LUMA = (0.2989, 0.587, 0.114)  # torchvision's
SLOTS = 6  # colour jitter: 3 blends before the hue, 3 after (one sample's order fills some)
_STREAMS = {}  # (device, role) -> the side stream


def add_args(parser):  # in the multi-crop group when the parser has one
    group = next((g for g in parser._action_groups if g.title == "multi-crop augmentation"), parser)
    group.add_argument("--batched_crops", default=False, type=common.bool_flag,
                       help="loader workers only read the images (on a GPU: baseline JPEGs, "
                            "which nvJPEG decodes there) and make the PIL path's draws; the "
                            "training device cuts the crops in batched operations: pixels within "
                            "2 levels of 255 of the PIL path's on average, 99%% within 8")


class BatchedCrops(common.SeededDataset):
    """A `SeededDataset` whose batches are `UncroppedBatch`es (cut by `crops_on_device`)."""

    def __init__(self, seeded, device):
        super().__init__(seeded.base, seeded.transform, seeded.seed)
        folder = self.base
        while isinstance(folder, torch.utils.data.Subset):  # --holdout
            folder = folder.dataset
        if torch.device(device).type == "cuda" and isinstance(folder, common.ImageFolderSafe):
            folder.loader = read_jpeg_or_decode  # workers read JPEGs, the device decodes them

    collate = staticmethod(torch.utils.data.default_convert)  # the batch is made here

    def __getitems__(self, indices):
        pairs = [i if isinstance(i, tuple) else (i, self.epoch) for i in indices]
        images, labels = zip(*(self.base[i] for i, _ in pairs))
        pixels = [TF.pil_to_tensor(image.convert("RGB")) if isinstance(image, Image.Image)
                  else image for image in images]  # an `EncodedJpeg` is decoded on the device
        seeds = [common.sample_seed(self.seed, epoch, index) for index, epoch in pairs]
        with torch.random.fork_rng(devices=[], enabled=torch.utils.data.get_worker_info() is None):
            return draw_multicrop(self.transform, pixels, seeds), torch.tensor(labels)


class UncroppedBatch(typing.NamedTuple):  # the DataLoader pins its tensors (on a GPU)
    """Images in 1 px borders of their edges on a canvas, the draws in one `pack`, JPEGs."""
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
    """(`UncroppedBatch`, None: the geometry comes with the crops), the PIL path's draws."""
    sizes = [(i.height, i.width) if isinstance(i, EncodedJpeg) else i.shape[1:] for i in images]
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
            canvas[:, top:top + image.shape[1] + 2, left:left + image.shape[2] + 2] = \
                torch.from_numpy(np.pad(image.numpy(), ((0, 0), (1, 1), (1, 1)), mode="edge"))
    jpegs = [(i, *c) for i, c in zip(images, corners) if isinstance(i, EncodedJpeg)]
    return UncroppedBatch(canvas, *pack_draws(augment, draws, sizes, corners), jpegs), None


def pack_draws(augment, draws, image_sizes, corners):
    """Every draw as float32, in square tiles of the sizes' common divisor: one `roi_align`."""
    plan = augment.plan()
    sizes = [size for size, _, _ in plan]
    groups = sorted(set(sizes), key=sizes.index)
    tile = math.gcd(*sizes)
    radius = int(3 * 2.0 * augment.global_size / 224) + 1  # the largest sigma's, as PIL's
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
        slots = [[1.0, 0.0, 0.0, 0.5] for _ in range(SLOTS)]  # an empty slot rounds
        order, factors = d["jitter"] or ([3], [0.0] * 4)  # blends before the hue end at slot 3
        for slot, op in zip([*range(3 - order.index(3), 6)], [o for o in order if o != 3]):
            f = factors[op]  # factor, saturation and contrast weights, offset
            slots[slot] = [f, (1 - f) * (op == 2), (1 - f) / sizes[k] ** 2 * (op == 1), 0.0]
        per_crop.append([*np.ravel(slots), d["flip"], *(np.array([5, 3, 1]) + 6 * factors[3]),
                         *(np.outer(np.ones(3), LUMA) if d["gray"] else np.eye(3)).flat])
        sigma = np.exp(-0.5 * np.arange(-radius, radius + 1) ** 2 / (d["blur"] or 1e-4) ** 2)
        weights += [sigma / sigma.sum()] * 3  # no blur: the identity
        solarize.append(128 if d["solarize"] else 256)
    per_tile = np.asarray(per_crop, np.float64)[tiles]
    std = np.asarray(augment.std)
    parts = [np.asarray(rois), per_tile[:, :4 * SLOTS + 1].T, per_tile[:, -12:-9],
             per_tile[:, -9:], np.asarray(tiles), np.asarray(weights), np.asarray(solarize),
             geometry, np.concatenate([LUMA, [0, 1, -1, -1, 0, 1, 1, -1, 0], 1 / (255 * std),
                                       -np.asarray(augment.mean) / std])]  # hue; normalisation
    pack = torch.from_numpy(np.concatenate([p.astype(np.float32).ravel() for p in parts]))
    return pack, dict(split=[p.size for p in parts], tile=tile, tiles=len(tiles),
                      n=len(draws), radius=radius, groups=[(g, sizes.count(g)) for g in groups],
                      views=[groups.index(size) for size in sizes],
                      group_crops=[len(draws) * sizes.count(g) for g in groups],
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
    rois, scalars, hue, gray, tiles, weights, threshold, geometry, const = pack.split(s["split"])
    luma, mix, scale, shift = const.split([3, 9, 3, 3])
    scalars = scalars.view(-1, s["tiles"], 1, 1).unbind(0)
    t = s["tile"]
    x = roi_align(canvas.float()[None], rois.view(-1, 5), t, 1.0, 0, True)  # antialiased resize
    x = torch.where(scalars[-1][..., None] > 0, x.flip(-1), x).view(-1, 3, t * t)
    tiles = tiles.long()
    luma = luma.expand(s["tiles"], 1, 3)  # a 1x1 convolution is slower on a CPU than bmm
    zeros = pack.new_zeros(s["n"] * len(s["views"]), 1, 1)
    for j in range(SLOTS):
        if j == 3:  # the hue between the blends before it and those after
            x = shift_hue(x, hue.view(-1, 3, 1), mix.view(1, 3, 3).expand(s["tiles"], 3, 3))
        x = blend(x, scalars[4 * j:4 * j + 4], luma, tiles, zeros)
    x = torch.bmm(gray.view(-1, 3, 3), x)  # grayscale or not
    crops = []
    weights = weights.view(-1, 1, 2 * s["radius"] + 1, 1).split([3 * n for n in s["group_crops"]])
    parts = zip(s["groups"], x.split(s["group_tiles"]), weights,
                threshold.view(-1, 1, 1, 1).split(s["group_crops"]))
    for (size, count), y, w, solarize in parts:
        side = size // t
        y = y.view(-1, side, side, 3, t, t).permute(0, 3, 1, 4, 2, 5).reshape(1, -1, size, size)
        y = F.conv2d(F.pad(y, (s["radius"],) * 4, mode="replicate"), w, groups=len(w))
        y = F.conv2d(y, w.transpose(2, 3), groups=len(w)).view(-1, 3, size, size).round()
        y = torch.where(y >= solarize, 255 - y, y)
        y = torch.addcmul(shift.view(1, 3, 1, 1), y, scale.view(1, 3, 1, 1))
        crops.append(iter(y.view(count, s["n"], 3, size, size).unbind(0)))
    geometry = geometry.view(-1, s["n"], 7)
    boxes = geometry[..., :4].unbind(0)
    flips = geometry[..., 4].bool().unbind(0)
    image_size = geometry[0, :, 5:]
    return ([next(crops[g]) for g in s["views"]],
            [{"box": b, "flip": f, "image_size": image_size} for b, f in zip(boxes, flips)])


def blend(x, slot, luma, tiles, zeros):
    """f x + s gray + c (the crop's gray summed) + offset, clipped and truncated as PIL's."""
    f, saturation, contrast, offset = slot
    gray = torch.bmm(luma, x)
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
    """The loader, its batches cut (on a GPU batch n + 1 on a side stream during step n)."""
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
    if device.type == "cuda" and (device, role) not in _STREAMS:
        _STREAMS[device, role] = torch.cuda.Stream(device)
    return torch.cuda.stream(_STREAMS.get((device, role)))  # None: no stream change


def hand_over(out, device, role):
    """`out` of side stream `role`: the current stream waits, records its tensors (no reuse)."""
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        current.wait_stream(_STREAMS[device, role])
        for x in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(x) and x.is_cuda:
                x.record_stream(current)
    return out


EncodedJpeg = typing.NamedTuple("EncodedJpeg", [("data", torch.Tensor), ("height", int),
                                                ("width", int), ("path", str)])


def read_jpeg_or_decode(path):
    """A whole baseline RGB JPEG as `EncodedJpeg`; any other file as PIL decodes it."""
    with contextlib.suppress(Exception):  # unreadable: `load_image` names the file
        data = Path(path).read_bytes()  # a marker but restarts in the last scan: damaged? PIL says
        stray = re.search(rb"\xff[^\x00\xd0-\xd7]", data[data.rfind(b"\xff\xda") + 2:-2])
        with Image.open(path) as img:  # reads the header only
            if ((img.format, img.mode) == ("JPEG", "RGB") and not img.info.get("progressive")
                    and data.endswith(b"\xff\xd9") and not stray):
                return EncodedJpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                   img.height, img.width, str(path))
    return common.load_image(path)


def images_on_device(jpegs, device):
    """Decoded in one call on a stream of its own: the decoder allocates on the current stream but
    writes from its own, which waits for none of its queued work (pytorch/vision#9606)."""
    with side_stream(device, "decode"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29: use TorchCodec
        try:
            decoded = tv_io.decode_jpeg([jpeg.data for jpeg in jpegs], device=device,
                                        mode=tv_io.ImageReadMode.RGB) if jpegs else []
        except RuntimeError as e:  # rare: the workers hand over whole baseline RGB files
            common.log(f"warning: the {device.type} JPEG decoder refused a file of {len(jpegs)} "
                       f"({str(e).strip().splitlines()[0]}): PIL decodes them, {jpegs[0].path} ...")
            decoded = [TF.pil_to_tensor(common.load_image(j.path)).to(device) for j in jpegs]
    return hand_over(decoded, device, "decode")


def draw_crop(height, width, scale, photometric):
    """One crop's parameters, drawn as `crop_and_flip` and `photometric` draw them."""
    box = transforms.RandomResizedCrop.get_params(torch.empty(0, height, width), list(scale),
                                                  [3 / 4, 4 / 3])
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
