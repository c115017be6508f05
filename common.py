"""Shared infrastructure for the five method files: no method logic lives here.

Sections, top to bottom:
  1. Backbones      timm ViT / Swin with one API: global feature [B, D] and dense grid [B, h, w, D]
  2. Heads          the DINO projection head (used by DINO, EsViT, GLSD and SelfPatch)
  3. Augmentation   DINO's multi-crop, recording every crop's geometry; per-sample seeding
  4. Datasets       image folders, Fashion-MNIST, CIFAR, SVHN and a procedural `synthetic` set
  5. Distributed    torchrun initialisation, samplers, all-reduce helpers
  6. Training       schedules, parameter groups, gradient clipping, EMA teacher, mixed precision
  7. Checkpoints    atomic save, auto-resume, RNG states
  8. Logging        progress bar, JSON log lines, argument groups shared by every script
"""
import argparse
import atexit
import contextlib
import gzip
import itertools
import json
import math
import multiprocessing
import os
import random
import signal
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageFilter
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torchvision import datasets as tv_datasets
from torchvision import transforms
from torchvision.transforms import functional as TF
from tqdm import tqdm

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def die(message):
    """Stop with a one-line error for a user mistake (no traceback from deep inside torch)."""
    raise SystemExit(f"error: {message}")


# ================================================================================================
# 1. Backbones
# ================================================================================================
# Real configurations: DINO Table 8 (ViT) and EsViT Table 6 (Swin). The `*_pico` entries are not
# from any paper: they exist so that every script runs, and is tested, on a laptop CPU in seconds.
ARCHS = {
    "vit_pico": dict(family="vit", embed_dim=64, depth=4, num_heads=2),
    "vit_tiny": dict(family="vit", embed_dim=192, depth=12, num_heads=3),
    "vit_small": dict(family="vit", embed_dim=384, depth=12, num_heads=6),
    "vit_base": dict(family="vit", embed_dim=768, depth=12, num_heads=12),
    "swin_pico": dict(family="swin", embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8)),
    "swin_tiny": dict(family="swin", embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin_small": dict(family="swin", embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin_base": dict(family="swin", embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
}


class ViT(VisionTransformer):
    """timm's VisionTransformer (its key names are the DINO authors' key names) with DINO's
    position-embedding interpolation.

    For a grid (h, w) different from the stored one (n, n), DINO resizes the patch position
    embeddings with `interpolate(scale_factor=((h + 0.1) / n, (w + 0.1) / n), mode="bicubic")`.
    timm's own resampling (`size=(h, w)`, antialiased) gives different values (up to ~4 on a
    ViT-Ti), so released DINO / SelfPatch weights would see other local-crop inputs than they
    were trained with. At the stored grid no interpolation happens, as in both.
    """

    def _pos_embed(self, x):  # x: [B, h, w, C] patch embeddings (dynamic_img_size=True)
        B, h, w, C = x.shape
        n_prefix = self.num_prefix_tokens
        pos = self.pos_embed
        gh, gw = self.patch_embed.grid_size
        if (h, w) != (gh, gw):
            grid = pos[:, n_prefix:].reshape(1, gh, gw, C).permute(0, 3, 1, 2)
            grid = F.interpolate(grid.float(), scale_factor=((h + 0.1) / gh, (w + 0.1) / gw),
                                 mode="bicubic", align_corners=False).to(pos.dtype)
            assert grid.shape[-2:] == (h, w), (grid.shape, h, w)
            pos = torch.cat([pos[:, :n_prefix], grid.permute(0, 2, 3, 1).reshape(1, h * w, C)], 1)
        x = x.reshape(B, h * w, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        return self.pos_drop(x + pos)

    def grid_size(self, image_hw):
        return image_hw[0] // self.patch_embed.patch_size[0], image_hw[1] // self.patch_embed.patch_size[1]

    def forward_dense(self, x, norm=True):
        """(global [B, D] or None, grid [B, h, w, D]). Global = CLS token; None without a CLS token.
        norm=False returns the last block's output before the final LayerNorm."""
        h, w = self.grid_size(x.shape[-2:])
        tokens = self.blocks(self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x)))))
        if norm:
            tokens = self.norm(tokens)
        n = self.num_prefix_tokens
        cls = tokens[:, 0] if self.cls_token is not None else None
        return cls, tokens[:, n:].reshape(x.shape[0], h, w, -1)


class Swin(SwinTransformer):
    """timm's SwinTransformer; global feature = mean of the final-norm tokens (EsViT's pooling).

    Inputs whose token maps are not multiples of the window (96 px crops) are padded inside each
    block. timm rolls (shifts) the map before padding; the EsViT authors' Swin pads first. The
    two agree exactly at 224 px and differ slightly on 96 px crops (an accepted difference).
    """

    def forward_dense(self, x, norm=True):
        tokens = self.layers(self.patch_embed(x))  # [B, h, w, D]
        if norm:
            tokens = self.norm(tokens)
        return tokens.mean(dim=(1, 2)), tokens


def build_backbone(arch, patch_size=16, window_size=7, drop_path_rate=0.0, img_size=224,
                   class_token=True, final_norm=True, layer_norm_eps=1e-6, **overrides):
    """A ViT or Swin from `ARCHS`, built for any input size (96 px local crops included).

    ViT keeps timm's (= the DINO authors') key names, so released DINO weights load strictly.
    `class_token=False, final_norm=False` gives SelfPatch's backbone. `overrides` replace entries
    of the architecture table (tests use them for tiny models).
    """
    if arch not in ARCHS:
        die(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg = {**ARCHS[arch], **overrides}
    family = cfg.pop("family")
    norm_layer = partial(nn.LayerNorm, eps=layer_norm_eps)
    if family == "vit":
        if patch_size not in (8, 14, 16):
            die(f"--patch_size {patch_size} is not supported for ViT (use 16 or 8)")
        return ViT(img_size=img_size, patch_size=patch_size, mlp_ratio=4, qkv_bias=True,
                   norm_layer=norm_layer, num_classes=0, dynamic_img_size=True,
                   drop_path_rate=drop_path_rate, class_token=class_token,
                   global_pool="token" if class_token else "avg", final_norm=final_norm,
                   fc_norm=False, **cfg)  # keep the final norm in `norm` (timm moves it to fc_norm for "avg")
    if not class_token or not final_norm:
        die("a Swin backbone has no CLS token to remove and always ends in a LayerNorm")
    return Swin(img_size=img_size, patch_size=4, window_size=window_size, mlp_ratio=4, qkv_bias=True,
                norm_layer=norm_layer, num_classes=0, strict_img_size=False,
                drop_path_rate=drop_path_rate, **cfg)


def resolution_groups(crops):
    """(start, end) of every run of consecutive crops with the same resolution."""
    groups, start = [], 0
    for i in range(1, len(crops) + 1):
        if i == len(crops) or crops[i].shape[-2:] != crops[start].shape[-2:]:
            groups.append((start, i))
            start = i
    return groups


def forward_multicrop(fn, crops):
    """Apply `fn` once per run of equal-resolution crops, to their concatenation (crop-major rows:
    [crop s batch, crop s+1 batch, ...]), as DINO's MultiCropWrapper does. One output per run."""
    return [fn(torch.cat(crops[s:e])) for s, e in resolution_groups(crops)]


# ================================================================================================
# 2. Heads
# ================================================================================================
class WeightNormLinear(nn.Module):
    """Bias-free Linear with weight = g * v / ||v|| (row-wise), stored as `weight_g` [K, 1] and
    `weight_v` [K, d] like the authors' `nn.utils.weight_norm`, so their checkpoints load as they
    are; a plain module, so it survives `deepcopy`."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        v = torch.empty(out_dim, in_dim)
        nn.init.kaiming_uniform_(v, a=math.sqrt(5))  # nn.Linear's default init, as in DINO
        self.weight_v = nn.Parameter(v)
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1))

    def forward(self, x):
        return F.linear(x, self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True))


class DINOHead(nn.Module):
    """MLP (nlayers Linear, GELU between) -> l2-normalise -> weight-normalised Linear(bottleneck, K).

    With `norm_last_layer` the gain g is frozen at 1, so the last layer is a cosine classifier;
    DINO reports this stabilises training (their default for ViT-S)."""

    def __init__(self, in_dim, out_dim, use_bn=False, norm_last_layer=True, nlayers=3,
                 hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers = []
            for i in range(nlayers - 1):
                layers.append(nn.Linear(in_dim if i == 0 else hidden_dim, hidden_dim))
                if use_bn:
                    layers.append(nn.BatchNorm1d(hidden_dim))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.apply(self._init_weights)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
        self.last_layer.weight_g.requires_grad = not norm_last_layer

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


# ================================================================================================
# 3. Augmentation with geometry
# ================================================================================================
class RandomGaussianBlur:
    """PIL Gaussian blur with probability p and radius ~ U(sigma), as in DINO (drawn from torch's
    RNG so that per-sample seeding covers it)."""

    def __init__(self, p, sigma=(0.1, 2.0)):
        self.p, self.sigma = p, sigma

    def __call__(self, img):
        if torch.rand(1).item() >= self.p:
            return img
        radius = self.sigma[0] + (self.sigma[1] - self.sigma[0]) * torch.rand(1).item()
        return img.filter(ImageFilter.GaussianBlur(radius=radius))


class MultiCropAugmentation:
    """DINO's multi-crop: 2 global crops and N local crops, each returned with its geometry.

    Geometry of a crop = {"box": [x0, y0, w, h] of the crop in the original image, as fractions of
    its width/height; "flip": whether the crop was mirrored; "image_size": [W, H] in pixels}.
    All randomness comes from torch's global RNG, so `SeededDataset` makes it reproducible.
    """

    def __init__(self, global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4),
                 local_crops_number=8, global_crop_size=224, local_crop_size=96,
                 mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.global_scale, self.local_scale = tuple(global_crops_scale), tuple(local_crops_scale)
        self.n_local = local_crops_number
        self.global_size, self.local_size = global_crop_size, local_crop_size
        color = [transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                 transforms.RandomGrayscale(p=0.2)]
        to_tensor = [transforms.ToTensor(), transforms.Normalize(mean, std)]
        self.global1 = transforms.Compose(color + [RandomGaussianBlur(1.0)] + to_tensor)
        self.global2 = transforms.Compose(color + [RandomGaussianBlur(0.1),
                                                   transforms.RandomSolarize(128, p=0.2)] + to_tensor)
        self.local = transforms.Compose(color + [RandomGaussianBlur(0.5)] + to_tensor)

    @staticmethod
    def crop_and_flip(img, size, scale):
        top, left, h, w = transforms.RandomResizedCrop.get_params(img, list(scale), [3 / 4, 4 / 3])
        crop = TF.resized_crop(img, top, left, h, w, [size, size], TF.InterpolationMode.BICUBIC)
        flip = bool(torch.rand(1).item() < 0.5)
        if flip:
            crop = TF.hflip(crop)
        W, H = img.size
        geometry = {"box": torch.tensor([left / W, top / H, w / W, h / H]),
                    "flip": torch.tensor(flip), "image_size": torch.tensor([float(W), float(H)])}
        return crop, geometry

    def __call__(self, img):
        crops, geometry = [], []
        plan = [(self.global_size, self.global_scale, self.global1),
                (self.global_size, self.global_scale, self.global2)]
        plan += [(self.local_size, self.local_scale, self.local)] * self.n_local
        for size, scale, photometric in plan:
            crop, geo = self.crop_and_flip(img, size, scale)
            crops.append(photometric(crop))
            geometry.append(geo)
        return crops, geometry


def grid_centers(geometry, grid_size):
    """Centre of every cell of an (h, w) grid laid over each crop, in original-image pixels.

    geometry: a batch of one crop's geometry (dict of [B, ...] tensors, as collated).
    Returns [B, h*w, 2] as (x, y), row-major over the grid the model sees: for a flipped crop,
    column c of the grid lies at the mirrored column w-1-c of the unflipped crop. Both axes are in
    pixels of the original image, so distances are not distorted on non-square images.
    """
    h, w = grid_size
    box = geometry["box"].float()
    flip = geometry["flip"].bool()
    img_w, img_h = geometry["image_size"].float().unbind(-1)
    cols = (torch.arange(w, device=box.device) + 0.5) / w                      # [w]
    cols = torch.where(flip[:, None], 1 - cols, cols)                           # [B, w]
    rows = ((torch.arange(h, device=box.device) + 0.5) / h).expand(len(box), h)  # [B, h]
    x = (box[:, 0:1] + cols * box[:, 2:3]) * img_w[:, None]
    y = (box[:, 1:2] + rows * box[:, 3:4]) * img_h[:, None]
    return torch.stack(torch.broadcast_tensors(x[:, None, :], y[:, :, None]), -1).reshape(len(box), h * w, 2)


def sample_seed(*keys):
    """A well-mixed 63-bit seed from integer keys, e.g. (seed, epoch, index) for one sample in one
    epoch: a function of the keys only, not of loader workers or processes."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0] >> 1)


class SeededDataset(torch.utils.data.Dataset):
    """Applies `transform` to `base[index]` under a torch seed derived from (seed, epoch, index),
    so a sample's crops depend on nothing else: not on loader workers, processes, or resumption.
    Call `set_epoch` before each epoch (loader workers are re-created per epoch and copy it)."""

    def __init__(self, base, transform, seed=0):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        seed = sample_seed(self.seed, self.epoch, index)
        if torch.utils.data.get_worker_info() is not None:
            # A loader worker's global generators serve this dataset alone: nothing to restore.
            return self.seeded_transform(image, seed), label
        # In the main process (num_workers=0) the training loop draws from them too: restore them.
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            try:
                return self.seeded_transform(image, seed), label
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)

    def seeded_transform(self, image, seed):
        """Seeds torch, Python and NumPy (timm's transforms use all three), then transforms. Of
        torch, only the CPU generator: torch.manual_seed would also reseed the CUDA ones (and costs
        about 0.5 ms)."""
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        return self.transform(image)


def eval_transform(resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """DINO's evaluation transform: Resize(256, bicubic) -> CenterCrop(224) -> normalise."""
    return transforms.Compose([transforms.Resize(resize, interpolation=TF.InterpolationMode.BICUBIC),
                               transforms.CenterCrop(crop), transforms.ToTensor(),
                               transforms.Normalize(mean, std)])


# ================================================================================================
# 4. Datasets
# ================================================================================================
def load_image(path):
    """Open any image as 8-bit RGB (grayscale, palette, RGBA and 16-bit images are converted);
    an unreadable file raises an error that names it."""
    try:
        with Image.open(path) as img:
            img.load()
            if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit / float: rescale to 8 bit
                a = np.asarray(img, dtype=np.float64)
                lo, hi = float(a.min()), float(a.max())
                img = Image.fromarray(((a - lo) * (255.0 / max(hi - lo, 1e-12))).astype(np.uint8))
            elif img.mode == "P" and "transparency" in img.info:  # avoids PIL's palette warning
                img = img.convert("RGBA")
            return img.convert("RGB")
    except Exception as e:  # PIL raises many types for broken files
        raise BadImageError(f"cannot read image {path}: {e}") from None


class BadImageError(RuntimeError):
    pass


@contextlib.contextmanager
def user_errors():
    """Turn an unreadable image met inside the data loader (possibly in a worker process, whose
    traceback torch prepends) into a one-line error that names the file."""
    try:
        yield
    except BadImageError as e:
        raise SystemExit("error: " + str(e).strip().splitlines()[-1].split("BadImageError: ")[-1]) from None


class ImageFolderSafe(tv_datasets.ImageFolder):
    """ImageFolder with `load_image`; with `skip_bad_images`, an unreadable file is replaced by the
    next readable one instead of stopping the run (for training). Skipped files are listed in
    `bad_images` (this process) and counted in `skipped`, a counter shared with the loader's worker
    processes. With `substitute = False` (evaluation) the error goes to the caller, which drops the
    sample: a neighbour's image and label would bias the accuracy."""

    def __init__(self, root, skip_bad_images=False):
        super().__init__(root, loader=load_image)
        self.skip_bad_images, self.bad_images, self.substitute = skip_bad_images, [], True
        self.skipped = multiprocessing.Value("l", 0)

    def __getitem__(self, index):
        for attempt in range(len(self)):
            i = (index + attempt) % len(self)
            try:
                return super().__getitem__(i)
            except BadImageError as e:
                if not self.skip_bad_images:
                    raise BadImageError(f"{e} (pass --skip_bad_images to skip unreadable files)") from None
                if not self.substitute:
                    raise
                self.bad_images.append(self.samples[i][0])
                with self.skipped.get_lock():
                    self.skipped.value += 1
                print(f"warning: skipping {e}", file=sys.stderr)
        raise BadImageError(f"no readable image in {self.root}")


def skipped_images(dataset):
    """How many unreadable files the (possibly wrapped) dataset has skipped so far."""
    while hasattr(dataset, "base") or hasattr(dataset, "dataset"):   # SeededDataset, Subset
        dataset = getattr(dataset, "base", None) or dataset.dataset
    return dataset.skipped.value if hasattr(dataset, "skipped") else 0


def read_idx(path):
    """Read an IDX file (MNIST format), gzipped or not, as a numpy array."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class FashionMNIST(torch.utils.data.Dataset):
    """Fashion-MNIST from its IDX files (Debian's `dataset-fashion-mnist` installs them in
    /usr/share/datasets/fashion-mnist); 28x28 grayscale returned as RGB PIL images."""
    DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"

    def __init__(self, root=None, train=True):
        root = Path(root or self.DEFAULT_ROOT)
        prefix = "train" if train else "t10k"
        files = [root / f"{prefix}-{kind}-idx{d}-ubyte{ext}" for kind, d in (("images", 3), ("labels", 1))
                 for ext in (".gz", "")]
        images = next((f for f in files[:2] if f.exists()), None)
        labels = next((f for f in files[2:] if f.exists()), None)
        if images is None or labels is None:
            die(f"Fashion-MNIST files {prefix}-images-idx3-ubyte(.gz) / {prefix}-labels-idx1-ubyte(.gz) "
                f"not found in {root}; install them with `apt-get install dataset-fashion-mnist` "
                f"or pass --data_path")
        self.images, self.targets = read_idx(images), read_idx(labels).astype(np.int64)
        self.classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                        "Sneaker", "Bag", "Ankle boot"]

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return Image.fromarray(self.images[i], mode="L").convert("RGB"), int(self.targets[i])


class SyntheticShapes(torch.utils.data.Dataset):
    """A procedurally generated labelled image set: 10 shape classes (disk, square, triangle,
    diamond, plus, cross, ring, horizontal bars, vertical bars, checker). An image holds 2 to 4
    light copies of its class's shape, each at its own position, scale and grey level, over a dark
    noisy background. Two design choices make it a fair test of self-supervised learning:
    colour carries no information (a random hue per image would make colour the easiest cue for
    instance discrimination, so the features would learn colour, not shape), and the class is
    what every crop of the image shares (several copies of the shape, no image-wide cue such as a
    background gradient that a crop-invariance objective would latch on to instead). Image i is a
    pure function of (seed, split, i): no files, no download, any resolution."""
    CLASSES = ["disk", "square", "triangle", "diamond", "plus", "cross", "ring", "hbars", "vbars", "checker"]

    def __init__(self, num_images=2000, image_size=64, train=True, seed=0):
        self.n, self.size, self.seed, self.split = num_images, image_size, seed, 0 if train else 1
        self.classes = self.CLASSES
        self.targets = [i % len(self.CLASSES) for i in range(num_images)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from PIL import ImageDraw
        rng = np.random.default_rng([self.seed, self.split, i])
        s, label = self.size, self.targets[i]
        background = rng.uniform(0, 60) + rng.normal(0, 8, (s, s, 1))
        img = Image.fromarray(np.clip(np.broadcast_to(background, (s, s, 3)), 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(rng.integers(2, 5)):
            r = s * rng.uniform(0.12, 0.22)
            cx, cy = rng.uniform(r, s - r, 2)
            self.draw_shape(draw, self.CLASSES[label], cx, cy, r, (int(rng.uniform(150, 255)),) * 3)
        return img, label

    @staticmethod
    def draw_shape(d, name, cx, cy, r, fg):
        """One shape of half-size r centred at (cx, cy)."""
        box, lw = [cx - r, cy - r, cx + r, cy + r], max(1, int(r / 3))
        if name == "disk":
            d.ellipse(box, fill=fg)
        elif name == "square":
            d.rectangle(box, fill=fg)
        elif name == "triangle":
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
        elif name == "diamond":
            d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fg)
        elif name == "plus":
            d.rectangle([cx - lw / 2, cy - r, cx + lw / 2, cy + r], fill=fg)
            d.rectangle([cx - r, cy - lw / 2, cx + r, cy + lw / 2], fill=fg)
        elif name == "cross":
            d.line([(cx - r, cy - r), (cx + r, cy + r)], fill=fg, width=lw)
            d.line([(cx - r, cy + r), (cx + r, cy - r)], fill=fg, width=lw)
        elif name == "ring":
            d.ellipse(box, outline=fg, width=lw)
        elif name in ("hbars", "vbars"):
            for k in range(3):
                a = -r + k * 2 * r / 2.5
                bar = [cx - r, cy + a, cx + r, cy + a + lw] if name == "hbars" else [cx + a, cy - r, cx + a + lw, cy + r]
                d.rectangle(bar, fill=fg)
        else:  # checker
            d.rectangle([cx - r, cy - r, cx, cy], fill=fg)
            d.rectangle([cx, cy, cx + r, cy + r], fill=fg)


DATASETS = ["folder", "synthetic", "fashion_mnist", "cifar10", "cifar100", "svhn"]


def build_dataset(args, train=True):
    """The dataset named by --dataset (images as PIL, labels as int), for the train or test split.

    folder: --data_path is an ImageFolder root; for the test split, --data_path/val (or /test)."""
    name, path = args.dataset, getattr(args, "data_path", None)
    if name == "synthetic":
        return SyntheticShapes(args.synthetic_images if train else max(args.synthetic_images // 4, 10),
                               args.synthetic_image_size, train=train, seed=args.synthetic_seed)
    if name == "fashion_mnist":
        return FashionMNIST(path, train=train)
    if name in ("cifar10", "cifar100", "svhn"):
        if not path or not Path(path).is_dir():
            die(f"--dataset {name} needs --data_path pointing at a local torchvision root (nothing is downloaded)")
        try:
            if name == "svhn":
                return tv_datasets.SVHN(path, split="train" if train else "test", download=False)
            cls = tv_datasets.CIFAR10 if name == "cifar10" else tv_datasets.CIFAR100
            return cls(path, train=train, download=False)
        except RuntimeError as e:
            die(f"{name} not found under --data_path {path}: {e}")
    if name != "folder":
        die(f"unknown --dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if not path:
        die("--data_path is required with --dataset folder (an ImageFolder root: one sub-folder per class)")
    root = Path(path)
    if not root.is_dir():
        die(f"--data_path {root} does not exist or is not a directory")
    splits = ["train"] if train else ["val", "test"]
    root = next((root / s for s in splits if (root / s).is_dir()), root if train else None)
    if root is None:
        die(f"no val/ or test/ folder in --data_path {path} for evaluation")
    try:
        return ImageFolderSafe(str(root), skip_bad_images=getattr(args, "skip_bad_images", False))
    except FileNotFoundError as e:
        die(f"no images in {root}: {e}. Expected one sub-folder per class with image files inside")


# ================================================================================================
# 5. Distributed
# ================================================================================================
def init_distributed(device="auto"):
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); one process when
    absent. Backend: nccl on GPU, gloo on CPU. Returns the torch.device this process uses."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{local_rank}"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            die("--device cuda requested but no GPU is visible")
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return device


def is_dist():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist() else 0


def get_world_size():
    return dist.get_world_size() if is_dist() else 1


def is_main_process():
    return get_rank() == 0


def all_reduce_sum(t):
    """Sum of `t` over all processes, as a new tensor (a copy of `t` without a process group)."""
    t = t.clone()
    if not is_dist():
        return t
    dist.all_reduce(t)
    return t


def all_reduce_mean(t):
    return all_reduce_sum(t) / get_world_size()


def all_gather_objects(obj):
    """List of `obj` from every process (rank order); [obj] without a process group."""
    if not is_dist():
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def unwrap(model):
    return model.module if hasattr(model, "module") else model


class ResumableSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that can start an epoch at a given batch, to resume mid-epoch at the
    next unseen batch. Rank r of n takes every n-th index of one permutation of (seed, epoch)."""

    def __init__(self, dataset, batch_size, shuffle, seed, drop_last):
        super().__init__(dataset, num_replicas=get_world_size(), rank=get_rank(), shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size, self.start_batch = batch_size, 0

    def set_epoch(self, epoch, start_batch=0):
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start_batch * self.batch_size, None)

    def __len__(self):
        return max(super().__len__() - self.start_batch * self.batch_size, 0)


def make_loader(dataset, batch_size, num_workers, train=True, seed=0):
    """DataLoader over a `ResumableSampler` (also with one process), so the order of samples is a
    function of (seed, epoch) only. The loader has its own generator: creating an epoch's
    iterator does not draw from the global RNG, which keeps resumed runs bit-identical."""
    if train and len(dataset) < batch_size * get_world_size():
        die(f"the dataset has {len(dataset)} images, fewer than one batch "
            f"({batch_size} per process x {get_world_size()} processes); lower --batch_size_per_gpu")
    sampler = ResumableSampler(dataset, batch_size, shuffle=train, seed=seed, drop_last=train)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                                         pin_memory=torch.cuda.is_available(), drop_last=train,
                                         generator=torch.Generator().manual_seed(seed),
                                         worker_init_fn=ignore_preemption_signals)
    return loader, sampler


def ignore_preemption_signals(_worker_id):
    """In a loader worker: SLURM and torchrun send the preemption signal to every process of the
    job, workers included. A worker killed by it would take its training process down before the
    checkpoint; ignoring it lets the training process finish its step, save and shut the workers."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


@atexit.register  # registered after multiprocessing's exit handler, so it runs before it
def end_loader_workers():
    """At exit, a loader worker still alive (an error left its loader's iterator undeleted) ignores
    the SIGTERM of multiprocessing's exit handler, which would then wait for it forever: SIGKILL
    (without torch's SIGCHLD handler, which would report the worker's death as an error)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


_preemption_signal = None


def install_preemption_handler():
    """On SIGTERM or SIGUSR1 (cluster preemption, SLURM's --signal), only set a flag: the training
    loop finishes its step, writes a checkpoint and exits 0 (see `preemption_requested`)."""
    def handler(signum, frame):
        global _preemption_signal
        _preemption_signal = signal.Signals(signum).name
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, handler)


def preemption_requested(device):
    """True in every process as soon as any process received a preemption signal."""
    flag = torch.tensor([float(_preemption_signal is not None)], device=device)
    return all_reduce_sum(flag).item() > 0


def exit_after_preemption(output_dir):
    log(f"received {_preemption_signal or 'a preemption signal'}: checkpoint written to "
        f"{Path(output_dir) / 'checkpoint.pth'}; run the same command again to resume")
    if is_dist():
        dist.destroy_process_group()
    sys.exit(0)


# ================================================================================================
# 6. Training utilities
# ================================================================================================
def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    """One value per iteration: linear warmup from `start_warmup_value` (endpoint `base_value`
    included) over `warmup_epochs`, then `final + 0.5 (base - final)(1 + cos(pi i / T))`."""
    if warmup_epochs > epochs:
        die(f"--warmup_epochs {warmup_epochs} is longer than --epochs {epochs}; lower it")
    warmup_iters = int(warmup_epochs * niter_per_ep)
    warmup = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    schedule = np.concatenate((warmup, schedule))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


def teacher_temperature_schedule(warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs):
    """Per-epoch teacher temperature: linspace(warmup, final, warmup_epochs) (endpoint included),
    then constant. The same schedule drives every self-distillation loss in this repository."""
    return np.concatenate((np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
                           np.ones(max(nepochs - warmup_epochs, 0)) * teacher_temp))


def get_params_groups(model, no_decay_names=()):
    """Two AdamW groups: weights (decayed) and biases / 1-D parameters (norms, gains) and any
    parameter whose name contains one of `no_decay_names` (not decayed). Frozen ones are left out."""
    regularized, not_regularized = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = name.endswith(".bias") or p.ndim == 1 or any(n in name for n in no_decay_names)
        (not_regularized if exempt else regularized).append(p)
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}]


def clip_gradients(model, clip):
    """Per-parameter clipping, as the authors' code: every gradient tensor is rescaled separately
    to norm <= clip (not a global-norm clip). Returns the norms before clipping."""
    norms = []
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.detach().norm(2)
            norms.append(norm.item())
            factor = clip / (norm + 1e-6)
            if factor < 1:
                p.grad.detach().mul_(factor)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    """During the first `freeze_last_layer` epochs, drop the gradients of every head's last layer
    (grad = None, so AdamW leaves those weights untouched)."""
    if epoch >= freeze_last_layer:
        return
    for name, p in model.named_parameters():
        if "last_layer" in name:
            p.grad = None


@torch.no_grad()
def update_teacher(student, teacher, momentum):
    """EMA over parameters: teacher = m * teacher + (1 - m) * student."""
    s_params = dict(unwrap(student).named_parameters())
    for name, t in unwrap(teacher).named_parameters():
        t.mul_(momentum).add_(s_params[name].detach(), alpha=1 - momentum)


def autocast(device, precision):
    """Mixed-precision context: fp16 (with a grad scaler), bf16, or fp32. fp16 also runs on CPUs
    (slowly: it exists there so that the grad-scaler path can be tested without a GPU)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def make_grad_scaler(device, precision):
    """fp16 gradients can overflow: the scaler skips such a step and lowers its scale (no stop)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def fix_random_seeds(seed):
    """Same seed in every process (DDP also broadcasts the weights of rank 0)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# ================================================================================================
# 7. Checkpoints
# ================================================================================================
def rng_state():
    """This process's RNG states, as types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
            "python": [py_state[0], list(py_state[1]), py_state[2]]}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))


def save_checkpoint(state, path):
    """Write atomically: to a temporary file in the same folder, fsync, then rename over `path`,
    so a crash at any moment leaves either the old or the new file, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left over when the write failed


def load_state_dict_strict(module, state_dict, what="model"):
    """Strict loading with a readable report instead of a wall of key names from torch."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    bad_shape = [f"{k}: {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}" for k in own
                 if k in state_dict and state_dict[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        def head(keys):
            return ", ".join(keys[:5]) + (f" ... (+{len(keys) - 5})" if len(keys) > 5 else "")
        die(f"{what} does not match the checkpoint (another --arch, --patch_size or head size?). "
            f"missing: [{head(missing)}] unexpected: [{head(unexpected)}] shape: [{head(bad_shape)}]")
    module.load_state_dict(state_dict, strict=True)


def load_checkpoint(path):
    if Path(path).stat().st_size == 0:
        die(f"checkpoint {path} is empty (0 bytes: a truncated copy?); replace it, or delete it to start afresh")
    try:  # the authors' full checkpoints store their args as an argparse.Namespace
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        die(f"checkpoint {path} cannot be read ({Path(path).stat().st_size} bytes: truncated, or not a "
            f"PyTorch file?): {reason}")


# Arguments that may differ when a run is resumed: where and how it runs, not what it learns.
# --epochs may change too (the schedules follow the new length), but not below the epochs done.
RUN_ONLY_ARGS = {"output_dir", "device", "num_workers", "data_path", "skip_bad_images", "saveckp_freq",
                 "save_every_iters", "precision", "monitor_correspondence", "val_subset", "allow_changed_args"}


def token_stride(arch, patch_size):
    """Pixels per token of the last feature map: the ViT patch; 32 for Swin (4 px patches, merged
    once per later stage)."""
    cfg = ARCHS[arch]
    return patch_size if cfg["family"] == "vit" else 4 * 2 ** (len(cfg["depths"]) - 1)


def check_crop_sizes(args):
    """One rule for every self-supervised script: each crop is tiled exactly by the last tokens.
    Otherwise a ViT stops deep inside timm, and a Swin silently pads its token maps with zeros
    (averaged into the global feature, and off the crop's geometry)."""
    stride = token_stride(args.arch, args.patch_size)
    sizes = {"--global_crop_size": args.global_crop_size}
    if args.local_crops_number:
        sizes["--local_crop_size"] = args.local_crop_size
    for flag, size in sizes.items():
        if size % stride:
            die(f"{flag} {size} is not a multiple of the {args.arch} token stride ({stride} px); "
                f"use e.g. {max(stride, size // stride * stride)}")


def check_eval_crop(crop, arch, patch_size):
    """Evaluation crops: a ViT needs whole patches (a Swin pads its token maps, which DRLoc's
    small-image runs rely on)."""
    if ARCHS[arch]["family"] == "vit" and crop % patch_size:
        die(f"--crop {crop} is not a multiple of the {arch} patch size ({patch_size} px); "
            f"use e.g. {max(patch_size, crop // patch_size * patch_size)}")


def start_training(args, method):
    """Start-up of a training script, before anything is written to --output_dir: the crop sizes
    (`check_crop_sizes`) and the checkpoint to resume from: written by this method, readable, and
    trained with the same arguments (`check_resumed_args`). Then removes this script's own stale
    temporary files. Returns the checkpoint to resume from, or None. The script writes args.json
    (`save_args`) once the rest of its start-up (data, model) has passed too."""
    if hasattr(args, "global_crop_size"):   # DRLoc checks its --input_size itself
        check_crop_sizes(args)
    path = Path(args.output_dir) / "checkpoint.pth"
    ckpt = None
    if path.exists():
        ckpt = load_checkpoint(path)
        written_by = ckpt.get("method") if isinstance(ckpt, dict) else None
        if written_by != method:
            who = f"{written_by}.py" if written_by else "another program"
            die(f"{path} was written by {who}, not {method}.py: give {method}.py its own --output_dir "
                f"(default runs/{method})")
        check_resumed_args(ckpt, args, path)
    if is_main_process():
        remove_stale_temporaries(args.output_dir)
    return ckpt


def check_resumed_args(ckpt, args, path):
    """Refuse to resume with arguments that change what is trained (architecture, head, crops, lr,
    batch, ...): one line naming each difference. --allow_changed_args resumes anyway."""
    old, new = ckpt.get("args", {}), vars(args)
    changed = [k for k in sorted(old.keys() & new.keys())
               if k not in RUN_ONLY_ARGS and k != "epochs" and as_plain(old[k]) != as_plain(new[k])]
    if changed and not args.allow_changed_args:
        die(f"{path} was trained with other arguments: "
            + ", ".join(f"--{k} {as_plain(old[k])} (now {as_plain(new[k])})" for k in changed)
            + "; run with the checkpoint's values, another --output_dir, or --allow_changed_args")
    if changed:
        log(f"warning: resuming with changed arguments (--allow_changed_args): {', '.join(changed)}")
    if ckpt.get("epoch", 0) > args.epochs:
        die(f"{path} has already trained {ckpt['epoch']} epochs, more than --epochs {args.epochs}")
    if "epochs" in old and old["epochs"] != args.epochs:
        log(f"--epochs changed from {old['epochs']} to {args.epochs}: the schedules follow the new length")


def as_plain(value):
    """Tuples and lists compare alike (args.json and checkpoints store tuples as lists)."""
    return list(value) if isinstance(value, (tuple, list)) else value


def remove_stale_temporaries(output_dir):
    """Delete the temporary files that `save_checkpoint` of a killed process (kill -9, a node
    failure) left behind; those of a process still alive are kept."""
    for tmp in Path(output_dir).glob(".*.pth.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            log(f"removed {tmp}, left by an interrupted checkpoint write")


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def restore(checkpoint, **objects):
    """Load every named object (module, optimizer, scaler, loss) from `checkpoint`; modules strictly."""
    for name, obj in objects.items():
        if name not in checkpoint:
            die(f"checkpoint has no {name!r} entry (written by another script?)")
        if isinstance(obj, nn.Module):
            load_state_dict_strict(unwrap(obj), checkpoint[name], what=name)
        else:
            obj.load_state_dict(checkpoint[name])


# ================================================================================================
# 8. Logging and shared arguments
# ================================================================================================
def log(*message):
    if is_main_process():
        print(*message, flush=True)


def progress(iterable, desc, total=None):
    return tqdm(iterable, desc=desc, total=total, disable=not is_main_process(), dynamic_ncols=True,
                mininterval=1.0)


def append_log(output_dir, record):
    if is_main_process():
        with open(Path(output_dir) / "log.txt", "a") as f:
            f.write(json.dumps(record) + "\n")


def save_args(args):
    if is_main_process():
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(args.output_dir) / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)


def peak_memory_mb(device):
    """Peak GPU memory allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bool_flag(s):
    if s.lower() in ("1", "true", "on", "yes"):
        return True
    if s.lower() in ("0", "false", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")


def ranged(kind, low=None, high=None, low_open=False):
    """An argparse type: a number of `kind` (int or float) in [low, high] (low excluded with
    low_open; None = unbounded), so that a value out of range is one line at parse time."""
    bounds = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
              f"{'inf)' if high is None else f'{high}]'}")

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high) or value != value:  # value != value: NaN
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected a value in {bounds}")
        return value
    parse.__name__ = f"{kind.__name__} in {bounds}"
    return parse


POSITIVE_INT = ranged(int, 1)                     # sizes, batches, epochs
COUNT = ranged(int, 0)                            # 0 allowed: "none" or "off"
POSITIVE = ranged(float, 0, low_open=True)        # temperatures
NONNEGATIVE = ranged(float, 0)                    # learning rates, weight decay, loss weights
FRACTION = ranged(float, 0, 1)                    # momenta, probabilities, rates
AREA_FRACTION = ranged(float, 0, 1, low_open=True)  # crop scales


def add_backbone_args(parser, arch="vit_small", drop_path_rate=0.1):
    g = parser.add_argument_group("backbone")
    g.add_argument("--arch", default=arch, choices=list(ARCHS),
                   help="ViT (DINO Table 8) or Swin (EsViT Table 6); *_pico are tiny CPU test models")
    g.add_argument("--patch_size", default=16, type=POSITIVE_INT,
                   help="ViT patch size (16 or 8; smaller patches are much better and much slower)")
    g.add_argument("--window_size", default=7, type=POSITIVE_INT,
                   help="Swin window size (7, or 14 for full attention in the last two stages)")
    g.add_argument("--drop_path_rate", default=drop_path_rate, type=FRACTION, help="stochastic depth of the student")
    return g


def add_multicrop_args(parser, global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4),
                       local_crops_number=8):
    g = parser.add_argument_group("multi-crop augmentation")
    g.add_argument("--global_crops_scale", type=AREA_FRACTION, nargs=2, default=global_crops_scale,
                   help="area range of the 2 global crops (DINO advises a wide range, e.g. (0.14, 1) "
                        "without local crops)")
    g.add_argument("--local_crops_number", type=COUNT, default=local_crops_number,
                   help="number of small local crops (0 disables multi-crop)")
    g.add_argument("--local_crops_scale", type=AREA_FRACTION, nargs=2, default=local_crops_scale,
                   help="area range of the local crops")
    g.add_argument("--global_crop_size", type=POSITIVE_INT, default=224, help="pixels")
    g.add_argument("--local_crop_size", type=POSITIVE_INT, default=96, help="pixels")
    return g


def add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="folder", choices=DATASETS,
                   help="folder = an ImageFolder at --data_path; synthetic = procedural shapes, no files")
    g.add_argument("--data_path", default=None, type=str, help="image folder, or a dataset's local root")
    g.add_argument("--synthetic_images", default=2000, type=POSITIVE_INT, help="size of the synthetic train split")
    g.add_argument("--synthetic_image_size", default=64, type=POSITIVE_INT, help="side of synthetic images (pixels)")
    g.add_argument("--synthetic_seed", default=0, type=COUNT, help="which synthetic dataset to draw")
    g.add_argument("--skip_bad_images", action="store_true",
                   help="skip unreadable image files (logged and counted) instead of stopping")
    g.add_argument("--num_workers", default=10, type=COUNT, help="data loader processes per GPU/process")
    return g


def add_head_size_args(group):
    """The DINO head's MLP sizes. The authors fix 2048 / 256; a tiny CPU backbone (64-dim) trains
    several times more steps per minute with a head sized like itself."""
    group.add_argument("--head_hidden_dim", default=2048, type=POSITIVE_INT, help="width of the head's hidden MLP layers")
    group.add_argument("--head_bottleneck_dim", default=256, type=POSITIVE_INT,
                       help="width of the l2-normalised bottleneck before the K-way last layer")


def add_run_args(parser, saveckp_freq=20):
    g = parser.add_argument_group("run")
    g.add_argument("--output_dir", default=f"runs/{Path(parser.prog).stem}", type=str,
                   help="checkpoints and logs; a run resumes from here")
    g.add_argument("--allow_changed_args", action="store_true",
                   help="resume although arguments that change what is trained differ from the checkpoint's")
    g.add_argument("--saveckp_freq", default=saveckp_freq, type=COUNT, help="keep a copy every N epochs")
    g.add_argument("--seed", default=0, type=COUNT, help="seeds weights, data order and augmentations")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    g.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="autocast dtype; fp16 uses a grad scaler (on CPU only for testing: slow); bf16 is faster "
                        "on GPUs, and on CPUs at ViT-S size (slower for the tiny *_pico models)")
    g.add_argument("--save_every_iters", default=0, type=COUNT,
                   help="also write checkpoint.pth every N steps inside an epoch (long epochs); a run "
                        "resumes at the next unseen batch")
    g.add_argument("--max_steps_per_epoch", default=0, type=COUNT,
                   help="stop each epoch after N steps (0 = full epoch); for smoke tests")
    return g
