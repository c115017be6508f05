"""Shared infrastructure for the five method files and the evaluation scripts: no method logic lives here.

Sections, top to bottom:
  1. Backbones      timm ViT / Swin with one API: global feature [B, D] and dense grid [B, h, w, D]
  2. Heads          the DINO projection head (used by DINO, EsViT, GLSD and SelfPatch)
  3. Augmentation   DINO's multi-crop, recording every crop's geometry; per-sample seeding
  4. Datasets       image folders, Fashion-MNIST, CIFAR, SVHN and a procedural `synthetic` set
  5. Distributed    torchrun initialisation, samplers, all-reduce helpers
  6. Training       schedules, parameter groups, gradient clipping, EMA teacher, mixed precision
  7. Checkpoints    atomic save, auto-resume, RNG states
  8. Logging        progress bar, JSON log lines, argument groups shared by every script
  9. Evaluation     one loader for any checkpoint (SelfPatch's image token included), shared
                    evaluation arguments, features gathered by dataset index
 10. Correspondence views with known geometry, token matching and its metrics (for
                    extras/eval_correspondence.py and the training scripts' --monitor_correspondence)
"""
import argparse
import atexit
import contextlib
import gzip
import hashlib
import inspect
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageFilter
from timm.layers import Attention as TimmAttention
from timm.layers import Mlp
from timm.models.cait import ClassAttn
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
    # for 28-32 px images: patch 2 and three stages, so a 32 px crop's grids are 16, 8, 4 (swin_pico's
    # patch 4 and four stages leave 1x1)
    "swin_pico3": dict(family="swin", patch_size=2, embed_dim=32, depths=(2, 2, 2), num_heads=(1, 2, 4)),
    "swin_tiny": dict(family="swin", embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin_small": dict(family="swin", embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin_base": dict(family="swin", embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
}


class Attention(TimmAttention):
    """timm's attention, computed as softmax(q k^T / sqrt(d)) v explicitly (timm's unfused path)
    on a CPU under bf16 autocast: there the fused kernel's bf16 backward is slow, and vit_pico's
    attention forward + backward took 9x longer with it than explicitly (torch 2.14, Xeon with AMX;
    `tests/bench.py --recipe quickstart` measures it). Elsewhere timm decides, and setting
    `fused_attn = False` selects the explicit path everywhere, as in timm."""

    @property
    def fused_attn(self):
        return self._fused_attn and not (torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16)

    @fused_attn.setter
    def fused_attn(self, value):
        self._fused_attn = value


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
    """A ViT or Swin from `ARCHS`, built for `img_size` (the global crop: a ViT's position table
    has that crop's grid; smaller crops interpolate from it, as in DINO) and any other input size.

    patch_size: the ViT's (16, 8, or any size that divides the crops, e.g. 4 at 32 px); a Swin's
    patch is part of its `ARCHS` entry (4, or 2 for swin_pico3). window_size: Swin's window, an int
    or one per stage; timm shrinks a stage's window to the stage's grid at `img_size`. ViT keeps
    timm's (= the DINO authors') key names, so released DINO weights load strictly.
    `class_token=False, final_norm=False` gives SelfPatch's backbone. `overrides` replace entries
    of the architecture table (tests use them for tiny models). The arguments are kept in the
    backbone's `build_config`, which checkpoints record so that `load_backbone` can rebuild it.
    """
    config = dict(arch=arch, patch_size=patch_size, window_size=window_size, img_size=img_size,
                  class_token=class_token, final_norm=final_norm, layer_norm_eps=layer_norm_eps, **overrides)
    if arch not in ARCHS:
        die(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg = {**ARCHS[arch], **overrides}
    family = cfg.pop("family")
    norm_layer = partial(nn.LayerNorm, eps=layer_norm_eps)
    if family == "vit":
        if patch_size < 1 or img_size % patch_size:
            die(f"--patch_size {patch_size} does not divide the {img_size} px global crop; choose a divisor "
                f"of the crop size (e.g. 16 or 8 at 224 px, 4 at 32 px)")
        backbone = ViT(img_size=img_size, patch_size=patch_size, mlp_ratio=4, qkv_bias=True,
                       norm_layer=norm_layer, num_classes=0, dynamic_img_size=True,
                       drop_path_rate=drop_path_rate, class_token=class_token,
                       global_pool="token" if class_token else "avg", final_norm=final_norm,
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


def token_stride(arch, patch_size=16):
    """Pixels per token of the final grid: the ViT patch, or Swin's patch x 2 per patch merging."""
    cfg = ARCHS[arch]
    if cfg["family"] == "vit":
        return patch_size
    return cfg.get("patch_size", 4) * 2 ** (len(cfg["depths"]) - 1)


def stage_grids(arch, patch_size, crop_size):
    """Side of the token grid at every stage for a square crop (one entry for a ViT)."""
    cfg = ARCHS[arch]
    if cfg["family"] == "vit":
        return [crop_size // patch_size]
    grids = [crop_size // cfg.get("patch_size", 4)]
    for _ in cfg["depths"][1:]:
        grids.append((grids[-1] + 1) // 2)   # timm's patch merging pads an odd grid
    return grids


def fitted_windows(arch, patch_size, window_size, crop_sizes):
    """Per Swin stage, the largest window <= window_size that tiles the grid of every crop size
    exactly, so that no window is padded. timm pads a grid that the window does not divide, and
    padded tokens take part in attention: with window 7 at 64 px, 92% of the last stage's attended
    positions are padding."""
    windows = []
    for grids in zip(*(stage_grids(arch, patch_size, size) for size in crop_sizes)):
        windows.append(max(w for w in range(1, window_size + 1) if all(g % w == 0 for g in grids)))
    return tuple(windows)


def window_padding(backbone, crop_size):
    """Per Swin stage, the share of the attended positions that are padding for a crop of this size
    (0 = every window holds real tokens only)."""
    shares, grid = [], crop_size // backbone.patch_embed.patch_size[0]
    for i, stage in enumerate(backbone.layers):
        grid = grid if i == 0 else (grid + 1) // 2
        w = stage.blocks[0].window_size[0]
        padded = -(-grid // w) * w            # timm pads the grid up to a multiple of the window
        shares.append(1 - grid ** 2 / padded ** 2)
    return shares


def backbone_from_args(args, drop_path_rate, **kwargs):
    """The backbone a training run's arguments describe (also used to rebuild it for evaluation):
    built for the global crop size; with `--fit_window` Swin's windows tile every crop's grid."""
    window = getattr(args, "window_size", 7)
    global_size = getattr(args, "global_crop_size", None) or getattr(args, "input_size", None) or 224
    if getattr(args, "fit_window", False) and ARCHS[args.arch]["family"] == "swin":
        sizes = [global_size] + ([args.local_crop_size] if getattr(args, "local_crops_number", 0) else [])
        window = fitted_windows(args.arch, args.patch_size, window, sizes)
    return build_backbone(args.arch, args.patch_size, window, drop_path_rate, img_size=global_size, **kwargs)


def resolution_groups(crops):
    """(start, end) of every run of consecutive crops with the same resolution."""
    groups, start = [], 0
    for i in range(1, len(crops) + 1):
        if i == len(crops) or crops[i].shape[-2:] != crops[start].shape[-2:]:
            groups.append((start, i))
            start = i
    return groups


def other_crop_pairs(ncrops):
    """Flat indices into a [2, ncrops] matrix (teacher global crop t, student crop s) of the pairs
    with s != t, in row-major order: what the mask ~eye(2, ncrops) selects. Indexing with them
    leaves the result's size known, where a boolean mask makes the host wait for the GPU."""
    return torch.tensor([t * ncrops + s for t in range(2) for s in range(ncrops) if s != t])


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
    DINO reports this stabilises training (their default for ViT-S).

    Under bf16 autocast the head computes in float32 (TF32 matmuls on CUDA, `use_authors_cuda_settings`).
    The authors' fp16 keeps 11 significant bits, bf16 8, and the teacher temperature (0.04)
    multiplies every error of a logit by 25: a 65,536-way head in bf16 moved the teacher's logits
    by up to 0.06 after the division, fp16 by 0.008, and a float32 last layer alone removed little
    of it, most coming from the MLP (tests/head_precision.py, docs/FIRST_GPU_RUN.md). Under fp16
    (the authors') and in float32 nothing changes."""

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
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
            with torch.autocast(device, enabled=False):
                return self.project(x.float())
        return self.project(x)

    def project(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


# ================================================================================================
# 3. Augmentation with geometry
# ================================================================================================
class RandomGaussianBlur:
    """PIL Gaussian blur with probability p and radius ~ U(sigma), as in DINO (drawn from torch's
    RNG so that per-sample seeding covers it)."""

    def __init__(self, p, sigma=(0.1, 2.0)):
        self.p, self.sigma = p, sigma

    def draw(self):
        """The radius, or None for no blur (the draws `__call__` makes)."""
        if torch.rand(1).item() >= self.p:
            return None
        return self.sigma[0] + (self.sigma[1] - self.sigma[0]) * torch.rand(1).item()

    def __call__(self, img):
        radius = self.draw()
        return img if radius is None else img.filter(ImageFilter.GaussianBlur(radius=radius))


class MultiCropAugmentation:
    """DINO's multi-crop: 2 global crops and N local crops, each returned with its geometry.

    Geometry of a crop = {"box": [x0, y0, w, h] of the crop in the original image, as fractions of
    its width/height; "flip": whether the crop was mirrored; "image_size": [W, H] in pixels}.
    DINO's blur radius, sigma ~ U(0.1, 2.0), is in pixels of a 224 px crop (for local crops too); it is
    scaled by global_crop_size / 224 so that it blurs as much of a small image (at 32 px an unscaled
    sigma of 2 erases a Fashion-MNIST item). At 224 px nothing changes.
    All randomness comes from torch's global RNG, so `SeededDataset` makes it reproducible.
    `batch` builds the same crops for a batch of same-size images at once (`--batched_crops`).
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
        sigma = (0.1 * global_crop_size / 224, 2.0 * global_crop_size / 224)
        self.global1 = transforms.Compose(color + [RandomGaussianBlur(1.0, sigma)] + to_tensor)
        self.global2 = transforms.Compose(color + [RandomGaussianBlur(0.1, sigma),
                                                   transforms.RandomSolarize(128, p=0.2)] + to_tensor)
        self.local = transforms.Compose(color + [RandomGaussianBlur(0.5, sigma)] + to_tensor)

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

    def plan(self):
        """(size, scale, photometric pipeline) of every crop, in the order they are drawn."""
        return ([(self.global_size, self.global_scale, self.global1),
                 (self.global_size, self.global_scale, self.global2)]
                + [(self.local_size, self.local_scale, self.local)] * self.n_local)

    def batch(self, images, seeds):
        """The crops of a batch of same-size images as tensor operations: what `SeededDataset` with
        this augmentation gives for these images and per-sample seeds, already collated.

        images: [B, 3, H, W] uint8; seeds: one torch seed per image (`sample_seed`). Every random
        draw is the PIL path's, in its order, from torch's global generator reseeded per sample
        (`SeededDataset` restores the generator afterwards), so the boxes, flips and all photometric
        parameters are the PIL path's for the same seed. The pixel operations reproduce PIL's,
        mostly exactly, else to a few levels of 255 (PIL's fixed-point arithmetic and per-pass
        rounding): resampling and blur are per-sample matrices (PIL's antialiased bicubic within
        the crop box; its three-pass box blur), colour operations truncate to integers as PIL's
        blends do. Returns (crops, geometry) as `default_collate` would: a list of
        [B, 3, size, size] float tensors and a list of dicts of [B, ...] tensors.
        """
        batch, _, height, width = images.shape
        params = []
        for seed in seeds:
            torch.default_generator.manual_seed(seed)
            params.append([self.draw_crop(height, width, scale, photometric)
                           for _, scale, photometric in self.plan()])
        pixels = images.float()
        mean = torch.tensor(self.global1.transforms[-1].mean).view(1, 3, 1, 1)
        std = torch.tensor(self.global1.transforms[-1].std).view(1, 3, 1, 1)
        crops, geometry = [], []
        for k, (size, _, _) in enumerate(self.plan()):
            p = {name: [sample[k][name] for sample in params] for name in params[0][k]}
            box = torch.tensor(p["box"], dtype=torch.float64)                      # [B, 4]: top, left, h, w
            flip = torch.tensor(p["flip"])
            x = resample_crops(pixels, box, size, flip)
            x = color_jitter(x, p["jitter"])
            x = torch.where(torch.tensor(p["gray"]).view(-1, 1, 1, 1), luma(x).expand_as(x), x)
            x = box_blur(x, p["blur"])
            solarize = torch.tensor(p["solarize"]).view(-1, 1, 1, 1)
            x = torch.where(solarize & (x >= 128), 255 - x, x)
            crops.append((x / 255 - mean) / std)
            top, left, h, w = box.unbind(1)
            geometry.append({"box": torch.stack([left / width, top / height, w / width, h / height], 1).float(),
                             "flip": flip, "image_size": torch.tensor([float(width), float(height)]).repeat(batch, 1)})
        return crops, geometry

    @staticmethod
    def draw_crop(height, width, scale, photometric):
        """One crop's parameters, drawn as `crop_and_flip` and the `photometric` pipeline draw them."""
        top, left, h, w = random_resized_crop_box(height, width, scale)
        crop = dict(box=[top, left, h, w], flip=bool(torch.rand(1).item() < 0.5), jitter=None, gray=False,
                    blur=None, solarize=False)
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
                assert t.threshold == 128, t.threshold
                crop["solarize"] = torch.rand(1).item() < t.p
        return crop


LOG_RATIO = [float(r) for r in torch.log(torch.tensor([3 / 4, 4 / 3]))]   # as torchvision computes it (float32)


def random_resized_crop_box(height, width, scale):
    """torchvision's RandomResizedCrop.get_params (aspect ratio 3/4 to 4/3) for a height x width
    image: the same draws in the same order, so the same box for a seed, without its per-call
    tensor set-up (this runs for every crop of every image)."""
    area = height * width
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(*LOG_RATIO)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,)).item()
            return top, torch.randint(0, width - w + 1, size=(1,)).item(), h, w
    ratio = width / height                       # ten misses: the whole image, cut to the ratio range
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        h, w = height, int(round(height * (4 / 3)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


# The pixel operations of `MultiCropAugmentation.batch`, on float tensors [N, 3, h, w] holding
# integers 0..255 (as PIL's uint8 images) and returning integers again.
def pil_bicubic_weights(start, length, in_size, out_size):
    """[N, out_size, in_size] matrices resampling the pixels [start, start + length) of each row
    to out_size pixels as PIL's bicubic resize of that crop does: the kernel (a = -0.5) widened by
    the scale when shrinking (antialiasing), cut at the crop's edges and normalised."""
    scale = (length / out_size)[:, None, None]                                    # [N, 1, 1]
    support = 2 * scale.clamp(min=1)
    center = (torch.arange(out_size, dtype=torch.float64)[:, None] + 0.5) * scale  # [N, out, 1]
    j = torch.arange(in_size, dtype=torch.float64) - start[:, None, None]          # [N, 1, in]: crop coordinates
    t = ((j - center + 0.5) / scale.clamp(min=1)).abs()
    a = -0.5
    kernel = torch.where(t < 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                         torch.where(t < 2, (((t - 5) * t + 8) * t - 4) * a, torch.zeros_like(t)))
    inside = ((j >= 0) & (j < length[:, None, None]) & (j >= torch.floor(center - support + 0.5))
              & (j < torch.floor(center + support + 0.5)))
    kernel = kernel * inside
    return (kernel / kernel.sum(-1, keepdim=True)).float()


def resample_crops(pixels, box, size, flip):
    """Crop box (top, left, h, w) of each image, resized to size x size as PIL's bicubic resize
    of the crop: two passes, each rounded, horizontal first except where the crop shrinks only
    vertically (where Pillow 13 matches the other order; it also does for some crops shrunk along
    both axes, which then differ by a few levels). Mirrored where `flip`."""
    top, left, h, w = box.unbind(1)
    rows = pil_bicubic_weights(top, h, pixels.shape[2], size)[:, None]            # [N, 1, size, H]
    cols = pil_bicubic_weights(left, w, pixels.shape[3], size)                    # [N, size, W]
    cols = torch.where(flip[:, None, None], cols.flip(1), cols).transpose(1, 2)[:, None]  # [N, 1, W, size]
    out = (rows @ (pixels @ cols).round().clamp(0, 255)).round().clamp(0, 255)
    vertical_first = (h > size) & (w <= size)
    if vertical_first.any():
        rows, pixels, cols = rows[vertical_first], pixels[vertical_first], cols[vertical_first]
        out[vertical_first] = ((rows @ pixels).round().clamp(0, 255) @ cols).round().clamp(0, 255)
    return out


def luma(x):
    """PIL's RGB -> L conversion, (19595 R + 38470 G + 7471 B + 2^15) >> 16, as [N, 1, h, w]
    (exact in float32: every intermediate is an integer below 2^24)."""
    weights = torch.tensor([19595.0, 38470.0, 7471.0]).view(1, 3, 1, 1)
    return torch.floor(((x * weights).sum(1, keepdim=True) + 32768) / 65536)


def blend(degenerate, x, factor):
    """PIL's Image.blend(degenerate, x, factor), which ImageEnhance uses: clipped, then truncated."""
    return torch.floor((degenerate + factor * (x - degenerate)).clamp(0, 255))


def shift_hue(x, shift):
    """torchvision's PIL hue adjustment: to PIL's 8-bit HSV, hue + int8(255 shift) modulo 256,
    back to RGB (PIL's conversions, which truncate hue and saturation to integers)."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    chroma = maxc - minc
    safe = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    hue = torch.where(r == maxc, bc - gc, torch.where(g == maxc, 2 + rc - bc, 4 + gc - rc))
    hue = torch.floor(torch.remainder(hue / 6, 1) * 255)
    sat = torch.floor(chroma / torch.where(maxc > 0, maxc, torch.ones_like(maxc)) * 255)
    grey = chroma == 0
    hue = torch.where(grey, torch.zeros_like(hue), torch.remainder(hue + torch.trunc(shift * 255), 256))
    sector = torch.floor(hue * 6 / 255)
    f, fs, v = hue * 6 / 255 - sector, sat / 255, maxc
    p, q, t = (torch.round(v * (1 - fs)), torch.round(v * (1 - fs * f)), torch.round(v * (1 - fs * (1 - f))))
    sector = sector.long() % 6
    sectors = ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))        # (R, G, B) per sector
    choices = torch.stack([torch.stack(c, 1) for c in sectors])
    out = choices.gather(0, sector[None, :, None].expand(1, -1, 3, -1, -1))[0]
    return torch.where(grey[:, None], x, out)


def adjust_color(x, op, factor):
    """torchvision's brightness (op 0), contrast (1), saturation (2) or hue (3) adjustment of PIL
    images; factor: [N, 1, 1, 1]."""
    if op == 0:
        return blend(torch.zeros_like(x), x, factor)
    if op == 1:
        return blend(torch.floor(luma(x).mean((1, 2, 3), keepdim=True) + 0.5), x, factor)
    if op == 2:
        return blend(luma(x), x, factor)
    return shift_hue(x, factor.view(-1, 1, 1))


def color_jitter(x, jitters):
    """torchvision's ColorJitter on PIL images, per sample: brightness, contrast, saturation, hue
    in that sample's order with its factors; None leaves a sample as it is."""
    apply = torch.tensor([j is not None for j in jitters])
    order = torch.tensor([j[0] if j is not None else [0, 1, 2, 3] for j in jitters])          # [N, 4]
    factors = torch.tensor([j[1] if j is not None else [1.0, 1.0, 1.0, 0.0] for j in jitters])  # [N, 4]
    # saturation and hue leave a grey image (R = G = B) as it is, and the other two keep it grey:
    # skipped there (all of Fashion-MNIST), which changes no pixel
    coloured = (x.amax(1) != x.amin(1)).flatten(1).any(1)
    for position in range(4):
        for op in range(4):
            chosen = apply & (order[:, position] == op) & (coloured if op >= 2 else True)
            if chosen.any():
                x[chosen] = adjust_color(x[chosen], op, factors[chosen, op].view(-1, 1, 1, 1))
    return x


def box_blur_matrices(radii, size):
    """[n, size, size] matrices of PIL's GaussianBlur(radius) along one axis, one per radius:
    three passes of a box of radius r = l + a (PIL's choice of l and a for the variance
    radius^2 / 3 per pass; the edge taps weigh a), the edge pixels repeated."""
    sigma2 = torch.tensor(radii, dtype=torch.float64) ** 2 / 3
    box_len = torch.sqrt(12 * sigma2 + 1)
    l = torch.floor((box_len - 1) / 2)
    r = l + (2 * l + 1) * (l * (l + 1) - 3 * sigma2) / (6 * (sigma2 - (l + 1) ** 2))
    reach = int(r.max()) + 1
    offsets = torch.arange(-reach, reach + 1, dtype=torch.float64)                  # [K]
    whole = torch.floor(r)[:, None]
    weights = torch.where(offsets.abs() <= whole, 1.0, torch.where(offsets.abs() == whole + 1, r[:, None] - whole, 0.0))
    weights = weights / (2 * r[:, None] + 1)                                         # [n, K]
    source = (torch.arange(size)[:, None] + offsets.long()).clamp(0, size - 1)       # [size, K]
    one_pass = torch.zeros(len(radii), size, size, dtype=torch.float64)
    one_pass.scatter_add_(2, source.expand(len(radii), -1, -1), weights[:, None].expand(-1, size, -1))
    return torch.linalg.matrix_power(one_pass, 3).float()


def box_blur(x, radii):
    """PIL's GaussianBlur per sample (radius None: unchanged), both axes, rounded once."""
    blurred = [i for i, r in enumerate(radii) if r is not None]
    if not blurred:
        return x
    m = box_blur_matrices([radii[i] for i in blurred], x.shape[-1])[:, None]      # [n, 1, size, size]
    x = x.clone()
    x[blurred] = (m @ x[blurred] @ m.transpose(-1, -2)).round().clamp(0, 255)
    return x
    size = x.shape[-1]
    m = torch.stack([box_blur_matrix(radii[i], size) for i in blurred])[:, None]     # [n, 1, size, size]
    x = x.clone()
    x[blurred] = (m @ x[blurred] @ m.transpose(-1, -2)).round().clamp(0, 255)
    return x


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

    The epoch travels with the index: a loader from `make_loader` asks for `dataset[(index, epoch)]`,
    because its workers persist across epochs with their own copy of this object, which never sees
    a later `set_epoch`. A plain `dataset[index]` uses the epoch of `set_epoch` (0 by default)."""

    def __init__(self, base, transform, seed=0, batched=False):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0
        self.batched = batched

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        index, epoch = index if isinstance(index, tuple) else (index, self.epoch)
        image, label = self.base[index]
        seed = sample_seed(self.seed, epoch, index)
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

    def __getitems__(self, indices):
        """A batch (the loader asks for one at a time). With `batched`, the transform's `batch`
        builds the batch's crops at once (`MultiCropAugmentation.batch`: the same draws per sample,
        tensor operations on the whole batch) and returns it collated (`make_loader` then skips
        collation); otherwise a list of samples, as the loader would fetch one by one."""
        if not self.batched:
            return [self[i] for i in indices]
        pairs = [i if isinstance(i, tuple) else (i, self.epoch) for i in indices]
        images, labels = zip(*(self.base[i] for i, _ in pairs))
        pixels = [TF.pil_to_tensor(image.convert("RGB")) for image in images]
        if len({p.shape for p in pixels}) > 1:
            die(f"--batched_crops needs images of one size; this batch has sizes "
                f"{sorted({tuple(p.shape[1:]) for p in pixels})}: drop the flag")
        seeds = [sample_seed(self.seed, epoch, index) for index, epoch in pairs]
        in_main_process = torch.utils.data.get_worker_info() is None
        threads = torch.get_num_threads()
        # Thousands of small operations: one thread (a loader worker has one already). Several only
        # add synchronisation, which on a CPU shared with other processes made a batch 4x slower.
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[], enabled=in_main_process):
                crops, geometry = self.transform.batch(torch.stack(pixels), seeds)
        finally:
            torch.set_num_threads(threads)
        return (crops, geometry), torch.tensor(labels)

    def seeded_transform(self, image, seed):
        """Seeds torch, Python and NumPy (timm's transforms use all three), then transforms. Of
        torch, only the CPU generator: torch.manual_seed would also reseed the CUDA ones (and costs
        about 0.5 ms)."""
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        return self.transform(image)


def eval_transform(resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """DINO's evaluation transform: Resize(256, bicubic) -> CenterCrop(224) -> normalise. A crop
    larger than the resized image would be padded with black (CenterCrop pads): refused."""
    if crop > resize:
        die(f"--crop {crop} is larger than --resize {resize}: the center crop would be padded with black; "
            f"use --resize {crop} or more (DINO: --resize 256 --crop 224)")
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
    """Around every script's main(): every way out ends in one line, never a traceback.
    An unreadable image met inside the data loader (possibly in a worker process, whose traceback
    torch prepends) becomes a one-line error that names the file; Ctrl-C says where the last
    checkpoint is. Under torchrun the error line is also written to the worker's error file, so
    that torchrun's closing report ("Root Cause ... traceback :") repeats it instead of a link.
    The --output_dir lock (`claim_output_dir`) is released on every way out. After a successful
    main(), the process group is shut down: left to the interpreter's exit, gloo's threads can
    abort a finished process ("terminate called without an active exception")."""
    try:
        yield
    except BadImageError as e:
        message = "error: " + str(e).strip().splitlines()[-1].split("BadImageError: ")[-1]
        report_to_torchrun(message)
        raise SystemExit(message) from None
    except KeyboardInterrupt:
        close_progress_bars()
        message = interrupted_message()
        report_to_torchrun(message)
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(130) from None    # 128 + SIGINT, the shell's code for Ctrl-C
    except SystemExit as e:
        if isinstance(e.code, str):       # die(): a user error
            report_to_torchrun(e.code)
        raise
    except RuntimeError as e:
        if not (is_dist() and any(s in str(e) for s in PEER_LOST)):
            raise
        # another process stopped (its own error line is above): this one's collective failed
        reason = next(line for line in str(e).splitlines() if any(s in line for s in PEER_LOST))
        message = (f"error: process {get_rank()} stops because another process of this run has stopped (its error "
                   f"is above); torch: {reason.split('] ', 1)[-1].split('. ')[0].strip()}")
        report_to_torchrun(message)
        raise SystemExit(message) from None
    finally:
        release_output_dir()
    if is_dist():
        dist.destroy_process_group()


# How gloo reports a collective whose peer process has exited.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def report_to_torchrun(message):
    """Write `message` to torchrun's error file for this worker (TORCHELASTIC_ERROR_FILE; absent
    outside torchrun). torchrun then ends with its own traceback (a `ChildFailedError` raised in
    torchrun itself, not in the script), whose "Root Cause" block names the failed rank and shows
    this line in its `traceback :` field."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:   # torchrun's format; its report shows "py_callstack", here the error line instead of a traceback
        with open(path, "w") as f:
            json.dump({"message": {"message": message,
                                   "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass   # torchrun's report then shows its generic line; the error line itself was printed


def close_progress_bars():
    """Close the open progress bars before a last message: a bar left open is redrawn when it is
    garbage-collected at exit, after (and below) the message."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def interrupted_message():
    """What Ctrl-C leaves: where the last checkpoint of this run is, if it wrote one."""
    if _output_lock is None or _output_lock["checkpoint"] is None:
        return "interrupted (Ctrl-C)"
    path = Path(_output_lock["dir"]) / _output_lock["checkpoint"]
    if not path.exists():
        return f"interrupted (Ctrl-C) before the first checkpoint ({path}) was written"
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    return f"interrupted (Ctrl-C): the last checkpoint is {path} (written {written}); run the same command again to resume"


class ImageFolderSafe(tv_datasets.ImageFolder):
    """ImageFolder with `load_image`; with `skip_bad_images`, an unreadable file is replaced by the
    next readable one instead of stopping the run (for training). Skipped files are listed in
    `bad_images` (this process) and counted in `skipped`, a counter shared with the loader's worker
    processes. With `substitute = False` (evaluation) the error goes to the caller, which drops the
    sample: a neighbour's image and label would bias the accuracy. A folder whose walk comes back to
    a directory (a symbolic link loop) is refused (`refuse_revisited_folders`)."""

    def __init__(self, root, skip_bad_images=False):
        refuse_revisited_folders(root)
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


def refuse_revisited_folders(root):
    """ImageFolder walks its root following symbolic links, with no guard against a link back up:
    `class/up -> ..` walks the tree again inside itself until the path is too long, multiplying
    the images (a folder of 16 was read as 656). Walk it as ImageFolder does and refuse a folder whose walk reaches
    a directory already seen (a loop, or two links to one folder), naming the link."""
    seen = {}
    for folder, _dirs, _files in os.walk(root, followlinks=True):
        info = os.stat(folder)
        key = (info.st_dev, info.st_ino)
        if key in seen:
            die(f"{folder} leads to {seen[key]}, a folder already read (a symbolic link loop or a second link to "
                f"one folder): its images would be counted again; remove the link from the image folder")
        seen[key] = folder


def skipped_images(dataset, device=None):
    """How many unreadable files the (possibly wrapped) dataset has skipped so far: in this process,
    or, given the `device` of the process group's collectives, in all processes."""
    while hasattr(dataset, "base") or hasattr(dataset, "dataset"):   # SeededDataset, Subset
        dataset = getattr(dataset, "base", None) or dataset.dataset
    count = dataset.skipped.value if hasattr(dataset, "skipped") else 0
    if device is None:
        return count
    return int(all_reduce_sum(torch.tensor([count], device=device)).item())


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


class Holdout(torch.utils.data.Subset):
    """A contiguous part of a labelled dataset that keeps its `classes`."""

    def __init__(self, dataset, start, stop):
        super().__init__(dataset, range(start, stop))
        self.classes = getattr(dataset, "classes", None)


def build_dataset(args, train=True):
    """The dataset named by --dataset (images as PIL, labels as int), for the train or test split;
    with --holdout N, both come from the train split: all but its last N images, and those N.

    folder: --data_path is an ImageFolder root; for the test split, --data_path/val (or /test)."""
    holdout = getattr(args, "holdout", 0)
    if holdout:
        full = named_dataset(args, train=True)
        if not 0 < holdout < len(full):
            die(f"--holdout {holdout} must be between 1 and the {len(full)} train images minus one")
        n = len(full) - holdout
        return Holdout(full, 0, n) if train else Holdout(full, n, len(full))
    return named_dataset(args, train)


def named_dataset(args, train):
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


def match_classes(train, test):
    """The test split with its labels numbered as the train split numbers the same class names.
    ImageFolder numbers the class folders of each split on its own (sorted names): a val/ holding a
    subset of train/'s classes would otherwise get shifted labels and a silently wrong accuracy.
    A test class that the train split does not have is an error naming it."""
    train_classes, test_classes = getattr(train, "classes", None), getattr(test, "classes", None)
    if train_classes is None or test_classes is None or list(train_classes) == list(test_classes):
        return test
    unknown = [c for c in test_classes if c not in train_classes]
    if unknown:
        die(f"the test split has classes that the train split does not have: {', '.join(unknown[:10])}"
            f"{f' ... ({len(unknown)} in all)' if len(unknown) > 10 else ''}; a classifier cannot predict them "
            f"(give both splits the same class folders)")
    if not isinstance(test, tv_datasets.DatasetFolder):
        die(f"the train and test splits name their classes differently ({len(train_classes)} vs {len(test_classes)})")
    index = [list(train_classes).index(name) for name in test_classes]    # test label -> train label
    test.samples = test.imgs = [(path, index[label]) for path, label in test.samples]
    test.targets = [label for _, label in test.samples]
    test.classes, test.class_to_idx = list(train_classes), dict(train.class_to_idx)
    log(f"the test split's classes ({len(test_classes)}) are numbered as in the train split ({len(train_classes)} "
        f"classes), matched by name")
    return test


def build_eval_splits(args):
    """(train, test) datasets for evaluation, the test labels numbered as the train split's
    classes (`match_classes`)."""
    train = build_dataset(args, train=True)
    return train, match_classes(train, build_dataset(args, train=False))


# ================================================================================================
# 5. Distributed
# ================================================================================================
def init_distributed(device="auto"):
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); one process when
    absent. Backend: nccl on GPU, gloo on CPU. Returns the torch.device this process uses."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and re.fullmatch(r"cuda:\d+", device):
        die(f"--device {device} would put all {world_size} processes of this torchrun job on one GPU; "
            f"use --device cuda (or auto): each process takes the GPU of its LOCAL_RANK")
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{local_rank}"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            die("--device cuda requested but no GPU is visible")
        torch.cuda.set_device(device)
        use_authors_cuda_settings()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return device


def use_authors_cuda_settings():
    """cuDNN autotuning (the authors set `cudnn.benchmark = True`; the crop sizes are fixed, so it
    tunes once) and TF32 for float32 matmuls and convolutions on Ampere and newer GPUs: the
    default of the torch the authors used (1.7-1.8), which later versions turned off for matmuls.
    So `--precision fp32` computes as the authors' fp32 did, and so does the DINO head, which runs
    in float32 under bf16 (`DINOHead`). No effect on CPUs."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


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
    next unseen batch. Rank r of n takes every n-th index of one permutation of (seed, epoch).
    With `with_epoch` it yields (index, epoch) pairs, for a `SeededDataset`."""

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
        """How many of this process's samples of an epoch (from the first batch) are not padding.
        Without drop_last, DistributedSampler repeats indices from the start of its list until every
        process has as many; the repeats come last, at list positions >= len(dataset), and process r
        takes positions r, r + n, r + 2n, ... An evaluation counts only the first this-many rows."""
        return min(self.num_samples, len(range(self.rank, len(self.dataset), self.num_replicas)))


def make_loader(dataset, batch_size, num_workers, train=True, seed=0):
    """DataLoader over a `ResumableSampler` (also with one process), so the order of samples is a
    function of (seed, epoch) only. The loader has its own generator: creating an epoch's
    iterator does not draw from the global RNG, which keeps resumed runs bit-identical. Its
    workers persist across epochs (starting them costs seconds per epoch); a `SeededDataset`
    receives the sampler's epoch with every index, so `sampler.set_epoch` is all an epoch needs."""
    if train and len(dataset) < batch_size * get_world_size():
        die(f"the dataset has {len(dataset)} images, fewer than one batch "
            f"({batch_size} per process x {get_world_size()} processes); lower --batch_size_per_gpu")
    sampler = ResumableSampler(dataset, batch_size, shuffle=train, seed=seed, drop_last=train,
                               with_epoch=isinstance(dataset, SeededDataset))
    collate = already_collated if getattr(dataset, "batched", False) else None
    loader = PreemptibleLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                               collate_fn=collate,
                               pin_memory=torch.cuda.is_available(), drop_last=train,
                               persistent_workers=num_workers > 0,
                               generator=torch.Generator().manual_seed(seed),
                               worker_init_fn=ignore_preemption_signals)
    return loader, sampler


def already_collated(batch):
    """The collate function of a dataset whose `__getitems__` returns a collated batch."""
    return batch


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptibleLoader(torch.utils.data.DataLoader):
    """SLURM and torchrun send the preemption signal to every process of the job, loader workers
    included. A worker killed by it would take its training process down before the checkpoint, so
    workers ignore it (`ignore_preemption_signals`) and the training process alone finishes its
    step, saves and shuts them. A worker only reaches its `worker_init_fn` some time after it is
    forked, and until then torch's own handler lets the signal kill it: the workers are therefore
    started with the signals blocked (a forked or spawned child inherits the mask), and a signal sent
    to the training process meanwhile is delivered when it unblocks them."""
    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def ignore_preemption_signals(_worker_id):
    """In a loader worker, born with the preemption signals blocked: ignore them (which also drops
    one already pending), then unblock them."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)


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
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, handler)


def preemption_requested(device):
    """True in every process as soon as any process received a preemption signal."""
    flag = torch.tensor([float(_preemption_signal is not None)], device=device)
    return all_reduce_sum(flag).item() > 0


def exit_after_preemption(output_dir):
    close_progress_bars()
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


def teacher_temperature_schedule(warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs, niter_per_ep=1):
    """Teacher temperature, one value per iteration: a linear warm-up from `warmup_teacher_temp` to
    `teacher_temp` (endpoint included), then constant. The same schedule drives every
    self-distillation loss in this repository.

    A whole number of warm-up epochs ramps per epoch, as the authors' code does (every step of epoch e
    uses linspace(warmup, final, warmup_epochs)[e]); a fractional one ramps per step over
    int(warmup_epochs * niter_per_ep) steps, so that a one-epoch run can warm up too. With
    niter_per_ep = 1 the table is indexed by epoch."""
    if float(warmup_epochs).is_integer():
        warmup = np.repeat(np.linspace(warmup_teacher_temp, teacher_temp, int(warmup_epochs)), niter_per_ep)
    else:
        warmup = np.linspace(warmup_teacher_temp, teacher_temp, int(warmup_epochs * niter_per_ep))
    total = nepochs * niter_per_ep     # a warm-up longer than the run is cut where the run ends
    return np.concatenate((warmup, np.ones(max(total - len(warmup), 0)) * teacher_temp))[:total]


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
    to norm <= clip (not a global-norm clip). Returns the norms before clipping, a tensor (one per
    gradient, in parameter order).

    Without a host sync: the norms stay on the device, and every gradient is multiplied by its
    factor clip / (norm + 1e-6) where that is below 1, else by 1 (which leaves it bit for bit as it
    was, NaN norms included), instead of testing each factor in Python."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    norms = torch.stack(torch._foreach_norm(grads, 2))
    factors = (norms + 1e-6).reciprocal() * clip      # what `clip / (norm + 1e-6)` computes
    torch._foreach_mul_(grads, torch.where(factors < 1, factors, 1.0).unbind())
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    """During the first `freeze_last_layer` epochs, drop the gradients of every head's last layer
    (grad = None, so AdamW leaves those weights untouched). `epoch` may be fractional (epoch +
    step / steps per epoch), so that a fraction of an epoch can be frozen in a short run."""
    if epoch >= freeze_last_layer:
        return
    for name, p in model.named_parameters():
        if "last_layer" in name:
            p.grad = None


@torch.no_grad()
def update_teacher(student, teacher, momentum):
    """EMA over parameters: teacher = m * teacher + (1 - m) * student, as one multi-tensor
    operation per step (not one kernel pair per parameter)."""
    s_params = dict(unwrap(student).named_parameters())
    t_names, t_params = zip(*unwrap(teacher).named_parameters())
    torch._foreach_mul_(t_params, momentum)
    torch._foreach_add_(t_params, [s_params[name].detach() for name in t_names], alpha=1 - momentum)


def autocast(device, precision):
    """Mixed-precision context: fp16 (with a grad scaler), bf16, or fp32. fp16 also runs on CPUs
    (slowly: it exists there so that the grad-scaler path can be tested without a GPU)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def make_grad_scaler(device, precision):
    """fp16 gradients can overflow: the scaler skips such a step and lowers its scale (no stop)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


# bf16 pays only where the hardware computes in it. A CPU without AVX512-BF16 or AMX-BF16 gets
# torch's emulation: on an AMD EPYC with AVX2 only, a 1024 x 1024 matmul took 94x as long as in
# fp32 and a DINO ViT-S/16 step about 25x (docs/PERFORMANCE.md, "Precision on CPUs").
EMULATED_BF16_SLOWDOWN = "a ViT-S/16 step about 25x slower than in fp32 (measured on an AVX2-only AMD EPYC)"


def choose_precision(device_type, cuda_bf16, cpu_native_bf16, cpu_capability):
    """What `--precision auto` runs, and why (one line for the log). A pure function of what
    `precision_facts` finds out, so that every case is testable on any machine:
      GPU with native bf16 (Ampere or newer)   bf16: fp16's speed, fp32's range (no grad scaler)
      GPU without                              fp16 with a grad scaler, as DINO's authors train
      CPU with AVX512-BF16 or AMX-BF16         bf16 (also for the *_pico models: with `Attention`'s
                                               explicit path their steps are 1.2-2.3x faster than fp32)
      any other CPU or device                  fp32 (bf16 would be emulated)
    The authors of DINO, EsViT, GLSD (EsViT's code) and SelfPatch train in fp16 with a grad scaler
    (`--use_fp16`, on by default), DRLoc's in fp32: on a GPU without native bf16 `auto` is their
    choice; elsewhere bf16 has fp16's speed without its overflows. On a CPU without native bf16,
    torch emulates bf16 and a ViT-S/16 step is many times slower (docs/PERFORMANCE.md).
    Under bf16 the DINO heads compute in float32 (`DINOHead`): the teacher temperature would
    magnify bf16's rounding of the logits. The losses are float32 under every precision."""
    if device_type == "cuda":
        if cuda_bf16:
            return "bf16", "this GPU computes in bf16 natively"
        return "fp16", "this GPU has no native bf16: fp16 with a grad scaler, as the authors train"
    if device_type != "cpu":
        return "fp32", f"no mixed-precision rule for {device_type} devices"
    if not cpu_native_bf16:
        return "fp32", (f"this CPU has no native bf16 (torch CPU capability {cpu_capability}, no AVX512-BF16 "
                        f"or AMX-BF16): emulated bf16 would make {EMULATED_BF16_SLOWDOWN}")
    return "bf16", f"this CPU has native bf16 (AVX512-BF16 or AMX-BF16; torch CPU capability {cpu_capability})"


def cpu_has_native_bf16():
    """AVX512-BF16 or AMX-BF16, as torch's cpuinfo reports them (the capability string, e.g.
    'AVX512', does not say); torch without `torch.cpu.get_capabilities`: the Linux kernel's flags."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        capabilities = get_capabilities()
        return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cuda_has_native_bf16(device):
    """Whether the GPU computes in bf16 natively (Ampere or newer), not only by emulation. Asked as
    `torch.cuda.is_bf16_supported(including_emulation=False)`; a torch whose function has no such
    argument (it is not in every version requirements.txt allows) is answered from the compute
    capability (8.0 = Ampere)."""
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability(device) >= (8, 0)


def precision_facts(device):
    """What `choose_precision` needs to know about `device`, as torch reports it."""
    return dict(device_type=device.type,
                cuda_bf16=device.type == "cuda" and cuda_has_native_bf16(device),
                cpu_native_bf16=cpu_has_native_bf16(), cpu_capability=torch.backends.cpu.get_cpu_capability())


def resolve_precision(args, device):
    """Once at start-up: replace `--precision auto` by what `choose_precision` picks for this device
    and log why; args.json then holds the precision that runs and `precision_auto` (whether it was
    chosen). An explicit bf16 on a CPU without native bf16 runs, after one warning."""
    facts = precision_facts(device)
    args.precision_auto = args.precision == "auto"
    if args.precision_auto:
        args.precision, reason = choose_precision(**facts)
        log(f"precision: {args.precision} (--precision auto: {reason})")
    elif args.precision == "bf16" and device.type == "cpu" and not facts["cpu_native_bf16"]:
        log(f"warning: --precision bf16 on a CPU without native bf16 (torch CPU capability {facts['cpu_capability']}, "
            f"no AVX512-BF16 or AMX-BF16): torch emulates it; expect {EMULATED_BF16_SLOWDOWN}. "
            f"--precision auto picks fp32 here")


def fix_random_seeds(seed):
    """Same seed in every process (DDP also broadcasts the weights of rank 0)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def stop_if_not_finite(loss, epoch, args, debug_state):
    """On a non-finite loss (in any process), write `debug_state()` (the method's networks, optimizer
    and loss state) with the epoch and args to checkpoint_nonfinite.pth and stop with advice."""
    bad = all_reduce_sum(torch.tensor([0.0 if math.isfinite(loss.item()) else 1.0], device=loss.device))
    if bad.item() == 0:
        return
    path = Path(args.output_dir) / "checkpoint_nonfinite.pth"
    state = {**debug_state(), "epoch": epoch, "args": vars(args)}
    if is_main_process():
        save_checkpoint(state, path)
    clip = f"a --clip_grad below {args.clip_grad}" if args.clip_grad else "--clip_grad 3.0 (or lower)"
    close_progress_bars()   # the error, not the bar, is the last line
    log(f"error: the loss is {loss.item()} at epoch {epoch}; debug checkpoint written to {path}.\n"
        f"Likely causes: mixed-precision overflow, a too high learning rate, or exploding "
        f"gradients. Try --precision fp32, a lower --lr, or {clip}.")
    sys.exit(1)


# ================================================================================================
# 7. Checkpoints
# ================================================================================================
def rng_state():
    """This process's RNG states, as types `torch.load(weights_only=True)` accepts. Of the CUDA
    generators only the one of this process's own GPU (every process sees all the node's GPUs, but
    draws on its own; a resume may see fewer)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if torch.cuda.is_available() else [],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
            "python": [py_state[0], list(py_state[1]), py_state[2]]}


def set_rng_state(state):
    """Restore what `rng_state` saved. The CUDA state goes to this process's GPU; a checkpoint that
    holds a list (one state per visible GPU) gives the entry of this process's GPU when it has one."""
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, (list, tuple)):
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None and len(cuda) and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
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
    except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as a RuntimeError over the OSError
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), None)
        if cause is None:
            raise
        kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
        die(f"cannot write {path}: {cause.strerror or cause} ({kept}); free space or fix the folder, then "
            f"run the same command again")
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
                 "save_every_iters", "precision", "val_subset", "allow_changed_args"}


def check_crop_sizes(args):
    """One rule for every self-supervised script: each crop is tiled exactly by the last tokens.
    Otherwise a ViT stops deep inside timm, and a Swin silently pads its token maps with zeros
    (averaged into the global feature, and off the crop's geometry). The crops' area ranges must
    be (min, max)."""
    check_scale_range("--global_crops_scale", args.global_crops_scale)
    if args.local_crops_number:
        check_scale_range("--local_crops_scale", args.local_crops_scale)
    stride = token_stride(args.arch, args.patch_size)
    sizes = {"--global_crop_size": args.global_crop_size}
    if args.local_crops_number:
        sizes["--local_crop_size"] = args.local_crop_size
    for flag, size in sizes.items():
        if size % stride:
            die(f"{flag} {size} is not a multiple of the {args.arch} token stride ({stride} px); "
                f"use e.g. {max(stride, size // stride * stride)}")


def check_scale_range(flag, scale):
    """An area range (min, max) of RandomResizedCrop: reversed, torch fails only in the first batch."""
    if scale[0] > scale[1]:
        die(f"{flag} {scale[0]} {scale[1]} is reversed: give the smallest area first, e.g. {flag} {scale[1]} {scale[0]}")


def start_training(args, method):
    """Start-up of a training script, before anything is written to --output_dir: the folder is
    claimed for this run (`claim_output_dir`: refused while another run uses it), then the crop
    sizes (`check_crop_sizes`) and the checkpoint to resume from: written by this method, readable,
    and trained with the same arguments (`check_resumed_args`). Then removes this script's own stale
    temporary files. Returns the checkpoint to resume from, or None. The script writes args.json
    (`save_args`) once the rest of its start-up (data, model) has passed too."""
    claim_output_dir(args.output_dir)
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


# ------------------------------------------------------------------------------------------------
# One run per --output_dir
# ------------------------------------------------------------------------------------------------
LOCK_FILE = ".lock"
_output_lock = None     # this process's claim on its --output_dir (see claim_output_dir)


def make_folder(path, flag):
    """Create the folder that `flag` names (and its parents), with a one-line error where it cannot
    be: a file of that name, no permission, a read-only disk, too long a name. Returns whether it
    was created."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            die(f"{flag} {path} is a file, not a folder; give a folder name")
        existed = path.is_dir()
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        die(f"cannot create {flag} {path}: {e.strerror or e}")
    return not existed


def claim_output_dir(output_dir, checkpoint="checkpoint.pth"):
    """Make --output_dir this run's own before anything is written to it, so that two runs never
    overwrite each other's checkpoints and logs. Rank 0 creates the folder and in it `.lock`,
    holding its host, pid (and the pid's start time, SLURM job id); every process learns the
    outcome, so that all of them stop together, in one line, if the folder is another run's.

    A lock whose process has ended on this host (kill -9, a node reboot) is stale: it is removed
    and said so. A lock written on another host (a shared filesystem) cannot be checked from here:
    it is refused, naming host and pid, unless it was written by an earlier run of the same SLURM
    job (a requeued job, SLURM_RESTART_COUNT higher, runs again only after it has ended). Its owner removes the lock at exit (normal
    end, error, preemption exit, Ctrl-C); a folder created for a run that stopped before writing
    anything is removed too. `checkpoint` is what Ctrl-C names as the run's last checkpoint."""
    global _output_lock
    if _output_lock is not None and _output_lock["dir"] != str(output_dir):
        release_output_dir()                # one run per process (main() called again in process)
    problem = None
    if is_main_process():
        try:
            created = make_folder(output_dir, "--output_dir")
            take_lock(Path(output_dir) / LOCK_FILE, output_dir)
        except SystemExit as e:
            problem = str(e.code)
    problem = all_gather_objects(problem)[0]
    if problem:
        raise SystemExit(problem)
    _output_lock = {"dir": str(output_dir), "checkpoint": checkpoint, "pid": os.getpid(),
                    "lock": str(Path(output_dir) / LOCK_FILE) if is_main_process() else None,
                    "created": is_main_process() and created}


def lock_owner():
    """Who this process is, as a lock records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start_time(os.getpid()),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", 0))}


def process_start_time(pid):
    """When process `pid` started (clock ticks since boot; Linux), or None: tells a reused pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def take_lock(lock, output_dir):
    """Create `lock` for this process, replacing a stale one (`stale_lock_reason`), or stop."""
    me = lock_owner()
    for attempt in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)   # atomic: one of two racing runs wins
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text())
            except (OSError, ValueError):
                holder = {}
            if (holder.get("host"), holder.get("pid")) == (me["host"], me["pid"]):
                return                                   # this process already holds it (main() run twice)
            reason = stale_lock_reason(holder, me)
            if reason is None or attempt:
                who = (f"pid {holder['pid']} on host {holder['host']}" if holder.get("pid") else "a run starting now")
                remote = (", which cannot be checked from this host" if holder.get("pid") and holder.get("host") != me["host"]
                          else "")
                die(f"--output_dir {output_dir} is in use by another run ({who}{remote}; lock {lock}): wait for it to "
                    f"end or choose another --output_dir (delete the lock only if no run uses the folder)")
            lock.unlink(missing_ok=True)
            log(f"removed the stale lock {lock} of pid {holder['pid']} on {holder['host']}: {reason}")
            continue
        except OSError as e:
            die(f"cannot write in --output_dir {output_dir}: {e.strerror or e}")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:
            lock.unlink(missing_ok=True)
            die(f"cannot write in --output_dir {output_dir}: {e.strerror or e}")
        return


def stale_lock_reason(holder, me):
    """Why the lock of `holder` no longer protects a run (None: it may, so it stands)."""
    if not holder.get("pid"):
        return None                                      # being written right now, or unreadable
    if holder.get("host") == me["host"]:
        if not process_alive(holder["pid"]):
            return "that process has ended"
        start = process_start_time(holder["pid"])
        if holder.get("start") is not None and start is not None and start != holder["start"]:
            return "that process has ended (its pid now belongs to another process)"
        return None
    # SLURM requeues a job under the same id, with SLURM_RESTART_COUNT one higher, once it has ended
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"] and \
            holder.get("slurm_restart", 0) < me["slurm_restart"]:
        return f"an earlier run of this SLURM job ({me['slurm_job']}), which was requeued"
    return None


@atexit.register
def release_output_dir():
    """Remove this process's lock (and the folder, if it created it and nothing was written)."""
    global _output_lock
    claim, _output_lock = _output_lock, None
    if not claim or not claim["lock"] or claim["pid"] != os.getpid():   # a forked child inherits the claim
        return
    lock = Path(claim["lock"])
    try:
        if json.loads(lock.read_text()).get("pid") == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass
    if claim["created"]:
        with contextlib.suppress(OSError):
            Path(claim["dir"]).rmdir()      # only if empty


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


def dataset_record(dataset):
    """What a checkpoint records of its training set, so that a resumed run notices another one
    (--data_path may change on resume, to follow moved data): the number of images and a
    fingerprint of what the set lists, read without opening an image: the class names and, per
    image, its path relative to the folder and its label (an image folder) or its label. Computed
    once per dataset object."""
    if hasattr(dataset, "data_record"):
        return dataset.data_record
    indices, base = range(len(dataset)), dataset
    while isinstance(base, torch.utils.data.Subset) or isinstance(base, SeededDataset):
        if isinstance(base, SeededDataset):
            base = base.base
        else:
            indices, base = [base.indices[i] for i in indices], base.dataset
    if hasattr(base, "samples"):
        entries = [f"{os.path.relpath(base.samples[i][0], base.root)}\t{base.samples[i][1]}" for i in indices]
    else:
        labels = getattr(base, "targets", None)
        labels = getattr(base, "labels", None) if labels is None else labels
        entries = [] if labels is None else [str(int(labels[i])) for i in indices]
    text = "\n".join([type(base).__name__, *map(str, getattr(base, "classes", None) or []), *entries])
    dataset.data_record = {"images": len(dataset), "fingerprint": hashlib.sha256(text.encode()).hexdigest()[:16]}
    return dataset.data_record


def resume_position(ckpt, dataset, args):
    """(epoch, step) where a resumed run continues. The step counts batches of one permutation of
    the checkpoint's training set: on another dataset (another size or fingerprint than the
    checkpoint records: `dataset_record`) it means nothing, and past the end of a smaller one's
    epoch it would silently train nothing. Another dataset is refused; with --allow_changed_args
    the run goes on with it from the start of the checkpoint's epoch, and says so. A checkpoint
    without the record resumes where it stopped."""
    epoch, step = ckpt["epoch"], ckpt["step"]
    old, new = ckpt.get("dataset"), dataset_record(dataset)
    if old is None or old == new:
        return epoch, step
    path = Path(args.output_dir) / "checkpoint.pth"
    change = (f"{old['images']} images, now {new['images']}" if old["images"] != new["images"]
              else f"{new['images']} images as now, but other files or labels")
    if not args.allow_changed_args:
        die(f"{path} was trained on another dataset ({change}); resume with the same data, or use another "
            f"--output_dir, or --allow_changed_args to go on with this one from the start of epoch {epoch}")
    log(f"warning: resuming on another dataset ({change}; --allow_changed_args): epoch {epoch} starts again at "
        f"its first batch" + (f" (the checkpoint stopped after step {step})" if step else ""))
    return epoch, 0


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
    """Load every named object (module, optimizer, scaler, loss) from `checkpoint`; modules strictly.
    A grad scaler follows the precision of this run, which `--precision auto` may choose otherwise
    than the checkpoint's run did (on another GPU): see `restore_grad_scaler`."""
    for name, obj in objects.items():
        if name not in checkpoint:
            die(f"checkpoint has no {name!r} entry (written by another script?)")
        if isinstance(obj, nn.Module):
            load_state_dict_strict(unwrap(obj), checkpoint[name], what=name)
        elif isinstance(obj, torch.amp.GradScaler):
            restore_grad_scaler(obj, checkpoint[name], checkpoint.get("args", {}).get("precision", "?"))
        else:
            obj.load_state_dict(checkpoint[name])


def restore_grad_scaler(scaler, state, trained_precision):
    """A run trained in bf16 or fp32 saved no scaler state ({}): resumed in fp16, the scaler starts
    at its initial scale (torch refuses to load the empty state). A run trained in fp16 and resumed
    in bf16 or fp32 needs no scaler: its scale is dropped. Either change is logged in one line."""
    if scaler.is_enabled() and not state:
        log(f"precision: the checkpoint was trained in {trained_precision} without a grad scaler; this run "
            f"trains in fp16, whose grad scaler starts at scale {scaler.get_scale():g}")
    elif state and not scaler.is_enabled():
        log(f"precision: the checkpoint was trained in {trained_precision} with a grad scaler (scale "
            f"{state.get('scale', float('nan')):g}); this run needs none and drops it")
    else:
        scaler.load_state_dict(state)


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
                   help="ViT patch size: 16 or 8 (smaller patches are much better and much slower), or any "
                        "divisor of the crops for small images (4 at 32 px); a Swin's patch is set by --arch")
    g.add_argument("--window_size", default=7, type=POSITIVE_INT,
                   help="Swin window size (7, or 14 for full attention in the last two stages)")
    g.add_argument("--fit_window", default=False, type=bool_flag,
                   help="small images: shrink each Swin stage's window to the largest size <= --window_size that "
                        "tiles the token grid of every crop, so that no attention goes to padding")
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
    g.add_argument("--batched_crops", default=False, type=bool_flag,
                   help="build each batch's crops at once with tensor operations (images of one size, e.g. "
                        "Fashion-MNIST): the PIL path's random draws and, to a level or two of 255, its pixels; "
                        "much faster on small images. Off: the papers' per-image PIL path")
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
                   help="carve a validation split off the train split: its last N images. Training then "
                        "uses the others, and evaluation uses the N as its test split and the others as "
                        "its train split (the k-NN bank), so hyperparameters are chosen without the test set")
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
                   help="checkpoints and logs; a run resumes from here. One run at a time: a second one is "
                        "refused while the first is alive (the lock file .lock holds its host and pid)")
    g.add_argument("--allow_changed_args", action="store_true",
                   help="resume although arguments that change what is trained, or the dataset, differ from the "
                        "checkpoint's (on another dataset the epoch starts again at its first batch)")
    g.add_argument("--saveckp_freq", default=saveckp_freq, type=COUNT, help="keep a copy every N epochs")
    g.add_argument("--seed", default=0, type=COUNT, help="seeds weights, data order and augmentations")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when present), cpu, cuda, or cuda:N (one process only: under torchrun each "
                        "process takes the GPU of its LOCAL_RANK)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="autocast dtype. auto: bf16 on GPUs with native bf16, else fp16 with a grad scaler (as "
                        "DINO's authors train); on CPUs bf16 only with native bf16 (AVX512-BF16 or AMX-BF16), "
                        "else fp32 (emulated bf16 made a ViT-S/16 step ~25x slower on an "
                        "AVX2-only CPU); the choice and its reason are logged. fp16 uses a grad scaler (on CPU "
                        "only for testing: slow). On CUDA, fp32 matmuls and convolutions use TF32, as in the "
                        "authors' torch, and under bf16 the DINO heads compute in fp32")
    g.add_argument("--save_every_iters", default=0, type=COUNT,
                   help="also write checkpoint.pth every N steps inside an epoch (long epochs); a run "
                        "resumes at the next unseen batch")
    g.add_argument("--max_steps_per_epoch", default=0, type=COUNT,
                   help="stop each epoch after N steps (0 = full epoch); for smoke tests")
    return g


# ================================================================================================
# 9. Evaluation: one loader for every checkpoint, shared arguments, features by dataset index
# ================================================================================================


class ClassAttentionBlock(nn.Module):
    """CaiT's class-attention block without LayerScale, SelfPatch's: the query attends over
    [query; tokens] (itself included) and only the query is updated. timm's `ClassAttn` and `Mlp`
    carry the SelfPatch authors' submodule names (attn.q/k/v/proj, mlp.fc1/fc2), so their weights
    load as they are; timm's whole CaiT block is not used because its LayerScale adds gamma_1/2."""

    def __init__(self, dim, num_heads, mlp_ratio=4.0, eps=1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = ClassAttn(dim, num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, query, tokens):
        """query [M, 1, C], tokens [M, T, C] -> the updated query [M, 1, C]."""
        query = query + self.attn(self.norm1(torch.cat([query, tokens], dim=1)))
        return query + self.mlp(self.norm2(query))


class ClassAttentionPool(nn.Module):
    """A learned query, class-attention blocks and a final LayerNorm (the SelfPatch authors'
    `SelfPatchHead`, with their key names): summarises a set of tokens into one. Here because
    evaluation rebuilds SelfPatch's image token from a checkpoint; selfpatch.py's
    `AggregationModule` adds what training needs."""

    def __init__(self, dim, num_heads, num_blocks=2):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))       # the learned query (authors' name)
        self.cls_blocks = nn.ModuleList(ClassAttentionBlock(dim, num_heads) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def summarize(self, tokens):
        """tokens [M, T, C] -> [M, C], before the final LayerNorm."""
        query = self.cls_token.expand(len(tokens), -1, -1)
        for block in self.cls_blocks:
            query = block(query, tokens)
        return query[:, 0]

    def image_token(self, tokens):
        """tokens [M, T, C] -> the normed summary [M, C]."""
        return self.norm(self.summarize(tokens))


def backbone_record(backbone, image_token="backbone"):
    """What a checkpoint stores (its "backbone" entry) so that `load_backbone` rebuilds the network
    without the method file: `build_backbone`'s arguments, and where the image feature comes from:
    "backbone" (ViT CLS token, Swin token mean) or "ca_head" (SelfPatch's aggregation module)."""
    return {**backbone.build_config, "image_token": image_token}


# ================================================================================================
# 10. Correspondence of local features (extras/eval_correspondence.py, --monitor_correspondence)
# ================================================================================================


