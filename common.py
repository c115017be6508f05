"""Shared infrastructure of the five method files and the evaluation scripts; no method logic.

Part A, what the methods compute (all that a method's model and `train_one_epoch` call): A1 backbones
(timm ViT / Swin, global and dense features), A2 the DINO head, A3 multi-crop with geometry, A4 the training
step's schedules, EMA, mixed precision and collectives. Part B, how they run: B1 data, B2 processes
and loaders, B3 checkpoints and resume, B4 exits in one line, B5 logging and shared arguments.
A docstring starting with "Collective" (or a name ending in `_all_ranks`) marks a function every process must call.
"""
import argparse
import atexit
import contextlib
import ctypes
import datetime
import errno
import fcntl
import gzip
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import pickle
import random
import re
import resource
import signal
import socket
import stat
import sys
import threading
import time
import zipfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFilter
from timm.layers import Attention as TimmAttention
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


# ######## PART A. WHAT THE METHODS COMPUTE ########################################################

# ======== A1. Backbones ===========================================================================
# Real configurations: DINO Table 8 (ViT) and EsViT Table 6 (Swin). The `*_pico` entries are not
# from any paper: they exist so that every script runs, and is tested, on a laptop CPU in seconds.
ARCHS = {
    "vit_pico": dict(family="vit", embed_dim=64, depth=4, num_heads=2),
    "vit_tiny": dict(family="vit", embed_dim=192, depth=12, num_heads=3),
    "vit_small": dict(family="vit", embed_dim=384, depth=12, num_heads=6),
    "vit_base": dict(family="vit", embed_dim=768, depth=12, num_heads=12),
    "swin_pico": dict(family="swin", embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8)),
    # for 28-32 px images: patch 2 and three stages, so a 32 px crop's grids are 16, 8, 4
    "swin_pico3": dict(family="swin", patch_size=2, embed_dim=32, depths=(2, 2, 2), num_heads=(1, 2, 4)),
    "swin_tiny": dict(family="swin", embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin_small": dict(family="swin", embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin_base": dict(family="swin", embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
}


class Attention(TimmAttention):
    """timm's attention, on a CPU under bf16 autocast computed explicitly (timm's unfused path): there
    the fused kernel's bf16 backward made vit_pico's attention 9x slower (torch 2.14, Xeon, AMX)."""

    @property
    def fused_attn(self):
        return self._fused_attn and not (torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)

    @fused_attn.setter
    def fused_attn(self, value):
        self._fused_attn = value


class ViT(VisionTransformer):
    """timm's VisionTransformer (the DINO authors' key names) with DINO's position interpolation,
    `scale_factor=((h + 0.1) / n, (w + 0.1) / n)` bicubic: timm's antialiased resampling differs (by
    up to ~4 on a ViT-Ti), so released weights would see other local-crop inputs."""

    def _pos_embed(self, x):  # x: [B, h, w, C] patch embeddings (dynamic_img_size=True)
        (B, h, w, C), (gh, gw) = x.shape, self.patch_embed.grid_size
        n_prefix, pos = self.num_prefix_tokens, self.pos_embed
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

    def forward_dense(self, x, norm=True):
        """(CLS token [B, D] or None, grid [B, h, w, D]); norm=False: before the final LayerNorm."""
        h, w = x.shape[-2] // self.patch_embed.patch_size[0], x.shape[-1] // self.patch_embed.patch_size[1]
        tokens = self.blocks(self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x)))))
        tokens = self.norm(tokens) if norm else tokens
        cls = tokens[:, 0] if self.cls_token is not None else None
        return cls, tokens[:, self.num_prefix_tokens:].reshape(x.shape[0], h, w, -1)


class Swin(SwinTransformer):
    """timm's SwinTransformer; global feature = mean of the final-norm tokens (EsViT's pooling)."""

    def forward_dense(self, x, norm=True):
        tokens = self.layers(self.patch_embed(x))  # [B, h, w, D]
        tokens = self.norm(tokens) if norm else tokens
        return tokens.mean(dim=(1, 2)), tokens


def build_backbone(arch, patch_size=16, window_size=7, drop_path_rate=0.0, img_size=224,
                   class_token=True, final_norm=True, layer_norm_eps=1e-6, **overrides):
    """A ViT or Swin from `ARCHS` built for `img_size` (the global crop); `overrides` replace `ARCHS`
    entries. The arguments are kept in `build_config`, which checkpoints record (`backbone_record`)."""
    config = dict(arch=arch, patch_size=patch_size, window_size=window_size, img_size=img_size,
                  class_token=class_token, final_norm=final_norm, layer_norm_eps=layer_norm_eps, **overrides)
    if arch not in ARCHS:
        die(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg = {**ARCHS[arch], **overrides}
    family, norm_layer = cfg.pop("family"), partial(nn.LayerNorm, eps=layer_norm_eps)
    if family == "vit":
        if patch_size < 1 or img_size % patch_size:
            die(f"--patch_size {patch_size} does not divide the {img_size} px global crop; choose a divisor "
                f"of the crop size (e.g. 16 or 8 at 224 px, 4 at 32 px)")
        backbone = ViT(img_size=img_size, patch_size=patch_size, mlp_ratio=4, qkv_bias=True,
                       norm_layer=norm_layer, num_classes=0, dynamic_img_size=True, drop_path_rate=drop_path_rate,
                       class_token=class_token, global_pool="token" if class_token else "avg", final_norm=final_norm,
                       fc_norm=False,  # keep the final norm in `norm` (timm moves it to fc_norm for "avg")
                       attn_layer=Attention, **cfg)
    else:
        if not class_token or not final_norm:
            die("a Swin backbone has no CLS token to remove and always ends in a LayerNorm")
        backbone = Swin(img_size=img_size, patch_size=cfg.pop("patch_size", 4), window_size=window_size, mlp_ratio=4,
                        qkv_bias=True, norm_layer=norm_layer, num_classes=0, strict_img_size=False,
                        drop_path_rate=drop_path_rate, **cfg)
    backbone.build_config = config
    return backbone


def backbone_record(backbone, image_token="backbone"):
    """A checkpoint's "backbone" entry: `build_backbone`'s arguments and the image token's source."""
    return {**backbone.build_config, "image_token": image_token}


def token_stride(arch, patch_size=16):
    """Pixels per token of the final grid: the ViT patch, or Swin's patch x 2 per patch merging."""
    cfg = ARCHS[arch]
    return patch_size if cfg["family"] == "vit" else cfg.get("patch_size", 4) * 2 ** (len(cfg["depths"]) - 1)


def fitted_windows(arch, patch_size, window_size, crop_sizes):
    """Per Swin stage, the largest window <= window_size tiling every crop's grid (padding is attended)."""
    grids = [[size // ARCHS[arch].get("patch_size", 4)] for size in crop_sizes]      # per crop, per stage
    for stage_grids in grids:
        for _ in ARCHS[arch]["depths"][1:]:
            stage_grids.append((stage_grids[-1] + 1) // 2)                            # timm pads an odd grid
    return tuple(max(w for w in range(1, window_size + 1) if all(g % w == 0 for g in stage)) for stage in zip(*grids))


def backbone_from_args(args, drop_path_rate, **kwargs):
    """The backbone a training run's arguments describe (built for the global crop; `--fit_window`)."""
    window = getattr(args, "window_size", 7)
    global_size = getattr(args, "global_crop_size", None) or getattr(args, "input_size", None) or 224
    if getattr(args, "fit_window", False) and ARCHS[args.arch]["family"] == "swin":
        sizes = [global_size] + ([args.local_crop_size] if getattr(args, "local_crops_number", 0) else [])
        window = fitted_windows(args.arch, args.patch_size, window, sizes)
    return build_backbone(args.arch, args.patch_size, window, drop_path_rate, img_size=global_size, **kwargs)


def resolution_groups(crops):
    """(start, end) of every run of consecutive crops with the same resolution."""
    ends = list(itertools.accumulate(len(list(run)) for _, run in itertools.groupby(c.shape[-2:] for c in crops)))
    return list(zip([0] + ends[:-1], ends))


def forward_multicrop(fn, crops):
    """`fn` of each run of equal-resolution crops, concatenated crop-major (DINO's MultiCropWrapper)."""
    return [fn(torch.cat(crops[s:e])) for s, e in resolution_groups(crops)]


def other_crop_pairs(ncrops):
    """Flat indices of the pairs s != t in [2, ncrops] (teacher t, student s): a boolean mask would sync."""
    return torch.tensor([t * ncrops + s for t in range(2) for s in range(ncrops) if s != t])


# ======== A2. The DINO head =======================================================================
class WeightNormLinear(nn.Module):
    """Bias-free Linear, weight = g v / ||v|| per row, with `nn.utils.weight_norm`'s keys (the authors')."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.weight_v = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(out_dim, in_dim), a=math.sqrt(5)))  # as nn.Linear
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1))

    def forward(self, x):
        return F.linear(x, self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True))


class DINOHead(nn.Module):
    """MLP -> l2-normalise -> weight-normalised Linear(bottleneck, K). Under bf16 it computes in float32: the teacher
    temperature scales logit errors by 25 (a 65,536-way bf16 head: up to 0.06; extras/head_precision.py)."""

    def __init__(self, in_dim, out_dim, use_bn=False, norm_last_layer=True, nlayers=3,
                 hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        dims, layers = [in_dim] + [hidden_dim] * (max(nlayers, 1) - 1), []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b)] + ([nn.BatchNorm1d(b)] if use_bn else []) + [nn.GELU()]
        layers.append(nn.Linear(dims[-1], bottleneck_dim))
        self.mlp = layers[0] if len(layers) == 1 else nn.Sequential(*layers)     # the authors' key names
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
        self.last_layer.weight_g.requires_grad = not norm_last_layer

    def forward(self, x):
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
            with torch.autocast(device, enabled=False):
                return self.project(x.float())
        return self.project(x)

    def project(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


# ======== A3. Multi-crop with geometry ============================================================
class RandomGaussianBlur:
    """DINO's PIL Gaussian blur, with probability p and radius ~ U(sigma), drawn from torch's RNG."""

    def __init__(self, p, sigma=(0.1, 2.0)):
        self.p, self.sigma = p, sigma

    def draw(self):
        """The radius, or None for no blur."""
        return None if torch.rand(1).item() >= self.p else self.sigma[0] + (self.sigma[1] - self.sigma[0]) * torch.rand(1).item()

    def __call__(self, img):
        return img if (radius := self.draw()) is None else img.filter(ImageFilter.GaussianBlur(radius=radius))


class MultiCropAugmentation:
    """DINO's multi-crop: 2 global and N local crops with their geometry {"box": [x0, y0, w, h] (fractions),
    "flip", "image_size": [W, H]}; the blur radius scales with global_crop_size / 224; torch's RNG only."""

    def __init__(self, global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4), local_crops_number=8,
                 global_crop_size=224, local_crop_size=96, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.global_scale, self.local_scale, self.n_local = tuple(global_crops_scale), tuple(local_crops_scale), local_crops_number
        self.global_size, self.local_size, self.mean, self.std = global_crop_size, local_crop_size, mean, std
        color = [transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                 transforms.RandomGrayscale(p=0.2)]
        to_tensor = [transforms.ToTensor(), transforms.Normalize(mean, std)]
        sigma = (0.1 * global_crop_size / 224, 2.0 * global_crop_size / 224)
        self.global1 = transforms.Compose(color + [RandomGaussianBlur(1.0, sigma)] + to_tensor)
        self.global2 = transforms.Compose(color + [RandomGaussianBlur(0.1, sigma),
                                                   transforms.RandomSolarize(128, p=0.2)] + to_tensor)
        self.local = transforms.Compose(color + [RandomGaussianBlur(0.5, sigma)] + to_tensor)

    def plan(self):
        """(size, scale, photometric pipeline) of every crop, in the order they are drawn."""
        return ([(self.global_size, self.global_scale, views) for views in (self.global1, self.global2)]
                + [(self.local_size, self.local_scale, self.local)] * self.n_local)

    @staticmethod
    def crop_and_flip(img, size, scale):
        top, left, h, w = transforms.RandomResizedCrop.get_params(img, list(scale), [3 / 4, 4 / 3])
        crop = TF.resized_crop(img, top, left, h, w, [size, size], TF.InterpolationMode.BICUBIC)
        flip = bool(torch.rand(1).item() < 0.5)
        crop, (W, H) = TF.hflip(crop) if flip else crop, img.size
        geometry = {"box": torch.tensor([left / W, top / H, w / W, h / H]),
                    "flip": torch.tensor(flip), "image_size": torch.tensor([float(W), float(H)])}
        return crop, geometry

    def __call__(self, img):
        crops, geometry = [], []
        for size, scale, photometric in self.plan():
            crop, geo = self.crop_and_flip(img, size, scale)
            crops.append(photometric(crop))
            geometry.append(geo)
        return crops, geometry

    def batch(self, images, seeds):
        """`--batched_crops`: same-size images [B, 3, H, W] (uint8) cropped with the PIL path's draws per seed and
        torchvision's tensor operations (an exact Gaussian for PIL's box blur), collated."""
        batch, _, height, width = images.shape
        params = []
        for seed in seeds:
            torch.default_generator.manual_seed(seed)
            params.append([self.draw_crop(height, width, scale, photometric) for _, scale, photometric in self.plan()])
        pixels = images.float()                                        # 0..255, as PIL's levels
        mean, std = torch.tensor(self.mean).view(1, 3, 1, 1), torch.tensor(self.std).view(1, 3, 1, 1)
        crops, geometry = [], []
        for k, (size, _, _) in enumerate(self.plan()):
            p = {name: [sample[k][name] for sample in params] for name in params[0][k]}
            x = torch.cat([F.interpolate(pixels[i:i + 1, :, top:top + h, left:left + w], size=(size, size),
                                         mode="bicubic", antialias=True) for i, (top, left, h, w) in enumerate(p["box"])])
            flip = torch.tensor(p["flip"])
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x).clamp(0, 255)
            x = color_jitter(x, p["jitter"])
            x = torch.where(torch.tensor(p["gray"]).view(-1, 1, 1, 1), grayscale(x).expand_as(x), x)
            x = gaussian_blur(x, p["blur"])
            x = torch.where(torch.tensor(p["solarize"]).view(-1, 1, 1, 1) & (x >= 128), 255 - x, x)
            crops.append((x.round() / 255 - mean) / std)                   # 8-bit levels, as PIL's images
            top, left, h, w = torch.tensor(p["box"], dtype=torch.float64).unbind(1)
            geometry.append({"box": torch.stack([left / width, top / height, w / width, h / height], 1).float(),
                             "flip": flip, "image_size": torch.tensor([float(width), float(height)]).repeat(batch, 1)})
        return crops, geometry

    @staticmethod
    def draw_crop(height, width, scale, photometric):
        """One crop's parameters, drawn as `crop_and_flip` and the `photometric` pipeline draw them."""
        box = transforms.RandomResizedCrop.get_params(torch.empty(0, height, width), list(scale), [3 / 4, 4 / 3])
        crop = dict(box=box, flip=bool(torch.rand(1).item() < 0.5), jitter=None, gray=False, blur=None, solarize=False)
        for t in photometric.transforms:
            if isinstance(t, transforms.RandomApply):                         # the colour jitter
                if not t.p < torch.rand(1).item():
                    j = t.transforms[0]
                    order, *factors = j.get_params(j.brightness, j.contrast, j.saturation, j.hue)
                    crop["jitter"] = (order.tolist(), factors)
            elif isinstance(t, transforms.RandomGrayscale):
                crop["gray"] = torch.rand(1).item() < t.p
            elif isinstance(t, RandomGaussianBlur):
                crop["blur"] = t.draw()
            elif isinstance(t, transforms.RandomSolarize):
                crop["solarize"] = torch.rand(1).item() < t.p
        return crop


# The pixel operations of `MultiCropAugmentation.batch`: float images [N, 3, h, w] of levels 0..255.
def grayscale(x):
    """torchvision's luma, [N, 1, h, w]."""
    return (x * torch.tensor([0.2989, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)


def shift_hue(x, shift):
    """torchvision's adjust_hue per sample: hue rotated by `shift` (a fraction of the circle) in HSV."""
    maxc, minc = x.amax(1, keepdim=True), x.amin(1, keepdim=True)
    chroma = maxc - minc
    rc, gc, bc = ((maxc - x) / torch.where(chroma > 0, chroma, 1.0)).unbind(1)
    r, g = x[:, 0] == maxc[:, 0], x[:, 1] == maxc[:, 0]
    hue = torch.where(r, bc - gc, torch.where(g, 2 + rc - bc, 4 + gc - rc))[:, None]
    hue = torch.remainder(hue / 6 + shift.view(-1, 1, 1, 1), 1)
    k = torch.remainder(torch.tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1) + 6 * hue, 6)   # HSV -> RGB, per channel
    return maxc - chroma * torch.minimum(k, 4 - k).clamp(0, 1)


def adjust_color(x, op, f):
    """torchvision's brightness, contrast, saturation or hue (op 0-3) by f [N, 1, 1, 1]; blends truncated as PIL's."""
    if op == 3:
        return shift_hue(x, f)
    degenerate = 0.0 if op == 0 else grayscale(x).mean((1, 2, 3), keepdim=True) if op == 1 else grayscale(x)
    return torch.floor((degenerate + f * (x - degenerate)).clamp(0, 255))


def color_jitter(x, jitters):
    """torchvision's ColorJitter per sample, in each sample's order with its factors (None: unchanged)."""
    apply = torch.tensor([j is not None for j in jitters])
    order = torch.tensor([j[0] if j is not None else [0, 1, 2, 3] for j in jitters])          # [N, 4]
    factors = torch.tensor([j[1] if j is not None else [1.0, 1.0, 1.0, 0.0] for j in jitters])  # [N, 4]
    for position in range(4):
        for op in range(4):
            chosen = apply & (order[:, position] == op)
            if chosen.any():
                x[chosen] = adjust_color(x[chosen], op, factors[chosen, op].view(-1, 1, 1, 1))
    return x


def gaussian_blur(x, sigmas):
    """Gaussian blur per sample (None: none) as [N, size, size] matrices: one matmul, not a call per image."""
    blurred = [i for i, s in enumerate(sigmas) if s is not None]
    if not blurred:
        return x
    sigma, size = torch.tensor([sigmas[i] for i in blurred])[:, None], x.shape[-1]
    offsets = torch.arange(-int(3 * sigma.max()) - 1, int(3 * sigma.max()) + 2)
    weights = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    weights = weights / weights.sum(1, keepdim=True)                                  # [n, K]
    source = (torch.arange(size)[:, None] + offsets).clamp(0, size - 1)                # [size, K]
    m = torch.zeros(len(blurred), size, size).scatter_add_(2, source.expand(len(blurred), -1, -1),
                                                           weights[:, None].expand(-1, size, -1))[:, None]
    x = x.clone()
    x[blurred] = m @ x[blurred] @ m.transpose(-1, -2)
    return x


def grid_centers(geometry, grid_size):
    """Centre of each cell of an (h, w) grid over each (maybe mirrored) crop, as image pixels [B, h*w, 2] (x, y)."""
    (h, w), box, flip = grid_size, geometry["box"].float(), geometry["flip"].bool()
    img_w, img_h = geometry["image_size"].float().unbind(-1)
    cols = (torch.arange(w, device=box.device) + 0.5) / w                      # [w]
    cols = torch.where(flip[:, None], 1 - cols, cols)                           # [B, w]
    rows = ((torch.arange(h, device=box.device) + 0.5) / h).expand(len(box), h)  # [B, h]
    x = (box[:, 0:1] + cols * box[:, 2:3]) * img_w[:, None]
    y = (box[:, 1:2] + rows * box[:, 3:4]) * img_h[:, None]
    return torch.stack(torch.broadcast_tensors(x[:, None, :], y[:, :, None]), -1).reshape(len(box), h * w, 2)


def sample_seed(*keys):
    """A well-mixed 63-bit seed from integer keys, e.g. (seed, epoch, index) of one sample."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0] >> 1)


class SeededDataset(torch.utils.data.Dataset):
    """`transform(base[index])` under a seed of (seed, epoch, index) only, whatever the workers, processes or
    resumption; `make_loader` asks for `dataset[(index, epoch)]` (persistent workers keep their copy of
    `self.epoch`, the epoch of a plain `dataset[index]`)."""

    def __init__(self, base, transform, seed=0, batched=False):
        self.base, self.transform, self.seed, self.epoch, self.batched = base, transform, seed, 0, batched
        samples, sizes = getattr(getattr(base, "dataset", base), "samples", []) if batched else [], set()   # (--holdout)
        for path, _ in samples[::max(1, len(samples) // 1000)]:   # before any loader worker: 1000 headers at most
            with contextlib.suppress(OSError, ValueError), Image.open(path) as image:    # unreadable: refused later
                sizes.add(image.size[::-1])
        if len(sizes) > 1:
            die(f"--batched_crops needs images of one size; {base.root if hasattr(base, 'root') else 'the folder'} has "
                f"sizes {sorted(sizes)}: drop the flag")

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        index, epoch = index if isinstance(index, tuple) else (index, self.epoch)
        image, label = self.base[index]
        seed = sample_seed(self.seed, epoch, index)
        if torch.utils.data.get_worker_info() is not None:   # a worker's generators serve this dataset alone
            return self.seeded_transform(image, seed), label
        # in the main process (num_workers=0) the training loop draws from them too: restore them
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            try:
                return self.seeded_transform(image, seed), label
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)

    def __getitems__(self, indices):
        """A batch: with `batched`, built at once by `transform.batch` and collated; else a list."""
        if not self.batched:
            return [self[i] for i in indices]
        pairs = [i if isinstance(i, tuple) else (i, self.epoch) for i in indices]
        images, labels = zip(*(self.base[i] for i, _ in pairs))
        pixels = [TF.pil_to_tensor(image.convert("RGB")) for image in images]
        if len({p.shape for p in pixels}) > 1:
            die(f"--batched_crops needs images of one size; this batch has sizes "
                f"{sorted({tuple(p.shape[1:]) for p in pixels})}: drop the flag")
        seeds = [sample_seed(self.seed, epoch, index) for index, epoch in pairs]
        threads = torch.get_num_threads()
        # thousands of small operations: one thread; more only add synchronisation (4x slower on a shared CPU)
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[], enabled=torch.utils.data.get_worker_info() is None):
                crops, geometry = self.transform.batch(torch.stack(pixels), seeds)
        finally:
            torch.set_num_threads(threads)
        return (crops, geometry), torch.tensor(labels)

    def seeded_transform(self, image, seed):
        """Seeds torch's CPU generator (torch.manual_seed would seed CUDA's too), Python's and NumPy's."""
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        return self.transform(image)


def eval_transform(resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """DINO's evaluation transform: Resize(256, bicubic) -> CenterCrop(224) -> normalise."""
    if crop > resize:
        die(f"--crop {crop} is larger than --resize {resize}: the center crop would be padded with black; "
            f"use --resize {crop} or more (DINO: --resize 256 --crop 224)")
    return transforms.Compose([transforms.Resize(resize, interpolation=TF.InterpolationMode.BICUBIC),
                               transforms.CenterCrop(crop), transforms.ToTensor(), transforms.Normalize(mean, std)])


# ======== A4. The training step: schedules, optimiser details, EMA, mixed precision, collectives ====
def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    """Per iteration: a linear warmup to `base_value`, then `final + 0.5 (base - final)(1 + cos(pi i / T))`."""
    check_schedule_length(epochs, niter_per_ep)
    warmup_iters = int(warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((np.linspace(start_warmup_value, base_value, warmup_iters), schedule))


MAX_SCHEDULE_STEPS = 10 ** 8     # 800 MB a schedule; DINO's 800 ImageNet epochs: 10 ** 6 steps


def check_schedule_length(epochs, niter_per_ep):
    """A schedule holds a value per step: an enormous --epochs is refused, not out of memory."""
    if epochs * niter_per_ep > MAX_SCHEDULE_STEPS:
        die(f"--epochs {epochs} of {niter_per_ep} steps each are {epochs * niter_per_ep:.3g} "
            f"steps, more than the {MAX_SCHEDULE_STEPS:.0e} that a run's schedules hold (a value "
            f"per step); lower --epochs")


def teacher_temperature_schedule(warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs, niter_per_ep=1):
    """Teacher temperature per iteration, linear then constant (whole warm-up epochs ramp per epoch, as the authors')."""
    check_schedule_length(nepochs, niter_per_ep)
    if float(warmup_epochs).is_integer():
        warmup = np.repeat(np.linspace(warmup_teacher_temp, teacher_temp, int(warmup_epochs)), niter_per_ep)
    else:
        warmup = np.linspace(warmup_teacher_temp, teacher_temp, int(warmup_epochs * niter_per_ep))
    total = nepochs * niter_per_ep     # a warm-up longer than the run is cut where the run ends
    return np.concatenate((warmup, np.ones(max(total - len(warmup), 0)) * teacher_temp))[:total]


def get_params_groups(model, no_decay_names=()):
    """AdamW groups: weights (decayed); biases, norms, gains and `no_decay_names` (not); frozen ones left out."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    exempt = [name.endswith(".bias") or p.ndim == 1 or any(n in name for n in no_decay_names) for name, p in trained]
    return [{"params": [p for (_, p), e in zip(trained, exempt) if not e]},
            {"params": [p for (_, p), e in zip(trained, exempt) if e], "weight_decay": 0.0}]


def clip_gradients(model, clip):
    """The authors' per-parameter clipping (each gradient to norm <= clip), without a host sync."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    norms = torch.stack(torch._foreach_norm(grads, 2))
    factors = (norms + 1e-6).reciprocal() * clip      # what `clip / (norm + 1e-6)` computes
    torch._foreach_mul_(grads, torch.where(factors < 1, factors, 1.0).unbind())
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    """Drop the heads' last-layer gradients during the first `freeze_last_layer` (fractional) epochs."""
    for name, p in model.named_parameters():
        if epoch < freeze_last_layer and "last_layer" in name:
            p.grad = None


@torch.no_grad()
def update_teacher(student, teacher, momentum):
    """EMA over parameters, teacher = m * teacher + (1 - m) * student, as one multi-tensor operation."""
    s_params = dict(unwrap(student).named_parameters())
    t_names, t_params = zip(*unwrap(teacher).named_parameters())
    torch._foreach_mul_(t_params, momentum)
    torch._foreach_add_(t_params, [s_params[name].detach() for name in t_names], alpha=1 - momentum)


def autocast(device, precision):
    """Mixed-precision context: fp16 (with a grad scaler; on CPUs only for tests), bf16, or fp32."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def make_grad_scaler(device, precision):
    """fp16 gradients can overflow: the scaler skips such a step and lowers its scale (no stop)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


# Where this process stands among the others (one process without a process group).
def is_dist(): return dist.is_available() and dist.is_initialized()
def get_rank(): return dist.get_rank() if is_dist() else 0
def get_world_size(): return dist.get_world_size() if is_dist() else 1
def is_main_process(): return get_rank() == 0
def unwrap(model): return model.module if hasattr(model, "module") else model     # DDP's wrapper off


def all_reduce_sum(t):
    """Collective: the sum of `t` over all processes, as a new tensor (a copy without a group)."""
    t = t.clone()
    if is_dist():
        dist.all_reduce(t)
    return t


def step_sync(losses, epoch, args, debug_state):
    """Collective, once per step: the statistics averaged over the processes and whether any was preempted, in one
    all-reduce and one host read; on a non-finite loss anywhere rank 0 saves `debug_state()` and all stop."""
    loss = losses["loss"].detach()
    flags = [(~loss.isfinite()).to(loss.dtype), torch.full_like(loss, preemption_requested(loss.device))]
    *values, nonfinite, preempted = all_reduce_sum(torch.stack([v.detach().to(loss.dtype) for v in losses.values()] + flags)).tolist()
    stats = {name: value / get_world_size() for name, value in zip(losses, values)}
    if nonfinite:
        path = Path(args.output_dir) / "checkpoint_nonfinite.pth"
        state = {**debug_state(), "epoch": epoch, "args": vars(args)}
        if is_main_process():
            save_checkpoint(state, path)
        if is_dist():   # the others wait for the file: one that exits first makes torchrun stop rank 0 mid-write
            dist.barrier()
        clip = f"a --clip_grad below {args.clip_grad}" if args.clip_grad else "--clip_grad 3.0 (or lower)"
        close_progress_bars()   # the error, not the bar, is the last line
        log(f"error: the loss is {stats['loss']} at epoch {epoch}; debug checkpoint written to {path}.\n"
            f"Likely causes: mixed-precision overflow, a too high learning rate, or exploding "
            f"gradients. Try --precision fp32, a lower --lr, or {clip}.")
        sys.exit(1)
    return stats, preempted > 0


_preemption_signal = None     # set by the handler that `install_preemption_handler` installs


def preemption_requested(device):
    """Whether this process received a preemption signal (tests replace it); `step_sync` shares it."""
    return _preemption_signal is not None


def exit_after_preemption(output_dir):
    _checkpoint_reached.set()
    close_progress_bars()
    log(f"received {_preemption_signal or 'a preemption signal'}: checkpoint written to "
        f"{Path(output_dir) / 'checkpoint.pth'}; run the same command again to resume")
    if is_dist():   # rank 0 may still be writing it: a process that exits first makes torchrun stop rank 0
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(0)


def progress(iterable, desc, total=None):
    return tqdm(iterable, desc=desc, total=total, disable=not is_main_process(), dynamic_ncols=True, mininterval=1.0)


def peak_memory_mb(device):
    """Peak GPU memory allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ######## PART B. HOW THEY RUN ####################################################################

# ======== B1. Data ================================================================================
class BadImageError(RuntimeError):
    pass


def load_image(path):
    """Any image as 8-bit RGB (16-bit and float ones rescaled); an unreadable file raises an error naming it."""
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


IMAGE_EXTENSIONS = tv_datasets.folder.IMG_EXTENSIONS


class ImageFolderSafe(tv_datasets.ImageFolder):
    """ImageFolder with `load_image`. With `skip_bad_images` an unreadable file is replaced by the next one
    and counted; in evaluation (`substitute = False`) it comes labelled SKIPPED and is left out (a
    neighbour's label would bias an accuracy)."""
    SKIPPED = -1

    def __init__(self, root, skip_bad_images=False):
        refuse_revisited_folders(root)
        super().__init__(root, loader=load_image, is_valid_file=self.is_image_file)
        self.skip_bad_images, self.substitute = skip_bad_images, True
        self.skipped = multiprocessing.Value("l", 0)

    def find_classes(self, directory):
        """Class folders, without hidden ones (`.ipynb_checkpoints`: no class of the data)."""
        classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and e.name[0] != ".")
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}

    def is_image_file(self, path):
        """A regular file with an image's name, in no hidden folder and not hidden (`._x.png`)."""
        hidden = any(part[0] == "." for part in Path(os.path.relpath(path, self.root)).parts)
        with contextlib.suppress(OSError):      # unreadable, a broken link: `load_image` names it
            if not stat.S_ISREG(os.stat(path).st_mode):
                return False                    # a FIFO or a device: a read could block for ever
        return not hidden and tv_datasets.folder.has_file_allowed_extension(path, IMAGE_EXTENSIONS)

    def __getitem__(self, index):
        for attempt in range(len(self)):
            i = (index + attempt) % len(self)
            try:
                return super().__getitem__(i)
            except BadImageError as e:
                if not self.skip_bad_images:
                    raise BadImageError(f"{e} (pass --skip_bad_images to skip unreadable files)") from None
                with self.skipped.get_lock():
                    self.skipped.value += 1
                print(f"warning: skipping {e}", file=sys.stderr)
                if not self.substitute:
                    return Image.new("RGB", (1, 1)), self.SKIPPED
        raise BadImageError(f"no readable image in {self.root}")


def refuse_revisited_folders(root):
    """Refuse a walk reaching a folder twice: ImageFolder follows `class/up -> ..` (16 images were read as 656)."""
    seen = {}
    for folder, _dirs, _files in os.walk(root, followlinks=True):
        key = (os.stat(folder).st_dev, os.stat(folder).st_ino)
        if key in seen:
            die(f"{folder} leads to {seen[key]}, a folder already read (a symbolic link loop or a second link to "
                f"one folder): its images would be counted again; remove the link from the image folder")
        seen[key] = folder


def skipped_images_all_ranks(dataset, device):
    """Collective: how many unreadable files the (possibly wrapped) dataset has skipped, in all processes."""
    while hasattr(dataset, "base") or hasattr(dataset, "dataset"):   # SeededDataset, Subset
        dataset = getattr(dataset, "base", None) or dataset.dataset
    count = dataset.skipped.value if hasattr(dataset, "skipped") else 0
    return int(all_reduce_sum(torch.tensor([count], device=device)).item())


def read_idx(path):
    """An IDX file of unsigned bytes (MNIST's format), `path.gz` or else `path`, as a numpy array."""
    path = Path(f"{path}.gz") if Path(f"{path}.gz").exists() else Path(path)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        if data[:3] != b"\0\0\x08":
            raise ValueError(f"it starts {data[:4]!r}, not with an IDX header of unsigned bytes")
        shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(data[3])]
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * data[3]).reshape(shape)
    except (OSError, EOFError, ValueError) as e:     # missing, truncated, not gzipped, not IDX
        die(f"cannot read {path}: {e}; (re)install dataset-fashion-mnist (apt-get) or give --data_path its 4 files")


class FashionMNIST(torch.utils.data.Dataset):
    """Fashion-MNIST from its IDX files (Debian's `dataset-fashion-mnist`), as RGB PIL images."""
    DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"

    def __init__(self, root=None, train=True):
        root, prefix = Path(root or self.DEFAULT_ROOT), "train" if train else "t10k"
        self.images, labels = (read_idx(root / f"{prefix}-{kind}-ubyte") for kind in ("images-idx3", "labels-idx1"))
        if len(labels) != len(self.images):      # e.g. the test split's labels copied in place of the train split's
            die(f"{root}'s {prefix} files hold {len(self.images)} images but {len(labels)} labels; reinstall them")
        self.targets = labels.astype(np.int64)
        self.classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return Image.fromarray(self.images[i], mode="L").convert("RGB"), int(self.targets[i])


class SyntheticShapes(torch.utils.data.Dataset):
    """Procedural labelled images, a pure function of (seed, split, i): 2 to 4 light copies of the class's
    shape over dark noise, so that the class (not colour or an image-wide cue) is what every crop shares."""
    CLASSES = ["disk", "square", "triangle", "diamond", "plus", "cross", "ring", "hbars", "vbars", "checker"]

    def __init__(self, num_images=2000, image_size=64, train=True, seed=0):
        self.n, self.size, self.seed, self.split = num_images, image_size, seed, 0 if train else 1
        self.classes, self.targets = self.CLASSES, [i % len(self.CLASSES) for i in range(num_images)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
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
        if name in ("disk", "ring"):
            d.ellipse(box, fill=fg if name == "disk" else None, outline=fg if name == "ring" else None,
                      width=lw if name == "ring" else 1)
        elif name == "square":
            d.rectangle(box, fill=fg)
        elif name in ("triangle", "diamond"):
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)] if name == "triangle" else
                      [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fg)
        elif name == "plus":
            d.rectangle([cx - lw / 2, cy - r, cx + lw / 2, cy + r], fill=fg)
            d.rectangle([cx - r, cy - lw / 2, cx + r, cy + lw / 2], fill=fg)
        elif name == "cross":
            d.line([(cx - r, cy - r), (cx + r, cy + r)], fill=fg, width=lw)
            d.line([(cx - r, cy + r), (cx + r, cy - r)], fill=fg, width=lw)
        elif name in ("hbars", "vbars"):
            for a in (-r + k * 2 * r / 2.5 for k in range(3)):
                d.rectangle([cx - r, cy + a, cx + r, cy + a + lw] if name == "hbars" else
                            [cx + a, cy - r, cx + a + lw, cy + r], fill=fg)
        else:  # checker
            d.rectangle([cx - r, cy - r, cx, cy], fill=fg)
            d.rectangle([cx, cy, cx + r, cy + r], fill=fg)


DATASETS = ["folder", "synthetic", "fashion_mnist", "cifar10", "cifar100", "svhn"]


def build_dataset(args, train=True):
    """The train or test split of --dataset; with --holdout N, the train split without N of its
    images, or those: the last N (a named dataset's files are in no class order), of a folder N
    drawn with seed 0."""
    holdout = getattr(args, "holdout", 0)
    if not holdout:
        return named_dataset(args, train)
    full = named_dataset(args, train=True)
    if not 0 < holdout < len(full):
        die(f"--holdout {holdout} must be between 1 and the {len(full)} train images minus one")
    order = list(range(len(full)))
    if isinstance(full, tv_datasets.DatasetFolder):   # sorted by class: the last N, one class
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(0)).tolist()
    kept = order[:len(full) - holdout] if train else order[len(full) - holdout:]
    part = torch.utils.data.Subset(full, sorted(kept))
    part.classes = getattr(full, "classes", None)
    return part


def named_dataset(args, train):
    name, path = args.dataset, getattr(args, "data_path", None)
    if name == "synthetic":
        if path:        # drawn, not read: a folder beside it would be silently unused
            die(f"--dataset synthetic draws its images; --data_path {path} would be ignored: drop it (or --dataset folder)")
        return SyntheticShapes(args.synthetic_images if train else max(args.synthetic_images // 4, 10),
                               args.synthetic_image_size, train=train, seed=args.synthetic_seed)
    if name == "fashion_mnist":
        return FashionMNIST(path, train=train)
    if name in ("cifar10", "cifar100", "svhn"):
        if not path or not Path(path).is_dir():
            die(f"--dataset {name} needs --data_path pointing at a local torchvision root (nothing is downloaded)")
        key, value = ("split", "train" if train else "test") if name == "svhn" else ("train", train)
        try:
            return getattr(tv_datasets, name.upper())(path, **{key: value}, download=False)
        except RuntimeError:            # torchvision's advice, download=True, is no flag of these scripts
            die(f"{name} is missing or damaged under --data_path {path}: these scripts download nothing; fetch it once: "
                f"python -c \"import torchvision; torchvision.datasets.{name.upper()}('{path}', {key}={value!r}, download=True)\"")
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
    held = [s for s in ("val", "test") if train and root == Path(path) and (root / s).is_dir()]
    if held:      # the folder itself would be the train split, an evaluation split inside it
        die(f"--data_path {path} has no train/ folder but has {held[0]}/: the train split would "
            f"hold {held[0]}/'s images; put the training images in {Path(path) / 'train'}")
    try:
        return ImageFolderSafe(str(root), skip_bad_images=getattr(args, "skip_bad_images", False))
    except FileNotFoundError as e:
        die(f"no images in {root}: {e}. Expected one sub-folder per class with image files inside")


def build_eval_splits(args):
    """(train, test), the test labels numbered by the train split's class names (a val/ with fewer classes)."""
    train, test = build_dataset(args, train=True), build_dataset(args, train=False)
    if isinstance(getattr(test, "dataset", test), ImageFolderSafe):     # (a --holdout Subset's own folder)
        getattr(test, "dataset", test).substitute = False               # evaluated: unreadable images left out
    train_classes, test_classes = getattr(train, "classes", None), getattr(test, "classes", None)
    if train_classes is not None and len(train_classes) == 1:      # e.g. an unlabelled layout, train/images/*.jpg
        die(f"the train split has one class ({train_classes[0]}): any classifier scores 100%; give one sub-folder per class")
    if train_classes is None or test_classes is None or list(train_classes) == list(test_classes):
        return train, test
    unknown = [c for c in test_classes if c not in train_classes]
    if unknown:
        die(f"the test split has classes that the train split does not have: {', '.join(unknown[:10])}"
            f"{' ...' * (len(unknown) > 10)}; a classifier cannot predict them (give both splits the same class folders)")
    if not isinstance(test, tv_datasets.DatasetFolder):
        die(f"the train and test splits name their classes differently ({len(train_classes)} vs {len(test_classes)})")
    index = [list(train_classes).index(name) for name in test_classes]    # test label -> train label
    test.samples = test.imgs = [(path, index[label]) for path, label in test.samples]
    test.targets = [label for _, label in test.samples]
    test.classes, test.class_to_idx = list(train_classes), dict(train.class_to_idx)
    log(f"the test split's {len(test_classes)} classes are numbered as the train split's {len(train_classes)}, by name")
    return train, test


# ======== B2. Processes, devices, loaders and preemption signals ==================================
def init_distributed(device="auto"):
    """The device; under torchrun (RANK set) a process group, of one process too (NCCL on GPUs, else gloo)."""
    local_rank, world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        die(f"--device {device} is not a device of these scripts; give auto, cpu, cuda or cuda:N")
    if world_size > 1 and re.fullmatch(r"cuda:\d+", device):
        die(f"--device {device} would put all {world_size} processes of this torchrun job on one GPU; "
            f"use --device cuda (or auto): each process takes the GPU of its LOCAL_RANK")
    auto, gpus = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu", torch.cuda.device_count()
    name, device = device, torch.device({"auto": auto, "cuda": f"cuda:{local_rank}"}.get(device, device))
    if device.type == "cuda":
        if device.index >= gpus:       # no GPU, a cuda:N past the last, or more torchrun processes than GPUs
            die(f"--device {name} needs GPU {device.index}, but this process sees {gpus} GPUs; give another --device")
        torch.cuda.set_device(device)
        # the authors' cuDNN autotuning, and TF32 float32 matmuls as in their torch (1.7-1.8)
        torch.backends.cudnn.benchmark = torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if (world_size > 1 or "RANK" in os.environ) and not dist.is_initialized():
        end_with_launcher()
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None,
                                timeout=PROCESS_GROUP_TIMEOUT)
    return device


# The others wait in a collective while rank 0 alone writes a checkpoint (1 GB to a slow disk) or
# votes a large k-NN: NCCL's default 10 minutes would end the job; a true hang is ended later.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=60)


def end_with_launcher():
    """Linux: a torchrun worker gets SIGTERM when its launcher dies, even by SIGKILL (it would run
    on alone): a preemption, so the step finishes and the checkpoint is written."""
    if sys.platform.startswith("linux") and "TORCHELASTIC_RUN_ID" in os.environ:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # 1: PR_SET_PDEATHSIG


def all_gather_objects(obj):
    """Collective: `obj` from every process, in rank order ([obj] without a process group)."""
    out = [obj] * get_world_size()
    if is_dist():
        dist.all_gather_object(out, obj)
    return out


def choose_precision(device):
    """What `--precision auto` runs on `device`, and why: native bf16 (GPU or CPU), else on a GPU fp16 with a
    grad scaler (as the authors train), else fp32 (emulated bf16: a ViT-S/16 step ~25x slower)."""
    if device.type == "cuda":
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:                        # an older torch: from the compute capability
            native = torch.cuda.get_device_capability(device) >= (8, 0)
        return ("bf16", "this GPU computes in bf16 natively") if native else (
            "fp16", "this GPU has no native bf16: fp16 with a grad scaler, as the authors train")
    if device.type != "cpu":
        return "fp32", f"no mixed-precision rule for {device.type} devices"
    cpu = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    capability = torch.backends.cpu.get_cpu_capability()
    if cpu.get("avx512_bf16") or cpu.get("amx_bf16"):
        return "bf16", f"this CPU has native bf16 (AVX512-BF16 or AMX-BF16; torch CPU capability {capability})"
    return "fp32", (f"this CPU has no native bf16 (torch CPU capability {capability}, no AVX512-BF16 or "
                    f"AMX-BF16): emulated bf16 would make a ViT-S/16 step about 25x slower than fp32")


def resolve_precision(args, device):
    """`--precision auto` -> `choose_precision`'s pick, logged with its reason (an explicit bf16 it would not pick: a warning)."""
    choice, reason = choose_precision(device)
    args.precision_auto = args.precision == "auto"
    if args.precision_auto:
        args.precision = choice
        log(f"precision: {choice} (--precision auto: {reason})")
    elif args.precision == "bf16" and device.type == "cpu" and choice != "bf16":
        log(f"warning: --precision bf16: {reason}; --precision auto picks fp32 here")


def fix_random_seeds(seed):
    """Same seed in every process (DDP also broadcasts the weights of rank 0)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class ResumableSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler starting an epoch at a given batch (a mid-epoch resume); (index, epoch) pairs with `with_epoch`."""

    def __init__(self, dataset, batch_size, shuffle, seed, drop_last, with_epoch=False):
        super().__init__(dataset, num_replicas=get_world_size(), rank=get_rank(), shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size, self.start_batch, self.with_epoch = batch_size, 0, with_epoch

    def set_epoch(self, epoch, start_batch=0):
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self):
        indices = itertools.islice(super().__iter__(), self.start_batch * self.batch_size, None)
        return ((i, self.epoch) for i in indices) if self.with_epoch else indices

    def __len__(self):
        return max(super().__len__() - self.start_batch * self.batch_size, 0)

    def distinct_samples(self):
        """This process's samples of an epoch that are not padding (the repeats come last, at r + k n >= len)."""
        return min(self.num_samples, len(range(self.rank, len(self.dataset), self.num_replicas)))


def make_loader(dataset, batch_size, num_workers, train=True, seed=0):
    """DataLoader ordered by (seed, epoch) only; its own generator leaves the global RNG to the run (resumes exact)."""
    if train and len(dataset) < batch_size * get_world_size():
        die(f"the dataset has {len(dataset)} images, fewer than one batch "
            f"({batch_size} per process x {get_world_size()} processes); lower --batch_size_per_gpu")
    sampler = ResumableSampler(dataset, batch_size, shuffle=train, seed=seed, drop_last=train,
                               with_epoch=isinstance(dataset, SeededDataset))
    loader = PreemptibleLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                               collate_fn=torch.utils.data.default_convert if getattr(dataset, "batched", False) else None,
                               pin_memory=torch.cuda.is_initialized(), drop_last=train,   # a run on a GPU
                               persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(seed),
                               worker_init_fn=ignore_preemption_signals)
    return loader, sampler


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptibleLoader(torch.utils.data.DataLoader):
    """SLURM and torchrun signal loader workers too, whose death would stop training before the
    checkpoint: workers start with the signals blocked, then ignore them (`ignore_preemption_signals`)."""
    def __iter__(self):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def ignore_preemption_signals(_worker_id):
    """In a loader worker, born with the preemption signals blocked: ignore them, then unblock."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)


def install_preemption_handler():
    """On SIGTERM or SIGUSR1 only set a flag: the step finishes, a checkpoint is written, exit 0
    (or, past the grace period, `end_unless_checkpointed`)."""
    def handler(signum, frame):
        global _preemption_signal
        if _preemption_signal is None:       # the grace period starts: a checkpoint written
            _checkpoint_reached.clear()       # from now on ends it
            threading.Thread(target=end_unless_checkpointed, daemon=True).start()
        _preemption_signal = signal.Signals(signum).name
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, handler)


def grace_seconds(text):
    """PREEMPTION_GRACE_SECONDS: a finite number of seconds above 0, else one line."""
    with contextlib.suppress(ValueError):
        if 0 < float(text) < math.inf:
            return float(text)
    die(f"PREEMPTION_GRACE_SECONDS={text} is not a finite number of seconds above 0; set it to "
        f"e.g. 300 (the default), or unset it")


# A step blocked on a read (a FIFO, a hung mount) must not outlast a preemption signal silently
# (`timeout` sends no SIGKILL; SLURM's comes after KillWait, 30 s by default). 300 s: more than a
# step or an epoch's validation takes, so that a run that is merely slow still checkpoints.
PREEMPTION_GRACE_S = grace_seconds(os.environ.get("PREEMPTION_GRACE_SECONDS", "300"))
_checkpoint_reached = threading.Event()     # set as a preempted run writes or awaits its checkpoint


def end_unless_checkpointed():
    """After a preemption signal, in a thread: end the process, in one line, if the step has not
    reached the checkpoint within the grace period (the main thread may be blocked where no signal
    reaches)."""
    if _checkpoint_reached.wait(PREEMPTION_GRACE_S):
        return
    where = last_checkpoint()
    message = (f"error: received {_preemption_signal}, but the step did not reach its checkpoint "
               f"within {PREEMPTION_GRACE_S:g} s (a read that never returns?){where}"
               + ("; run the same command again to resume" if ": " in where else ""))
    report_to_torchrun(message)
    bar = bool(getattr(tqdm, "_instances", ()))          # a progress bar's line is open: end it
    print("\n" * bar + message, file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():    # loader workers ignore SIGTERM
        child.kill()
    os._exit(1)


def end_loader_workers():
    """At exit, SIGKILL loader workers still alive: they ignore multiprocessing's SIGTERM, which would wait forever."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


# ======== B3. Checkpoints, resume, and one run per --output_dir ===================================
def rng_state():
    """This process's RNG states (of CUDA's, its own GPU's), in types `weights_only` loading accepts."""
    np_state, py_state = np.random.get_state(), random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if torch.cuda.is_initialized() else [],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
            "python": [py_state[0], list(py_state[1]), py_state[2]]}


def set_rng_state(state):
    """Restore what `rng_state` saved; a list of CUDA states (one per visible GPU) gives this GPU's."""
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, (list, tuple)):
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None and len(cuda) and torch.cuda.is_initialized():   # a run on the CPU leaves the GPUs alone
        torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))


def save_checkpoint(state, path):
    """Write atomically (temporary file, fsync, rename): a crash leaves the old or the new file."""
    path = Path(path)
    _checkpoint_reached.set()           # a preempted step's grace period ends here
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch's writer wraps a full disk's OSError in a RuntimeError
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), None)
        if cause is None:
            raise
        kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
        die(f"cannot write {path}: {cause.strerror or cause} ({kept}); free space or fix the folder, then "
            f"run the same command again")
    finally:
        tmp.unlink(missing_ok=True)  # only left over when the write failed


def remove_stale_temporaries(output_dir):
    """Delete the temporary files that a killed `save_checkpoint` left (not those of a live process)."""
    for tmp in Path(output_dir).glob(".*.pth.tmp*"):
        try:       # the writer's pid is the name's tail; alive (PermissionError: another user's): a save in progress
            os.kill(int(tmp.name.rsplit(".tmp", 1)[1]), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
            log(f"removed {tmp}, left by an interrupted checkpoint write")
        except (ValueError, PermissionError):
            pass


def load_checkpoint(path, what="checkpoint", remedy=""):
    try:
        with open(path, "rb") as f:  # torch.save writes a zip archive ("PK"); before torch 1.6, a pickle
            start = f.read(2)
        if start in (b"PK", b"\x80\x02"):  # else e.g. an image, where torch would advise weights_only=False
            check_archive(path, what, remedy)
            with torch.serialization.safe_globals([argparse.Namespace]):  # the authors' args: a Namespace
                return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # OSError: the file system's reason (a folder, no permission); else torch's (a cut-off write?)
        said = str(e).split("WeightsUnpickler error: ")        # weights_only refused an object
        if isinstance(e, pickle.UnpicklingError) and len(said) > 1:   # never advise loading it
            refused = said[1].split(" was not an allowed")[0].splitlines()[0]
            die(f"{what} {path} holds more than tensors and plain values ({refused}): refused "
                f"unread, as loading it could run code; give a file written by these "
                f"scripts{remedy}")
        die(f"{what} {path} cannot be read{'' if isinstance(e, OSError) else ' (truncated?)'}: "
            f"{(str(e).strip() or type(e).__name__).splitlines()[0]}{remedy}")
    die(f"{what} {path} is {f'not a PyTorch file (it starts {start!r})' if start else 'empty (0 bytes)'}{remedy}")


def check_archive(path, what, remedy):
    """torch.load does not check a zip archive's CRCs: flipped bits in a tensor load silently."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError):  # not a whole archive: torch.load names the reason
        return
    if damaged:
        die(f"{what} {path} is damaged: the checksum of its entry {damaged} fails (bits changed on "
            f"the disk or in a copy){remedy}")


def load_state_dict_strict(module, state_dict, what="model"):
    """Strict loading with one readable line instead of a wall of key names from torch."""
    own = module.state_dict()
    missing, unexpected = [k for k in own if k not in state_dict], [k for k in state_dict if k not in own]
    bad_shape = [f"{k}: {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}" for k in own
                 if k in state_dict and state_dict[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        def head(keys):
            return ", ".join(keys[:5]) + (f" ... (+{len(keys) - 5})" if len(keys) > 5 else "")
        die(f"{what} does not match the checkpoint (another --arch, --patch_size or head size?). "
            f"missing: [{head(missing)}] unexpected: [{head(unexpected)}] shape: [{head(bad_shape)}]")
    module.load_state_dict(state_dict, strict=True)


def restore(checkpoint, **objects):
    """Load every named object from `checkpoint` (modules strictly; a grad scaler follows this run's precision)."""
    for name, obj in objects.items():
        if name not in checkpoint:
            die(f"checkpoint has no {name!r} entry (written by another script?)")
        if isinstance(obj, nn.Module):
            load_state_dict_strict(unwrap(obj), checkpoint[name], what=name)
        elif isinstance(obj, torch.amp.GradScaler) and obj.is_enabled() != bool(checkpoint[name]):
            log(f"precision: the checkpoint was trained in {checkpoint.get('args', {}).get('precision', '?')} " +
                (f"without a grad scaler; this run trains in fp16, whose grad scaler starts at scale {obj.get_scale():g}"
                 if obj.is_enabled() else f"with a grad scaler (scale {checkpoint[name].get('scale', float('nan')):g}); "
                 f"this run needs none and drops it"))
        else:
            obj.load_state_dict(checkpoint[name])


# Arguments a resumed run may change: where and how it runs, not what it learns (and --epochs, not below those done).
RUN_ONLY_ARGS = {"output_dir", "device", "num_workers", "data_path", "skip_bad_images", "saveckp_freq",
                 "save_every_iters", "precision", "precision_auto", "val_subset", "allow_changed_args"}


def check_start_args(args, stride=None):
    """Refused before any data or model work: a warm-up longer than the run; crop flags (tokens: --arch's, or `stride` px)."""
    if args.warmup_epochs > args.epochs:
        die(f"--warmup_epochs {args.warmup_epochs} is longer than --epochs {args.epochs}; lower it")
    check_scale_range("--global_crops_scale", args.global_crops_scale)
    sizes, stride = {"--global_crop_size": args.global_crop_size}, stride or token_stride(args.arch, args.patch_size)
    if args.local_crops_number:
        check_scale_range("--local_crops_scale", args.local_crops_scale)
        sizes["--local_crop_size"] = args.local_crop_size
    for flag, size in sizes.items():
        if size % stride:
            die(f"{flag} {size} is not a multiple of the {args.arch} token stride ({stride} px); "
                f"use e.g. {max(stride, size // stride * stride)}")
    if sizes.get("--local_crop_size", 0) > args.global_crop_size:
        die(f"--local_crop_size {args.local_crop_size} is larger than --global_crop_size {args.global_crop_size}: "
            f"the local crops are the small views; swap them, or give local crops <= {args.global_crop_size} px")


def check_scale_range(flag, scale):
    """An area range (min, max) of RandomResizedCrop: reversed, torch fails only in the first batch."""
    if scale[0] > scale[1]:
        die(f"{flag} {scale[0]} {scale[1]} is reversed: give the smallest area first, e.g. {flag} {scale[1]} {scale[0]}")


def checkpoint_to_resume(args, method):
    """--output_dir's checkpoint.pth, written by `method` with the same arguments, or None."""
    path, ckpt = Path(args.output_dir) / "checkpoint.pth", None
    args.world_size = get_world_size()      # recorded: with --batch_size_per_gpu, the total batch and so the peak lr
    vit = ARCHS[args.arch]["family"] == "vit"      # a flag that --arch ignores would be in args.json as if it were used
    if (args.window_size != 7 or args.fit_window) if vit else args.patch_size != 16:
        die(f"{args.arch} would ignore " + ("--window_size and --fit_window (Swin flags): drop them" if vit else
                                            "--patch_size (a ViT flag; a Swin's patch is set by --arch): drop it"))
    if (path.parent / "linear_checkpoint.pth").exists():        # its args.json and log.txt are not ours to overwrite
        die(f"--output_dir {path.parent} holds a linear probe (linear_checkpoint.pth), whose args.json and log.txt "
            f"{method}.py would overwrite; give {method}.py its own --output_dir (default runs/{method})")
    if path.exists():
        ckpt = load_checkpoint(path)
        written_by = ckpt.get("method") if isinstance(ckpt, dict) else None
        if written_by != method:
            die(f"{path} was written by {f'{written_by}.py' if written_by else 'another program'}, not {method}.py: "
                f"give {method}.py its own --output_dir (default runs/{method})")
        check_resumed_args(ckpt, args, path)
    ckpt = agree_on_resume(path, ckpt)
    if is_main_process():
        remove_stale_temporaries(args.output_dir)
    return ckpt


def agree_on_resume(path, ckpt):
    """Collective: rank 0 decides whether the job resumes; a process that cannot read the checkpoint
    rank 0 resumes from (an --output_dir not shared between nodes) stops the job in one line."""
    found = (ckpt.get("epoch"), ckpt.get("step")) if ckpt is not None else None
    views = all_gather_objects((found, socket.gethostname()))
    if views[0][0] is None:
        return None                             # a fresh start: another node's old file is not read
    for rank, (theirs, host) in enumerate(views):
        if theirs != views[0][0]:
            saw = f"it sees epoch {theirs[0]}, step {theirs[1]}" if theirs else "it finds no file"
            die(f"process {rank} (host {host}) cannot read the {path} that process 0 resumes from "
                f"(epoch {views[0][0][0]}, step {views[0][0][1]}; {saw}): give every node one "
                f"--output_dir on a shared file system (an absolute path)")
    return ckpt


def check_resumed_args(ckpt, args, path):
    """Refuse, in one line naming each, changed arguments that change what is trained."""
    old, done, step = ckpt.get("args", {}), ckpt.get("epoch", 0), ckpt.get("step", 0)
    changed = changed_args(old, args)
    if changed and not args.allow_changed_args:
        die(f"{path} was trained with other arguments: {', '.join(changed)}; run with the checkpoint's values, another "
            f"--output_dir, or --allow_changed_args")
    if changed:
        log(f"warning: resuming with changed arguments (--allow_changed_args): {', '.join(changed)}")
    if done + bool(step) > args.epochs:
        die(f"{path} has already trained {done} epochs{f' and {step} steps' if step else ''}, more than "
            f"--epochs {args.epochs}")
    if "epochs" in old and old["epochs"] != args.epochs:
        log(f"--epochs changed from {old['epochs']} to {args.epochs}: the schedules follow the new length")


def changed_args(recorded, args, ignored=RUN_ONLY_ARGS | {"epochs"}):
    """Each argument that differs from the `recorded` ones, as `--k old (now new)` (the processes as processes)."""
    old, new = (json.loads(json.dumps(a, default=str)) for a in (recorded, vars(args)))  # tuples as lists
    return [f"{old[k]} process{'es' * (old[k] != 1)} (now {new[k]}: another total batch, and peak lr)"
            if k == "world_size" else f"--{k} {old[k]} (now {new[k]})"
            for k in sorted(old.keys() & new.keys()) if k not in ignored and old[k] != new[k]]


def dataset_record(dataset):
    """A training set's image count and fingerprint of class names, paths and labels (--data_path may move)."""
    if hasattr(dataset, "data_record"):
        return dataset.data_record
    indices, base = range(len(dataset)), dataset
    while isinstance(base, (torch.utils.data.Subset, SeededDataset)):
        if isinstance(base, SeededDataset):
            base = base.base
        else:
            indices, base = [base.indices[i] for i in indices], base.dataset
    if hasattr(base, "samples"):
        entries = [f"{os.path.relpath(base.samples[i][0], base.root)}\t{base.samples[i][1]}" for i in indices]
    else:
        labels = next((v for v in (getattr(base, "targets", None), getattr(base, "labels", None)) if v is not None), None)
        entries = [] if labels is None else [str(int(labels[i])) for i in indices]
    text = "\n".join([type(base).__name__, *map(str, getattr(base, "classes", None) or []), *entries])
    dataset.data_record = {"images": len(dataset), "fingerprint": hashlib.sha256(text.encode()).hexdigest()[:16]}
    return dataset.data_record


def resume_position(ckpt, dataset, args):
    """(epoch, step) to continue from; another dataset is refused (allowed: the epoch restarts)."""
    epoch, step = ckpt["epoch"], ckpt["step"]
    old, new = ckpt.get("dataset"), dataset_record(dataset)
    if old is None or old == new:
        return epoch, step
    change = (f"{old['images']} images, now {new['images']}" if old["images"] != new["images"]
              else f"{new['images']} images as now, but other files or labels")
    if not args.allow_changed_args:
        die(f"{Path(args.output_dir) / 'checkpoint.pth'} was trained on another dataset ({change}); resume with the same "
            f"data, or use another --output_dir, or --allow_changed_args to go on with this one from the start of epoch {epoch}")
    log(f"warning: resuming on another dataset ({change}; --allow_changed_args): epoch {epoch} starts again at "
        f"its first batch" + (f" (the checkpoint stopped after step {step})" if step else ""))
    return epoch, 0


LOCK_FILE = ".lock"
_output_lock = None     # this process's claim on its --output_dir (`claim_output_dir`)


def make_folder(path, flag):
    """Create the folder that `flag` names (one line where it cannot be); whether it was created."""
    if not str(path).strip():                            # e.g. an unset shell variable: never the current folder
        die(f"{flag} is empty; give a folder name")
    path = Path(path)
    try:
        existed = path.is_dir()
        if path.exists() and not path.is_dir():          # asked again: another process may have just made it
            die(f"{flag} {path} is a file, not a folder; give a folder name")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        die(f"cannot create {flag} {path}: {e.strerror or e}")
    return not existed


def claim_output_dir(output_dir, checkpoint="checkpoint.pth"):
    """Collective: make --output_dir this run's own before anything is written. Rank 0 holds a `flock` on
    its `.lock` until it exits; the kernel (or NFS server) frees it however the process dies, so a killed
    run's lock is simply taken over. A filesystem without locks (Lustre without `flock`) gets a warning."""
    global _output_lock
    if _output_lock is not None and _output_lock["dir"] != str(output_dir):
        release_output_dir()                # one run per process (main() called again in process)
    problem, claim = None, {"dir": str(output_dir), "checkpoint": checkpoint, "pid": os.getpid(), "fd": None}
    if is_main_process():
        try:
            claim["created"] = make_folder(output_dir, "--output_dir")
            claim["fd"] = take_lock(Path(output_dir) / LOCK_FILE, output_dir)
        except SystemExit as e:
            problem = str(e.code)
    problem = all_gather_objects(problem)[0]
    if problem:
        raise SystemExit(problem)
    if _output_lock is None:
        atexit.register(release_output_dir)
    _output_lock = claim


def take_lock(lock, output_dir):
    """A file descriptor holding the exclusive lock on `lock` (None without file locks), or stop naming the holder."""
    if _output_lock is not None and _output_lock.get("fd") is not None and _output_lock["dir"] == str(output_dir):
        return _output_lock["fd"]                                      # main() run twice in one process
    while True:
        fd = None
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            holder = {}                                                 # junk: nobody to name
            with contextlib.suppress(ValueError):
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")     # who wrote it
            holder = holder if isinstance(holder, dict) else {}
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.exists(lock) and os.stat(lock).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
                break
            os.close(fd)              # the previous holder removed the file meanwhile: lock the new one
        except OSError as e:
            if fd is not None:
                os.close(fd)
            if fd is None or e.errno not in (errno.EAGAIN, errno.EACCES, errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                die(f"cannot write in --output_dir {output_dir}: {e.strerror or e}")
            if e.errno in (errno.EAGAIN, errno.EACCES):
                who = f"pid {holder['pid']} on host {holder['host']}" if holder.get("pid") else "a run starting now"
                die(f"--output_dir {output_dir} is in use by another run ({who}; lock {lock}): wait for it to end "
                    f"or choose another --output_dir")
            log(f"warning: --output_dir {output_dir} is on a filesystem without file locks ({e.strerror}): nothing "
                f"stops a second run from using the same folder")
            return None
    if holder.get("pid"):
        log(f"removed the stale lock {lock} of pid {holder['pid']} on {holder.get('host')}: that run has ended")
    return fd


def release_output_dir():
    """Remove this process's lock (and the folder, if this run created it and wrote nothing)."""
    global _output_lock
    claim, _output_lock = _output_lock, None
    if not claim or claim["pid"] != os.getpid():     # a forked child inherits the claim
        return
    if claim["fd"] is not None:
        with contextlib.suppress(OSError):
            os.unlink(Path(claim["dir"]) / LOCK_FILE)     # while still holding it: no one locks a removed file
        os.close(claim["fd"])
    if claim.get("created"):
        with contextlib.suppress(OSError):
            Path(claim["dir"]).rmdir()      # only if empty


# ======== B4. Every way out of a script in one line ===============================================
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")   # gloo: a peer process has exited


def run_script(main, parser, argv=None):
    """Every script's entry point: `main(args)` with every way out in one line (also in torchrun's error file),
    then --output_dir released and the process group shut down (gloo's threads can abort an exiting process)."""
    atexit.register(end_loader_workers)   # after multiprocessing's exit handler, so it runs before it
    args = parser.parse_args(argv)
    try:
        main(args)
    except KeyboardInterrupt:
        close_progress_bars()
        where = last_checkpoint()
        message = f"interrupted (Ctrl-C){where}" + ("; run the same command again to resume" if ": " in where else "")
        report_to_torchrun(message)
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(130) from None    # 128 + SIGINT, the shell's code for Ctrl-C
    except SystemExit as e:
        if isinstance(e.code, str):       # die(): a user error
            report_to_torchrun(e.code)
        raise
    except (RuntimeError, OSError, EOFError, MemoryError) as e:  # a worker killed mid-batch: OSError, EOFError
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # torch's handler would raise again while this process exits
        for _ in range(40 if isinstance(e, (OSError, EOFError)) else 1):   # a pipe can break before the dead
            try:                                                            # worker is reaped: wait a little
                torch._C._error_if_any_worker_fails()   # "DataLoader worker (pid N) is killed by signal", if one is
                time.sleep(0.05)
            except RuntimeError as e_worker:
                e = e_worker
                break
        lines, where = str(e).splitlines(), last_checkpoint()
        worker = next((line.split("DataLoader worker ", 1)[1].split(". ")[0].strip(" .") for line in lines
                       if "DataLoader worker (pid" in line), "")
        peer = next((line for line in lines if any(s in line for s in PEER_LOST)), "") if is_dist() else ""
        said = [s.split("Error: ")[-1] for line in lines for s in line.split(". ")]   # torch's, CUDA's, numpy's words
        memory = next((s for s in said if "allocate" in s), next((s for s in said if "out of memory" in s), ""))
        if isinstance(e, BadImageError):
            message = "error: " + str(e).strip().splitlines()[-1].split("BadImageError: ")[-1]
        elif worker:      # the steps since the last checkpoint are lost
            message = (f"error: a data loader worker {worker} (most likely the kernel's out-of-memory killer; its own "
                       f"error, if any, is above){where}; run the same command with fewer --num_workers (now "
                       f"{getattr(args, 'num_workers', '?')}){' to resume' if ': ' in where else ''}")
        elif peer:
            message = (f"error: process {get_rank()} stops because another process of this run has stopped (its error "
                       f"is above); torch: {peer.split('] ', 1)[-1].split('. ')[0].strip()}")
        elif memory or isinstance(e, MemoryError):    # numpy's MemoryError may say nothing
            message = (f"error: out of memory ({memory or type(e).__name__}){where}; lower --batch_size_per_gpu (now "
                       f"{getattr(args, 'batch_size_per_gpu', '?')}) or the crop and image sizes")
        else:
            raise
        close_progress_bars(end_line=bool(worker))       # the error starts a line
        report_to_torchrun(message)
        raise SystemExit(message) from None
    finally:
        release_output_dir()
    if is_dist():
        dist.destroy_process_group()


def last_checkpoint():
    """Where an interrupted run's checkpoint is: '' for a script without one, else since when it exists."""
    path = _output_lock and _output_lock["checkpoint"] and Path(_output_lock["dir"]) / _output_lock["checkpoint"]
    if not path or not path.exists():
        return f" before the first checkpoint ({path}) was written" if path else ""
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    return f": the last checkpoint is {path} (written {written})"


def report_to_torchrun(message):
    """`message` in torchrun's error file, as `elastic`'s `record` writes one (it skips SystemExit)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": message,
                                   "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}, f)


def close_progress_bars(end_line=False):
    """Close open progress bars (one left open is redrawn below the last message at exit); `end_line`: also
    end the line of a bar whose drawing a signal cut short (torch's SIGCHLD handler raises anywhere)."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    print(end="\n" if end_line else "", file=sys.stderr, flush=True)


# ======== B5. Logging and the argument groups shared by the scripts ===============================
def log(*message):
    if is_main_process():
        print(*message, flush=True)


def append_log(output_dir, record):
    if is_main_process():
        with open(Path(output_dir) / "log.txt", "a") as f:
            f.write(json.dumps(record) + "\n")


def save_args(args):
    if is_main_process():
        with open(Path(args.output_dir) / "args.json", "w") as f:
            json.dump(vars(args), f, indent=2)


def bool_flag(s):
    if s.lower() not in ("1", "true", "on", "yes", "0", "false", "off", "no"):
        raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")
    return s.lower() in ("1", "true", "on", "yes")


def ranged(kind, low=None, high=None, low_open=False):
    """An argparse type: a number of `kind` in [low, high] (low excluded with low_open), else one line."""
    bounds = f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf)' if high is None else f'{high}]'}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high) or not math.isfinite(value):  # inf, NaN
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected a value in {bounds}")
        problem = number_problem(kind, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value
    parse.__name__ = f"{kind.__name__} in {bounds}"
    return parse


def number_problem(kind, value):
    """What the libraries cannot hold, whatever the flag's range: an integer past int32 (torch's and
    numpy's sizes, seeds, counts), a float that float32 (the networks') rounds to 0 or to inf."""
    if kind is int and value > INT32_MAX:
        return f"is too large: expected at most {INT32_MAX} (a 32-bit integer)"
    if kind is float and value and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
        return (f"is out of float32's range, where it would be {'inf' if abs(value) > 1 else '0'}: "
                f"expected a size from {FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g}")
    return ""


INT32_MAX = 2 ** 31 - 1
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
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
                   help="ViT patch size: 16 or 8 (better, much slower), or a divisor of small crops (4 at 32 px)")
    g.add_argument("--window_size", default=7, type=POSITIVE_INT, help="Swin window size (7, or 14)")
    g.add_argument("--fit_window", default=False, type=bool_flag,
                   help="small images: per Swin stage the largest window <= --window_size that tiles every crop's grid")
    g.add_argument("--drop_path_rate", default=drop_path_rate, type=FRACTION, help="stochastic depth of the student")
    return g


def add_multicrop_args(parser, global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4), local_crops_number=8):
    g = parser.add_argument_group("multi-crop augmentation")
    g.add_argument("--global_crops_scale", type=AREA_FRACTION, nargs=2, default=global_crops_scale,
                   help="area range of the 2 global crops (DINO: (0.14, 1) without local crops)")
    g.add_argument("--local_crops_number", type=COUNT, default=local_crops_number,
                   help="number of small local crops (0 disables multi-crop)")
    g.add_argument("--local_crops_scale", type=AREA_FRACTION, nargs=2, default=local_crops_scale,
                   help="area range of the local crops")
    g.add_argument("--global_crop_size", type=POSITIVE_INT, default=224, help="pixels")
    g.add_argument("--local_crop_size", type=POSITIVE_INT, default=96, help="pixels")
    g.add_argument("--batched_crops", default=False, type=bool_flag,
                   help="build each batch's crops at once with tensor operations (images of one size): the PIL "
                        "path's draws, its pixels within a level on average; faster on small images")
    return g


def add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="folder", choices=DATASETS,
                   help="folder = an ImageFolder at --data_path; synthetic = procedural shapes, no files")
    g.add_argument("--data_path", default=None, type=str, help="image folder, or a dataset's local root")
    g.add_argument("--synthetic_images", default=2000, type=POSITIVE_INT, help="size of the synthetic train split")
    g.add_argument("--synthetic_image_size", default=64, type=POSITIVE_INT, help="side of synthetic images (pixels)")
    g.add_argument("--synthetic_seed", default=0, type=COUNT, help="which synthetic dataset to draw")
    g.add_argument("--holdout", default=0, type=COUNT,
                   help="a validation split: N train images (the last N; of a folder, sorted by "
                        "class, N drawn with seed 0) are the test split, the others the train "
                        "split (training and the k-NN bank), so settings are chosen without the "
                        "test set")
    g.add_argument("--skip_bad_images", action="store_true", help="skip (log and count) unreadable images, not stop")
    g.add_argument("--num_workers", default=10, type=COUNT, help="data loader processes per GPU/process")
    return g


def add_head_size_args(group):
    """The DINO head's MLP sizes (the authors' 2048 / 256; smaller for tiny CPU backbones)."""
    group.add_argument("--head_hidden_dim", default=2048, type=POSITIVE_INT, help="width of the head's hidden MLP layers")
    group.add_argument("--head_bottleneck_dim", default=256, type=POSITIVE_INT,
                       help="width of the l2-normalised bottleneck before the K-way last layer")


def add_run_args(parser, saveckp_freq=20):
    g = parser.add_argument_group("run")
    g.add_argument("--output_dir", default=f"runs/{Path(parser.prog).stem}", type=str,
                   help="checkpoints and logs; a run resumes from here; one run at a time (.lock)")
    g.add_argument("--allow_changed_args", action="store_true",
                   help="resume although what is trained, or the dataset (then from the epoch's start), changed")
    g.add_argument("--saveckp_freq", default=saveckp_freq, type=COUNT, help="keep a copy every N epochs")
    g.add_argument("--seed", default=0, type=COUNT, help="seeds weights, data order and augmentations")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when present), cpu, cuda, or cuda:N (one process; torchrun: LOCAL_RANK's GPU)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="autocast dtype. auto: bf16 where the GPU or CPU has native bf16, fp16 with a grad scaler "
                        "on older GPUs (as the authors), else fp32; the choice is logged. On CUDA fp32 uses TF32")
    g.add_argument("--save_every_iters", default=0, type=COUNT,
                   help="also write checkpoint.pth every N steps (long epochs; resumes at the next unseen batch)")
    g.add_argument("--max_steps_per_epoch", default=0, type=COUNT, help="stop each epoch after N steps (0: full epoch)")
    return g
