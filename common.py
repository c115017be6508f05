"""Shared infrastructure of the five method files and the evaluation scripts; no method logic.

It reads in two parts, by audience:
  Part A, what the methods compute: all that a method's model and `train_one_epoch` call (A1
    backbones, A2 the DINO head, A3 multi-crop with geometry, A4 the training step's schedules,
    clipping, EMA, mixed precision and collectives). No argument checking inside.
  Part B, running them plainly: B1 data, B2 processes, loaders and preemption, B3 checkpoints and
    resume, B4 logging and the shared arguments.
Two optional files sit beside it: `checks.py` (the safety checks, each called from one line marked
`# checks`) and `device_crops.py` (`--batched_crops`: the crops cut on the training device). A fork
may delete either with the lines that call it. Nothing here imports them.
A docstring that starts with "Collective" marks a function that every process must call.
"""
import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import datetime
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
import warnings
import zipfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFile, ImageFilter
from timm.layers import Attention as TimmAttention
from timm.layers import Mlp
from timm.models.cait import ClassAttn
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torchvision import datasets as tv_datasets
from torchvision import transforms
from torchvision.transforms import functional as TF
from tqdm import tqdm

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
    "swin_pico3": dict(family="swin", patch_size=2, embed_dim=32, depths=(2, 2, 2),
                       num_heads=(1, 2, 4)),
    "swin_tiny": dict(family="swin", embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin_small": dict(family="swin", embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin_base": dict(family="swin", embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
}


class Attention(TimmAttention):
    """timm's attention, computed explicitly (timm's unfused path) on a CPU under bf16 autocast,
    where the fused kernel's bf16 backward is much slower (docs/PERFORMANCE.md)."""

    @property
    def fused_attn(self):
        cpu_bf16 = (torch.is_autocast_enabled("cpu")
                    and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return self._fused_attn and not cpu_bf16

    @fused_attn.setter
    def fused_attn(self, value):
        self._fused_attn = value


class ViT(VisionTransformer):
    """timm's VisionTransformer (the DINO authors' key names) with DINO's position interpolation,
    `scale_factor=((h + 0.1) / n, (w + 0.1) / n)` bicubic: timm's antialiased resampling differs
    (by up to ~4 on a ViT-Ti), so released weights would see other local-crop inputs."""

    def _pos_embed(self, x):
        """x: [B, h, w, C] patch embeddings (dynamic_img_size=True) -> tokens with positions."""
        B, h, w, C = x.shape
        gh, gw = self.patch_embed.grid_size
        n_prefix = self.num_prefix_tokens
        pos = self.pos_embed
        if (h, w) != (gh, gw):
            grid = pos[:, n_prefix:].reshape(1, gh, gw, C).permute(0, 3, 1, 2)
            grid = F.interpolate(grid.float(), scale_factor=((h + 0.1) / gh, (w + 0.1) / gw),
                                 mode="bicubic", align_corners=False).to(pos.dtype)
            assert grid.shape[-2:] == (h, w), (grid.shape, h, w)
            grid = grid.permute(0, 2, 3, 1).reshape(1, h * w, C)
            pos = torch.cat([pos[:, :n_prefix], grid], 1)
        x = x.reshape(B, h * w, C)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        return self.pos_drop(x + pos)

    def forward_dense(self, x, norm=True):
        """(CLS token [B, D] or None, grid [B, h, w, D]); norm=False: before the final norm."""
        h = x.shape[-2] // self.patch_embed.patch_size[0]
        w = x.shape[-1] // self.patch_embed.patch_size[1]
        tokens = self.patch_drop(self._pos_embed(self.patch_embed(x)))
        tokens = self.blocks(self.norm_pre(tokens))
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
    """A ViT or Swin from `ARCHS` for `img_size` (the global crop); `overrides` replace `ARCHS`
    entries. Checkpoints record the arguments (`build_config`)."""
    config = dict(arch=arch, patch_size=patch_size, window_size=window_size, img_size=img_size,
                  class_token=class_token, final_norm=final_norm, layer_norm_eps=layer_norm_eps,
                  **overrides)
    if arch not in ARCHS:
        die(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg = {**ARCHS[arch], **overrides}
    family = cfg.pop("family")
    norm_layer = partial(nn.LayerNorm, eps=layer_norm_eps)
    if family == "vit":
        if patch_size < 1 or img_size % patch_size:
            die(f"--patch_size {patch_size} does not divide the {img_size} px global crop; choose "
                f"a divisor of the crop size (e.g. 16 or 8 at 224 px, 4 at 32 px)")
        backbone = ViT(img_size=img_size, patch_size=patch_size, mlp_ratio=4, qkv_bias=True,
                       norm_layer=norm_layer, num_classes=0, dynamic_img_size=True,
                       drop_path_rate=drop_path_rate, class_token=class_token,
                       global_pool="token" if class_token else "avg", final_norm=final_norm,
                       fc_norm=False,  # keep the final norm in `norm` (timm moves it for "avg")
                       attn_layer=Attention, **cfg)
    else:
        if not class_token or not final_norm:
            die("a Swin backbone has no CLS token to remove and always ends in a LayerNorm")
        backbone = Swin(img_size=img_size, patch_size=cfg.pop("patch_size", 4),
                        window_size=window_size, mlp_ratio=4, qkv_bias=True,
                        norm_layer=norm_layer, num_classes=0, strict_img_size=False,
                        drop_path_rate=drop_path_rate, **cfg)
    backbone.build_config = config
    return backbone


def backbone_record(backbone, image_token="backbone"):
    """A checkpoint's "backbone" entry: `build_backbone`'s arguments, the image token's source."""
    return {**backbone.build_config, "image_token": image_token}


def token_stride(arch, patch_size=16):
    """Pixels per token of the final grid: the ViT patch, or Swin's patch x 2 per merging."""
    cfg = ARCHS[arch]
    if cfg["family"] == "vit":
        return patch_size
    return cfg.get("patch_size", 4) * 2 ** (len(cfg["depths"]) - 1)


def fitted_windows(arch, patch_size, window_size, crop_sizes):
    """Per Swin stage, the largest window <= window_size tiling every crop's grid."""
    grids = [[size // ARCHS[arch].get("patch_size", 4)] for size in crop_sizes]  # crop, stage
    for stage_grids in grids:
        for _ in ARCHS[arch]["depths"][1:]:
            stage_grids.append((stage_grids[-1] + 1) // 2)  # timm pads an odd grid
    return tuple(max(w for w in range(1, window_size + 1) if all(g % w == 0 for g in stage))
                 for stage in zip(*grids))


def backbone_from_args(args, drop_path_rate, img_size=None, **kwargs):
    """The backbone that a training run's arguments describe, for the global crop (or img_size)."""
    window = getattr(args, "window_size", 7)
    global_size = img_size or args.global_crop_size
    if getattr(args, "fit_window", False) and ARCHS[args.arch]["family"] == "swin":
        sizes = [global_size]
        if getattr(args, "local_crops_number", 0):
            sizes.append(args.local_crop_size)
        window = fitted_windows(args.arch, args.patch_size, window, sizes)
    return build_backbone(args.arch, args.patch_size, window, drop_path_rate,
                          img_size=global_size, **kwargs)


def resolution_groups(crops):
    """(start, end) of every run of consecutive crops with the same resolution."""
    runs = itertools.groupby(c.shape[-2:] for c in crops)
    ends = list(itertools.accumulate(len(list(run)) for _, run in runs))
    return list(zip([0] + ends[:-1], ends))


def forward_multicrop(fn, crops):
    """`fn` of each run of equal-resolution crops, crop-major (DINO's MultiCropWrapper)."""
    return [fn(torch.cat(crops[start:end])) for start, end in resolution_groups(crops)]


def other_crop_pairs(ncrops):
    """Flat indices of the pairs s != t in [2, ncrops] (teacher t, student s); no host sync."""
    return torch.tensor([t * ncrops + s for t in range(2) for s in range(ncrops) if s != t])


class ClassAttentionBlock(nn.Module):
    """CaiT's class-attention block without LayerScale: the query attends over [query; tokens]
    and only it is updated (timm's modules carry the SelfPatch authors' submodule names)."""

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
    """SelfPatch's aggregation (the authors' `SelfPatchHead` and key names): a learned query, two
    class-attention blocks and a LayerNorm summarise tokens into one (selfpatch.py, eval_knn.py)."""

    def __init__(self, dim, num_heads, num_blocks=2):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))  # the learned query
        blocks = [ClassAttentionBlock(dim, num_heads) for _ in range(num_blocks)]
        self.cls_blocks = nn.ModuleList(blocks)
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

    def forward(self, tokens):
        """tokens [B, T, C] -> the image token [B, C]."""
        return self.norm(self.summarize(tokens))


# ======== A2. The DINO head =======================================================================
class WeightNormLinear(nn.Module):
    """Bias-free Linear, weight = g v / ||v|| per row, with `nn.utils.weight_norm`'s keys."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        weight = torch.empty(out_dim, in_dim)
        self.weight_v = nn.Parameter(nn.init.kaiming_uniform_(weight, a=math.sqrt(5)))  # as Linear
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1))

    def forward(self, x):
        return F.linear(x, self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True))


class DINOHead(nn.Module):
    """MLP -> l2-normalise -> weight-normalised Linear(bottleneck, K), in float32 under bf16: the
    teacher temperature scales bf16's logit errors by 25 (extras/perf/head_precision.py)."""

    def __init__(self, in_dim, out_dim, use_bn=False, norm_last_layer=True, nlayers=3,
                 hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (max(nlayers, 1) - 1)
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b)] + ([nn.BatchNorm1d(b)] if use_bn else []) + [nn.GELU()]
        layers.append(nn.Linear(dims[-1], bottleneck_dim))
        self.mlp = layers[0] if len(layers) == 1 else nn.Sequential(*layers)  # the authors' keys
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
    """DINO's PIL Gaussian blur, with probability p and radius ~ U(sigma), from torch's RNG."""

    def __init__(self, p, sigma=(0.1, 2.0)):
        self.p = p
        self.sigma = sigma

    def draw(self):
        """The radius, or None for no blur."""
        if torch.rand(1).item() >= self.p:
            return None
        return self.sigma[0] + (self.sigma[1] - self.sigma[0]) * torch.rand(1).item()

    def __call__(self, img):
        radius = self.draw()
        return img if radius is None else img.filter(ImageFilter.GaussianBlur(radius))


class MultiCropAugmentation:
    """DINO's multi-crop: 2 global and N local crops, each with its geometry {"box": [x0, y0, w, h]
    (fractions of the image), "flip", "image_size": [W, H]}, from torch's RNG only."""

    def __init__(self, global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4),
                 local_crops_number=8, global_crop_size=224, local_crop_size=96,
                 mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.global_scale = tuple(global_crops_scale)
        self.local_scale = tuple(local_crops_scale)
        self.n_local = local_crops_number
        self.global_size = global_crop_size
        self.local_size = local_crop_size
        self.mean = mean
        self.std = std
        color = [transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                 transforms.RandomGrayscale(p=0.2)]
        to_tensor = [transforms.ToTensor(), transforms.Normalize(mean, std)]
        sigma = (0.1 * global_crop_size / 224, 2.0 * global_crop_size / 224)  # scaled radius
        self.global1 = transforms.Compose(color + [RandomGaussianBlur(1.0, sigma)] + to_tensor)
        solarize = transforms.RandomSolarize(128, p=0.2)
        self.global2 = transforms.Compose(color + [RandomGaussianBlur(0.1, sigma), solarize]
                                          + to_tensor)
        self.local = transforms.Compose(color + [RandomGaussianBlur(0.5, sigma)] + to_tensor)

    def plan(self):
        """(size, scale, photometric pipeline) of every crop, in the order they are drawn."""
        views = [(self.global_size, self.global_scale, self.global1),
                 (self.global_size, self.global_scale, self.global2)]
        return views + [(self.local_size, self.local_scale, self.local)] * self.n_local

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
        for size, scale, photometric in self.plan():
            crop, geo = self.crop_and_flip(img, size, scale)
            crops.append(photometric(crop))
            geometry.append(geo)
        return crops, geometry


def grid_centers(geometry, grid_size):
    """Centre of each cell of an (h, w) grid over each (maybe mirrored) crop: [B, h*w, 2] px."""
    h, w = grid_size
    box = geometry["box"].float()
    flip = geometry["flip"].bool()
    img_w, img_h = geometry["image_size"].float().unbind(-1)
    cols = (torch.arange(w, device=box.device) + 0.5) / w  # [w]
    cols = torch.where(flip[:, None], 1 - cols, cols)  # [B, w]
    rows = ((torch.arange(h, device=box.device) + 0.5) / h).expand(len(box), h)  # [B, h]
    x = (box[:, 0:1] + cols * box[:, 2:3]) * img_w[:, None]
    y = (box[:, 1:2] + rows * box[:, 3:4]) * img_h[:, None]
    centers = torch.stack(torch.broadcast_tensors(x[:, None, :], y[:, :, None]), -1)
    return centers.reshape(len(box), h * w, 2)


# ======== A4. The training step: schedules, optimiser details, EMA, precision, collectives ========
def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0,
                     start_warmup_value=0):
    """Per iteration: a linear warmup, then `final + 0.5 (base - final)(1 + cos(pi i / T))`."""
    warmup_iters = int(warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    cosine = 1 + np.cos(np.pi * iters / len(iters))
    schedule = final_value + 0.5 * (base_value - final_value) * cosine
    return np.concatenate((np.linspace(start_warmup_value, base_value, warmup_iters), schedule))


def teacher_temperature_schedule(warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                                 niter_per_ep=1):
    """Teacher temperature per iteration, linear then constant (whole warm-up epochs ramp per
    epoch, as the authors' code does; a fraction of an epoch ramps per step)."""
    if float(warmup_epochs).is_integer():
        ramp = np.linspace(warmup_teacher_temp, teacher_temp, int(warmup_epochs))
        warmup = np.repeat(ramp, niter_per_ep)
    else:
        warmup = np.linspace(warmup_teacher_temp, teacher_temp, int(warmup_epochs * niter_per_ep))
    total = nepochs * niter_per_ep  # a warm-up longer than the run is cut where the run ends
    constant = np.ones(max(total - len(warmup), 0)) * teacher_temp
    return np.concatenate((warmup, constant))[:total]


def get_params_groups(model, no_decay_names=()):
    """AdamW groups: weights; biases, norms, gains and `no_decay_names` (not decayed)."""
    decayed, exempt = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = name.endswith(".bias") or p.ndim == 1 or any(n in name for n in no_decay_names)
        (exempt if no_decay else decayed).append(p)
    return [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]


def clip_gradients(model, clip):
    """The authors' per-parameter clipping (each gradient to norm <= clip), without a host sync."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    norms = torch.stack(torch._foreach_norm(grads, 2))
    factors = (norms + 1e-6).reciprocal() * clip  # what `clip / (norm + 1e-6)` computes
    torch._foreach_mul_(grads, torch.where(factors < 1, factors, 1.0).unbind())
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    """Drop the heads' last-layer gradients in the first `freeze_last_layer` (fractional) epochs."""
    for name, p in model.named_parameters():
        if epoch < freeze_last_layer and "last_layer" in name:
            p.grad = None


@torch.no_grad()
def update_teacher(student, teacher, momentum):
    """EMA over parameters, teacher = m teacher + (1 - m) student, as one multi-tensor operation."""
    s_params = dict(unwrap(student).named_parameters())
    t_names, t_params = zip(*unwrap(teacher).named_parameters())
    torch._foreach_mul_(t_params, momentum)
    torch._foreach_add_(t_params, [s_params[name].detach() for name in t_names], alpha=1 - momentum)


def autocast(device, precision):
    """Mixed-precision context: fp16 (with a grad scaler; on CPUs only for tests), bf16, or fp32."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def make_grad_scaler(device, precision):
    """fp16 gradients can overflow: the scaler skips such a step and lowers its scale."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def unwrap(model):
    """The model inside DDP's wrapper."""
    return model.module if hasattr(model, "module") else model


def all_reduce_sum(t):
    """Collective: the sum of `t` over all processes, as a new tensor (a copy without a group)."""
    t = t.clone()
    if is_dist():
        dist.all_reduce(t)
    return t


def all_gather_objects(obj):
    """Collective: `obj` from every process, in rank order ([obj] without a process group)."""
    out = [obj] * get_world_size()
    if is_dist():
        dist.all_gather_object(out, obj)
    return out


def average_step_stats(losses):
    """Collective, once per step: the step's statistics averaged over the processes, and whether
    any process was asked to stop (a preemption signal), in one all-reduce and one host read.
    A loss that is not finite in any process leaves `stats["loss"]` not finite everywhere."""
    values = [v.detach().float() for v in losses.values()]
    flag = float(preemption_requested(values[0].device))
    preempted = torch.full_like(values[0], flag)  # made on the device: no copy from the host
    sums = all_reduce_sum(torch.stack(values + [preempted]))
    *totals, preempted = sums.tolist()
    stats = {name: total / get_world_size() for name, total in zip(losses, totals)}
    return stats, preempted > 0


# ######## PART B. RUNNING THEM PLAINLY ############################################################
def die(message):
    """Stop with a one-line error for a user mistake (no traceback from deep inside torch)."""
    raise SystemExit(f"error: {message}")


# ======== B1. Data ================================================================================
class BadImageError(RuntimeError):
    """An unreadable image (a loader worker's is raised again by torch, its traceback around it)."""


def load_image(path):
    """Any image as 8-bit RGB (16-bit and float ones rescaled); an unreadable file raises an
    error naming it."""
    try:
        with warnings.catch_warnings(), Image.open(path) as img:
            warnings.simplefilter("error", UserWarning)  # PIL's word for some damage (a cut TIFF)
            ImageFile.LOAD_TRUNCATED_IMAGES = False  # a cut file is unreadable, whatever was set
            img.load()
            if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit / float: to 8 bit
                a = np.asarray(img, dtype=np.float64)
                lo, hi = float(a.min()), float(a.max())
                img = Image.fromarray(((a - lo) * (255.0 / max(hi - lo, 1e-12))).astype(np.uint8))
            elif img.mode == "P" and "transparency" in img.info:  # avoids PIL's palette warning
                img = img.convert("RGBA")
            return img.convert("RGB")
    except Exception as e:  # PIL raises many types for broken files
        raise BadImageError(f"cannot read image {path}: {e}") from None


class ImageFolderSafe(tv_datasets.ImageFolder):
    """ImageFolder with `load_image`. With `skip_bad_images` an unreadable file is replaced by
    the next one and counted; in evaluation (`substitute = False`) it comes labelled SKIPPED."""
    SKIPPED = -1

    def __init__(self, root, skip_bad_images=False):
        super().__init__(root, loader=load_image, is_valid_file=self.is_image_file)
        self.skip_bad_images = skip_bad_images
        self.substitute = True
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
        with contextlib.suppress(OSError):  # unreadable, a broken link: `load_image` names it
            if not stat.S_ISREG(os.stat(path).st_mode):
                return False  # a FIFO or a device: a read could block for ever
        extensions = tv_datasets.folder.IMG_EXTENSIONS
        return not hidden and tv_datasets.folder.has_file_allowed_extension(path, extensions)

    def __getitem__(self, index):
        for attempt in range(len(self)):
            i = (index + attempt) % len(self)
            try:
                return super().__getitem__(i)
            except BadImageError as e:
                if not self.skip_bad_images:
                    hint = "pass --skip_bad_images to skip unreadable files"
                    raise BadImageError(f"{e} ({hint})") from None
                with self.skipped.get_lock():
                    self.skipped.value += 1
                print(f"warning: skipping {e}", file=sys.stderr)
                if not self.substitute:
                    return Image.new("RGB", (1, 1)), self.SKIPPED
        raise BadImageError(f"no readable image in {self.root}")


def skipped_images_all_ranks(dataset, device):
    """Collective: how many unreadable files the (maybe wrapped) dataset skipped, in all ranks."""
    while hasattr(dataset, "base") or hasattr(dataset, "dataset"):  # SeededDataset, Subset
        dataset = getattr(dataset, "base", None) or dataset.dataset
    count = dataset.skipped.value if hasattr(dataset, "skipped") else 0
    return int(all_reduce_sum(torch.tensor([count], device=device)).item())


def read_idx(path):
    """An IDX file of unsigned bytes (MNIST's format), `path.gz` or else `path`, as an array."""
    path = Path(f"{path}.gz") if Path(f"{path}.gz").exists() else Path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        if data[:3] != b"\0\0\x08":
            raise ValueError(f"it starts {data[:4]!r}, not with an IDX header of unsigned bytes")
        shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(data[3])]
        return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * data[3]).reshape(shape)
    except (OSError, EOFError, ValueError) as e:  # missing, truncated, not gzipped, not IDX
        die(f"cannot read {path}: {e}; (re)install dataset-fashion-mnist (apt-get) or give "
            f"--data_path its 4 files")


class FashionMNIST(torch.utils.data.Dataset):
    """Fashion-MNIST from its IDX files (Debian's `dataset-fashion-mnist`), as RGB PIL images."""
    DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
    CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
               "Sneaker", "Bag", "Ankle boot"]

    def __init__(self, root=None, train=True):
        root = Path(root or self.DEFAULT_ROOT)
        prefix = "train" if train else "t10k"
        self.images = read_idx(root / f"{prefix}-images-idx3-ubyte")
        labels = read_idx(root / f"{prefix}-labels-idx1-ubyte")
        if len(labels) != len(self.images):  # e.g. the test split's labels in the train's place
            die(f"{root}'s {prefix} files hold {len(self.images)} images but {len(labels)} labels")
        self.targets = labels.astype(np.int64)
        self.classes = self.CLASSES

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return Image.fromarray(self.images[i], mode="L").convert("RGB"), int(self.targets[i])


class SyntheticShapes(torch.utils.data.Dataset):
    """Procedural labelled images, a pure function of (seed, split, i): 2 to 4 light copies of
    the class's shape over dark noise (what every crop shares is the class)."""
    CLASSES = ["disk", "square", "triangle", "diamond", "plus", "cross", "ring", "hbars", "vbars",
               "checker"]

    def __init__(self, num_images=2000, image_size=64, train=True, seed=0):
        self.n = num_images
        self.size = image_size
        self.seed = seed
        self.split = 0 if train else 1
        self.classes = self.CLASSES
        self.targets = [i % len(self.CLASSES) for i in range(num_images)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng([self.seed, self.split, i])
        s, label = self.size, self.targets[i]
        background = rng.uniform(0, 60) + rng.normal(0, 8, (s, s, 1))
        pixels = np.clip(np.broadcast_to(background, (s, s, 3)), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels)
        draw = ImageDraw.Draw(img)
        for _ in range(rng.integers(2, 5)):
            r = s * rng.uniform(0.12, 0.22)
            cx, cy = rng.uniform(r, s - r, 2)
            self.draw_shape(draw, self.CLASSES[label], cx, cy, r, (int(rng.uniform(150, 255)),) * 3)
        return img, label

    @staticmethod
    def draw_shape(d, name, cx, cy, r, fg):
        """One shape of half-size r centred at (cx, cy)."""
        lw = max(1, int(r / 3))
        bars = [-r + k * 2 * r / 2.5 for k in range(3)]
        rectangles = {"square": [[cx - r, cy - r, cx + r, cy + r]],
                      "plus": [[cx - lw / 2, cy - r, cx + lw / 2, cy + r],
                               [cx - r, cy - lw / 2, cx + r, cy + lw / 2]],
                      "hbars": [[cx - r, cy + a, cx + r, cy + a + lw] for a in bars],
                      "vbars": [[cx + a, cy - r, cx + a + lw, cy + r] for a in bars],
                      "checker": [[cx - r, cy - r, cx, cy], [cx, cy, cx + r, cy + r]]}
        polygons = {"triangle": [(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)],
                    "diamond": [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]}
        for box in rectangles.get(name, []):
            d.rectangle(box, fill=fg)
        if name in polygons:
            d.polygon(polygons[name], fill=fg)
        elif name == "cross":
            d.line([(cx - r, cy - r), (cx + r, cy + r)], fill=fg, width=lw)
            d.line([(cx - r, cy + r), (cx + r, cy - r)], fill=fg, width=lw)
        elif name in ("disk", "ring"):
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg if name == "disk" else None,
                      outline=fg if name == "ring" else None, width=lw if name == "ring" else 1)


DATASETS = ["folder", "synthetic", "fashion_mnist", "cifar10", "cifar100", "svhn"]


def build_dataset(args, train=True):
    """The train or test split of --dataset; with --holdout N, both from the train split: N of its
    images (the last N; of a folder, sorted by class, N drawn with seed 0) and the others."""
    holdout = getattr(args, "holdout", 0)
    if not holdout:
        return named_dataset(args, train)
    full = named_dataset(args, train=True)
    if not 0 < holdout < len(full):
        die(f"--holdout {holdout} must be between 1 and the {len(full)} train images minus one")
    order = list(range(len(full)))
    if isinstance(full, tv_datasets.DatasetFolder):  # sorted by class: the last N, one class
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(0)).tolist()
    kept = order[:len(full) - holdout] if train else order[len(full) - holdout:]
    part = torch.utils.data.Subset(full, sorted(kept))
    part.classes = getattr(full, "classes", None)
    return part


def named_dataset(args, train):
    name = args.dataset
    path = getattr(args, "data_path", None)
    if name == "synthetic":
        if path:  # drawn, not read: a folder beside it would be silently unused
            die(f"--dataset synthetic draws its images; --data_path {path} would be ignored: "
                f"drop it (or --dataset folder)")
        size = args.synthetic_images if train else max(args.synthetic_images // 4, 10)
        return SyntheticShapes(size, args.synthetic_image_size, train=train,
                               seed=args.synthetic_seed)
    if name == "fashion_mnist":
        return FashionMNIST(path, train=train)
    if name in ("cifar10", "cifar100", "svhn"):
        return torchvision_dataset(name, path, train)
    if name != "folder":
        die(f"unknown --dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if not path:
        die("--data_path is required with --dataset folder (one sub-folder per class)")
    root = Path(path)
    if not root.is_dir():
        die(f"--data_path {root} does not exist or is not a directory")
    splits = ["train"] if train else ["val", "test"]
    root = next((root / s for s in splits if (root / s).is_dir()), root if train else None)
    if root is None:
        die(f"no val/ or test/ folder in --data_path {path} for evaluation")
    held = [s for s in ("val", "test") if train and root == Path(path) and (root / s).is_dir()]
    if held:  # the folder itself would be the train split, an evaluation split inside it
        die(f"--data_path {path} has no train/ folder but has {held[0]}/: the train split would "
            f"hold {held[0]}/'s images; put the training images in {Path(path) / 'train'}")
    try:
        return ImageFolderSafe(str(root), skip_bad_images=getattr(args, "skip_bad_images", False))
    except FileNotFoundError as e:
        die(f"no images in {root}: {e}")


def torchvision_dataset(name, path, train):
    """CIFAR-10/100 or SVHN from a local torchvision root: these scripts download nothing."""
    if not path or not Path(path).is_dir():
        die(f"--dataset {name} needs --data_path, a local torchvision root (nothing is downloaded)")
    key, value = ("split", "train" if train else "test") if name == "svhn" else ("train", train)
    try:
        return getattr(tv_datasets, name.upper())(path, **{key: value}, download=False)
    except RuntimeError:  # torchvision's advice, download=True, is no flag of these scripts
        fetch = f"torchvision.datasets.{name.upper()}('{path}', {key}={value!r}, download=True)"
        die(f"{name} is missing or damaged under --data_path {path}: these scripts download "
            f"nothing; fetch it once: python -c \"import torchvision; {fetch}\"")


def build_eval_splits(args):
    """(train, test), the test labels numbered by the train split's class names."""
    train = build_dataset(args, train=True)
    test = build_dataset(args, train=False)
    test_base = getattr(test, "dataset", test)  # (a --holdout Subset's own folder)
    if isinstance(test_base, ImageFolderSafe):
        test_base.substitute = False  # evaluated: unreadable images are left out
    train_classes = getattr(train, "classes", None)
    test_classes = getattr(test, "classes", None)
    if train_classes is not None and len(train_classes) == 1:  # e.g. train/images/*.jpg
        die(f"the train split has one class ({train_classes[0]}): any classifier scores 100%")
    if train_classes is None or test_classes is None or list(train_classes) == list(test_classes):
        return train, test
    unknown = [c for c in test_classes if c not in train_classes]
    if unknown:
        names = ", ".join(unknown[:10]) + " ..." * (len(unknown) > 10)
        die(f"the test split has classes that the train split does not have: {names}")
    if not isinstance(test, tv_datasets.DatasetFolder):
        die("the train and test splits name their classes differently")
    index = [list(train_classes).index(name) for name in test_classes]  # test -> train label
    test.samples = test.imgs = [(path, index[label]) for path, label in test.samples]
    test.targets = [label for _, label in test.samples]
    test.classes = list(train_classes)
    test.class_to_idx = dict(train.class_to_idx)
    log(f"the test split's {len(test_classes)} classes are numbered as the train split's, by name")
    return train, test


def sample_seed(*keys):
    """A well-mixed 63-bit seed from integer keys, e.g. (seed, epoch, index) of one sample."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0] >> 1)


class SeededDataset(torch.utils.data.Dataset):
    """`transform(base[index])` under a seed of (seed, epoch, index) only, whatever the workers,
    processes or resumption: `make_loader` asks for `dataset[(index, epoch)]`."""

    def __init__(self, base, transform, seed=0):
        self.base = base
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        index, epoch = index if isinstance(index, tuple) else (index, self.epoch)
        image, label = self.base[index]
        seed = sample_seed(self.seed, epoch, index)
        # restored: in the main process (num_workers=0) the training loop draws from them too
        py_state = random.getstate()
        np_state = np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            try:
                return self.seeded_transform(image, seed), label
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)

    def seeded_transform(self, image, seed):
        """Seeds torch's CPU generator (not CUDA's), Python's and NumPy's."""
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        return self.transform(image)


def eval_transform(resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """DINO's evaluation transform: Resize(256, bicubic) -> CenterCrop(224) -> normalise."""
    if crop > resize:
        die(f"--crop {crop} is larger than --resize {resize}: the crop would be padded with black")
    return transforms.Compose([
        transforms.Resize(resize, interpolation=TF.InterpolationMode.BICUBIC),
        transforms.CenterCrop(crop), transforms.ToTensor(), transforms.Normalize(mean, std)])


# ======== B2. Processes, devices, loaders and preemption signals ==================================
def is_dist():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist() else 0


def get_world_size():
    return dist.get_world_size() if is_dist() else 1


def is_main_process():
    return get_rank() == 0


def init_distributed(device="auto"):
    """The device; under torchrun (RANK set) a process group (NCCL on GPUs, else gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        die(f"--device {device} is not a device of these scripts; give auto, cpu, cuda or cuda:N")
    if world_size > 1 and re.fullmatch(r"cuda:\d+", device):
        die(f"--device {device} would put all {world_size} processes of this torchrun job on one "
            f"GPU; use --device cuda (or auto): each process takes the GPU of its LOCAL_RANK")
    auto = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    chosen = torch.device({"auto": auto, "cuda": f"cuda:{local_rank}"}.get(device, device))
    if chosen.type == "cuda":
        gpus = torch.cuda.device_count()
        if chosen.index >= gpus:  # no GPU, a cuda:N past the last, or more processes than GPUs
            die(f"--device {device} needs GPU {chosen.index}, but this process sees {gpus} GPUs")
        torch.cuda.set_device(chosen)  # initialises CUDA: `make_loader` knows a run on a GPU so
        # the authors' cuDNN autotuning, and TF32 float32 matmuls as in their torch (1.7-1.8)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if (world_size > 1 or "RANK" in os.environ) and not dist.is_initialized():
        end_with_launcher()
        # 60 minutes: the others wait in a collective while rank 0 alone writes a checkpoint or
        # votes a large k-NN (NCCL's default 10 would end the job); a true hang still ends
        dist.init_process_group(backend="nccl" if chosen.type == "cuda" else "gloo",
                                device_id=chosen if chosen.type == "cuda" else None,
                                timeout=datetime.timedelta(minutes=60))
    return chosen


def end_with_launcher():
    """Linux: a torchrun worker gets SIGTERM when its launcher dies, even by SIGKILL (it would run
    on alone): a preemption, so the step finishes and the checkpoint is written."""
    if sys.platform.startswith("linux") and "TORCHELASTIC_RUN_ID" in os.environ:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def choose_precision(device):
    """What `--precision auto` runs on `device`, and why: native bf16 (GPU or CPU), else on a GPU
    fp16 with a grad scaler (as the authors train), else fp32 (emulated bf16 is much slower)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "this GPU computes in bf16 natively"
        return "fp16", "this GPU has no native bf16: fp16 with a grad scaler, as the authors train"
    if device.type != "cpu":
        return "fp32", f"no mixed-precision rule for {device.type} devices"
    cpu = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    capability = torch.backends.cpu.get_cpu_capability()
    if cpu.get("avx512_bf16") or cpu.get("amx_bf16"):
        return "bf16", f"this CPU has native bf16 (torch CPU capability {capability})"
    return "fp32", (f"this CPU has no native bf16 (torch CPU capability {capability}): emulated "
                    f"bf16 would make a ViT-S/16 step about 25x slower than fp32")


def resolve_precision(precision, device):
    """(the precision to train in, whether --precision auto chose it): `choose_precision`'s pick
    for "auto", logged with its reason."""
    choice, reason = choose_precision(device)
    if precision == "auto":
        log(f"precision: {choice} (--precision auto: {reason})")
        return choice, True
    if precision == "bf16" and device.type == "cpu" and choice != "bf16":
        log(f"warning: --precision bf16: {reason}; --precision auto picks fp32 here")
    return precision, False


def fix_random_seeds(seed):
    """Same seed in every process (DDP also broadcasts the weights of rank 0)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class ResumableSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that starts an epoch at a given batch (a mid-epoch resume); yields
    (index, epoch) pairs with `with_epoch`."""

    def __init__(self, dataset, batch_size, shuffle, seed, drop_last, with_epoch=False):
        super().__init__(dataset, num_replicas=get_world_size(), rank=get_rank(),
                         shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self.start_batch = 0
        self.with_epoch = with_epoch

    def set_epoch(self, epoch, start_batch=0):
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self):
        indices = itertools.islice(super().__iter__(), self.start_batch * self.batch_size, None)
        return ((i, self.epoch) for i in indices) if self.with_epoch else indices

    def __len__(self):
        return max(super().__len__() - self.start_batch * self.batch_size, 0)

    def distinct_samples(self):
        """This process's samples of an epoch that are not padding (repeats come last)."""
        return min(self.num_samples, len(range(self.rank, len(self.dataset), self.num_replicas)))


def make_loader(dataset, batch_size, num_workers, train=True, seed=0):
    """DataLoader ordered by (seed, epoch) only; its own generator leaves the global RNG alone."""
    if train and len(dataset) < batch_size * get_world_size():
        die(f"the dataset has {len(dataset)} images, fewer than one batch ({batch_size} per "
            f"process x {get_world_size()} processes)")
    sampler = ResumableSampler(dataset, batch_size, shuffle=train, seed=seed, drop_last=train,
                               with_epoch=isinstance(dataset, SeededDataset))
    loader = PreemptibleLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
        collate_fn=getattr(dataset, "collate", None),  # device_crops' batches: as they are
        pin_memory=torch.cuda.is_initialized(), drop_last=train,  # pinned: a run on a GPU
        persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(seed),
        worker_init_fn=ignore_preemption_signals)
    return loader, sampler


def crops_on_device(views, device):
    """A loader batch's (crops, geometry) on `device`; a `device_crops` batch is cut there."""
    crops, geometry = views
    if hasattr(crops, "cut"):  # --batched_crops: crops and geometry from one copy (device_crops.py)
        return crops.cut(device)
    geometry = [{k: v.to(device, non_blocking=True) for k, v in g.items()} for g in geometry]
    return [c.to(device, non_blocking=True) for c in crops], geometry


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclasses.dataclass
class Preemption:
    """A preemption signal, for the loop and the watchdog: a step blocked on a read (a hung mount)
    must not outlast it; 300 s of grace is more than a step or a validation takes."""
    signal: str = None  # the name of the signal received, once one is
    grace_seconds: float = 300.0
    checkpoint_reached: threading.Event = dataclasses.field(default_factory=threading.Event)


preemption = Preemption()  # this process's, filled by `install_preemption_handler`


class PreemptibleLoader(torch.utils.data.DataLoader):
    """SLURM and torchrun signal loader workers too, whose death would stop training before the
    checkpoint: workers start with the signals blocked, then ignore them."""

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
    preemption.signal = None
    try:
        preemption.grace_seconds = POSITIVE(os.environ.get("PREEMPTION_GRACE_SECONDS", "300"))
    except argparse.ArgumentTypeError as e:
        die(f"PREEMPTION_GRACE_SECONDS: {e} (seconds, 300 by default)")

    def handler(signum, frame):
        if preemption.signal is None:  # the grace period starts: a checkpoint from now on ends it
            preemption.checkpoint_reached.clear()
            threading.Thread(target=end_unless_checkpointed, daemon=True).start()
        preemption.signal = signal.Signals(signum).name
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, handler)


def end_unless_checkpointed():
    """After a preemption signal, in a thread: end the process in one line if the step has not
    reached the checkpoint within the grace period (the main thread may be blocked where no signal
    reaches it)."""
    if preemption.checkpoint_reached.wait(preemption.grace_seconds):
        return
    message = (f"error: received {preemption.signal}, but the step did not reach its checkpoint "
               f"within {preemption.grace_seconds:g} s (a read that never returns?); the last "
               f"checkpoint, if any, is kept: run the same command again to resume")
    bar = bool(getattr(tqdm, "_instances", ()))  # a progress bar's line is open: end it
    print("\n" * bar + message, file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():  # loader workers ignore SIGTERM
        child.kill()
    os._exit(1)


def preemption_requested(device=None):
    """Whether this process received a preemption signal (tests replace it)."""
    return preemption.signal is not None


def exit_after_preemption(output_dir, checkpoint="checkpoint.pth"):
    """Collective: say where the checkpoint is, wait for rank 0 to have written it, exit 0."""
    preemption.checkpoint_reached.set()
    close_progress_bars()
    log(f"received {preemption.signal or 'a preemption signal'}: checkpoint written to "
        f"{Path(output_dir) / checkpoint}; run the same command again to resume")
    if is_dist():  # a process that exits first makes torchrun stop rank 0 in mid-write
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(0)


def end_loader_workers():
    """At exit, SIGKILL loader workers still alive (they ignore multiprocessing's SIGTERM)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def close_progress_bars(end_line=False):
    """Close open progress bars; `end_line`: also end a line that a signal cut short."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    print(end="\n" if end_line else "", file=sys.stderr, flush=True)


# ======== B3. Checkpoints and resume ==============================================================
def rng_state():
    """This process's RNG states (CUDA's: its GPU's), in types that `weights_only` accepts."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    cuda = []
    if torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(torch.cuda.current_device())
    return {"torch": torch.get_rng_state(), "cuda": cuda,
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                      *map(float, np_state[2:])],
            "python": [py_state[0], list(py_state[1]), py_state[2]]}


def set_rng_state(state):
    """Restore what `rng_state` saved (from a list of CUDA states, this GPU's)."""
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, (list, tuple)):
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None and len(cuda) and torch.cuda.is_initialized():  # a CPU run: GPUs untouched
        torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))


def open_for_writing(path, mode="w"):
    """A file opened to write ("w", "wb") or append ("a"), its folder made: never a link, FIFO,
    device or folder in its place (`refuse_irregular`; one planted since fails: O_NOFOLLOW)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_irregular(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(path, flags | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC), 0o644)
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode)


def refuse_irregular(path):
    """Stop in one line if `path` is a symbolic link, a folder, a FIFO or a device."""
    with contextlib.suppress(FileNotFoundError):
        kind = os.lstat(path).st_mode
        if stat.S_ISLNK(kind):
            die(f"{path} is a symbolic link: these scripts never write through one; remove it")
        if not stat.S_ISREG(kind):
            die(f"{path} is not a regular file: these scripts write only regular files; remove it")


def save_checkpoint(state, path):
    """Write atomically (temporary file, fsync, rename): a crash leaves the old or new file, and
    at most the temporary file, which the next save of `path` writes over (one writer a folder)."""
    path = Path(path)
    refuse_irregular(path)  # a link is not replaced unseen
    preemption.checkpoint_reached.set()  # a preempted step's grace period ends here
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open_for_writing(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch's writer wraps a full disk's OSError
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), None)
        if cause is None:
            raise
        kept = f"the previous {path.name} is kept" if path.exists() else "none written"
        die(f"cannot write {path}: {cause.strerror or cause} ({kept})")
    finally:
        with contextlib.suppress(OSError):  # a read-only file system: nothing to remove
            tmp.unlink(missing_ok=True)  # only left over when the write failed


# `weights_only` loading allows, by name, the argparse.Namespace and numpy scalars (float64 lr) of
# the authors' main_dino.py, under numpy 1's and 2's module paths; nothing else
SCALAR = np.float64(0).__reduce__()[0]  # numpy's multiarray.scalar, which rebuilds a scalar
SAFE_GLOBALS = [argparse.Namespace, np.dtype, *{type(np.dtype(c)) for c in "?bhilqBHILQefdg"},
                *[(SCALAR, f"numpy.{m}.multiarray.scalar") for m in ("core", "_core")]]


def load_checkpoint(path, what="checkpoint", remedy=""):
    """A checkpoint loaded with `weights_only` (no code runs), or one line saying why not."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO's read would block
        die(f"{what} {path} is not a regular file (a folder, a FIFO or a device){remedy}")
    try:
        with open(path, "rb") as f:
            start = f.read(2)
        if start in (b"PK", b"\x80\x02"):  # torch.save's zip archive, or a pickle (before 1.6)
            check_archive(path, what, remedy)
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:  # the file system's reason: no permission
        die(f"{what} {path} cannot be read: {e.strerror or e}{remedy}")
    except pickle.UnpicklingError:  # an object that could run code: named, never torch's advice
        unsafe = ["an object"]
        with contextlib.suppress(Exception), torch.serialization.safe_globals(SAFE_GLOBALS):
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path) or unsafe
        die(f"{what} {path} holds {', '.join(unsafe)} beyond tensors and plain values: refused "
            f"unread, as loading it could run code; give a file written by these scripts{remedy}")
    except Exception as e:  # torch's reason: a cut-off write?
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        die(f"{what} {path} cannot be read (truncated?): {reason}{remedy}")
    if not start:
        die(f"{what} {path} is empty (0 bytes){remedy}")
    die(f"{what} {path} is not a PyTorch file (it starts {start!r}){remedy}")


def check_archive(path, what, remedy):
    """torch.load does not check a zip archive's CRCs: flipped bits in a tensor load silently."""
    with contextlib.suppress(zipfile.BadZipFile, EOFError):  # not whole: torch.load says why
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged:
            die(f"{what} {path} is damaged: the checksum of its entry {damaged} fails (bits "
                f"changed on the disk or in a copy){remedy}")


def load_state_dict_strict(module, state_dict, what="model"):
    """Strict loading, with one readable line instead of torch's wall of key names."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    bad_shape = [f"{k}: {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}" for k in own
                 if k in state_dict and state_dict[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        def first_five(keys):
            return ", ".join(keys[:5]) + (f" ... (+{len(keys) - 5})" if len(keys) > 5 else "")
        die(f"{what} does not match the checkpoint (another --arch, --patch_size or head size?). "
            f"missing: [{first_five(missing)}] unexpected: [{first_five(unexpected)}] "
            f"shape: [{first_five(bad_shape)}]")
    module.load_state_dict(state_dict, strict=True)


def restore(checkpoint, **objects):
    """Load each named object from `checkpoint` (modules strictly; a grad scaler as fits)."""
    for name, obj in objects.items():
        if name not in checkpoint:
            die(f"checkpoint has no {name!r} entry (written by another script?)")
        if isinstance(obj, nn.Module):
            load_state_dict_strict(unwrap(obj), checkpoint[name], what=name)
        elif isinstance(obj, torch.amp.GradScaler) and obj.is_enabled() != bool(checkpoint[name]):
            new = (f"without a grad scaler; this run trains in fp16, whose grad scaler starts at "
                   f"scale {obj.get_scale():g}" if obj.is_enabled() else  # a new scaler
                   f"with a grad scaler (scale {checkpoint[name]['scale']:g}); this run needs none "
                   f"and drops it")
            log(f"precision: the checkpoint was trained in {checkpoint['args']['precision']} {new}")
        else:
            obj.load_state_dict(checkpoint[name])


def checkpoint_to_resume(output_dir):
    """Collective: --output_dir's checkpoint.pth, or None for a fresh start."""
    path = Path(output_dir) / "checkpoint.pth"
    return agree_on_resume(path, load_checkpoint(path) if path.exists() else None)


def agree_on_resume(path, ckpt):
    """Collective: rank 0 decides whether the job resumes; a process that cannot read the
    checkpoint rank 0 resumes from (an --output_dir not shared between nodes) stops the job."""
    found = (ckpt.get("epoch"), ckpt.get("step")) if ckpt is not None else None
    views = all_gather_objects((found, socket.gethostname()))
    if views[0][0] is None:
        return None  # a fresh start: another node's old file is not read
    for rank, (theirs, host) in enumerate(views):
        if theirs != views[0][0]:
            saw = f"it sees epoch {theirs[0]}, step {theirs[1]}" if theirs else "it finds no file"
            die(f"process {rank} (host {host}) cannot read the {path} that process 0 resumes from "
                f"(epoch {views[0][0][0]}, step {views[0][0][1]}; {saw}): give every node one "
                f"--output_dir on a shared file system (an absolute path)")
    return ckpt


def resume_position(ckpt, output_dir):
    """(epoch, step) to go on from ((0, 0) without a checkpoint); log.txt is kept to the lines of
    the epochs that the checkpoint holds (a cut line, an epoch trained again, are dropped)."""
    epoch, step = (ckpt["epoch"], ckpt["step"]) if ckpt is not None else (0, 0)
    if is_main_process():
        keep_log_records(Path(output_dir) / "log.txt", epoch)
    return epoch, step


def keep_log_records(path, epochs_done):
    """Rewrite `path` without its lines that are cut or of epochs >= epochs_done."""
    refuse_irregular(path)  # a FIFO's read would block
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        with contextlib.suppress(ValueError, TypeError):  # not JSON, or an odd epoch
            record = json.loads(line) if line.endswith("\n") else None
            if isinstance(record, dict) and record.get("epoch", -1) < epochs_done:
                kept.append(line)
    if kept != lines:
        log(f"{path}: {len(lines) - len(kept)} line(s) dropped (cut, or of an epoch that no "
            f"checkpoint holds)")
        tmp = path.with_name(f".{path.name}.tmp")
        with open_for_writing(tmp) as f:
            f.write("".join(kept))
        os.replace(tmp, path)  # atomically


def changed_args(recorded, args, ignored):
    """Each argument that differs from the `recorded` ones, as `--k old (now new)`."""
    old = json.loads(json.dumps(recorded, default=str))  # tuples as lists
    new = json.loads(json.dumps(vars(args), default=str))
    changed = [k for k in sorted(old.keys() & new.keys()) if k not in ignored and old[k] != new[k]]
    return [f"{old[k]} process{'es' * (old[k] != 1)} (now {new[k]}: another total batch, and peak "
            f"lr)" if k == "world_size" else f"--{k} {old[k]} (now {new[k]})" for k in changed]


def dataset_record(dataset):
    """A training set's image count and a fingerprint of its classes, paths and labels."""
    if hasattr(dataset, "data_record"):
        return dataset.data_record
    indices = range(len(dataset))
    base = dataset
    while isinstance(base, (torch.utils.data.Subset, SeededDataset)):
        if isinstance(base, SeededDataset):
            base = base.base
        else:
            indices = [base.indices[i] for i in indices]
            base = base.dataset
    if hasattr(base, "samples"):
        entries = [f"{os.path.relpath(base.samples[i][0], base.root)}\t{base.samples[i][1]}"
                   for i in indices]
    else:
        labels = getattr(base, "targets", None)
        labels = getattr(base, "labels", None) if labels is None else labels
        entries = [] if labels is None else [str(int(labels[i])) for i in indices]
    text = "\n".join([type(base).__name__, *map(str, getattr(base, "classes", None) or []),
                      *entries])
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
    dataset.data_record = {"images": len(dataset), "fingerprint": fingerprint}
    return dataset.data_record


# ======== B4. Logging, the shared arguments, the entry point ======================================
def log(*message):
    if is_main_process():
        print(*message, flush=True)


def progress(iterable, desc, total=None):
    return tqdm(iterable, desc=desc, total=total, disable=not is_main_process(),
                dynamic_ncols=True, mininterval=1.0)


def peak_memory_mb(device):
    """Peak GPU memory allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def append_log(output_dir, record):
    """One JSON line in --output_dir/log.txt (rank 0)."""
    if is_main_process():
        with open_for_writing(Path(output_dir) / "log.txt", "a") as f:
            f.write(json.dumps(record) + "\n")


def make_folder(path, flag):
    """Create the folder that `flag` names, or stop in one line."""
    if not str(path).strip():  # e.g. an unset shell variable: never the current folder
        die(f"{flag} is empty; give a folder name")
    try:
        if Path(path).exists() and not Path(path).is_dir():
            die(f"{flag} {path} is a file, not a folder; give a folder name")
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        die(f"cannot create {flag} {path}: {e.strerror or e}")


def save_args(args, script):
    """--output_dir/args.json: the arguments, and the script they are for."""
    if is_main_process():
        with open_for_writing(Path(args.output_dir) / "args.json") as f:
            json.dump({"script": script, **vars(args)}, f, indent=2)


def bool_flag(s):
    if s.lower() not in ("1", "true", "on", "yes", "0", "false", "off", "no"):
        raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")
    return s.lower() in ("1", "true", "on", "yes")


def ranged(kind, low=-math.inf, high=math.inf, low_open=False):
    """An argparse type: a finite number of `kind` in [low, high] (low excluded if low_open)."""
    bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high == math.inf else ']'}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        inside = (low < value if low_open else low <= value) and value <= high  # NaN: outside
        problem = number_problem(kind, value)
        if not inside or not math.isfinite(value):
            problem = f"is out of range: expected a value in {bounds}"
        if problem:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value
    parse.__name__ = f"{kind.__name__} in {bounds}"
    return parse


def number_problem(kind, value):
    """What the libraries cannot hold, whatever the flag's range: an integer past int32 (torch's
    and numpy's sizes, seeds, counts), a float that float32 (the networks') rounds to 0 or inf."""
    f32 = np.finfo(np.float32)
    if kind is int and value > 2 ** 31 - 1:
        return f"is too large: expected at most {2 ** 31 - 1} (a 32-bit integer)"
    if kind is float and value and not f32.tiny <= np.float64(abs(value)) <= f32.max:
        return (f"is out of float32's range, where it would be {'inf' if abs(value) > 1 else '0'}: "
                f"expected a size from {f32.tiny:.3g} to {f32.max:.3g}")
    return ""


POSITIVE_INT = ranged(int, 1)  # sizes, batches
COUNT = ranged(int, 0)  # 0 allowed: "none" or "off"
EPOCHS = ranged(int, 1, 10_000)  # the schedules hold a value per step (DINO's longest: 800)
POSITIVE = ranged(float, 0, low_open=True)  # temperatures
NONNEGATIVE = ranged(float, 0)  # learning rates, weight decay, loss weights
FRACTION = ranged(float, 0, 1)  # momenta, probabilities, rates
AREA_FRACTION = ranged(float, 0, 1, low_open=True)  # crop scales
PIXELS = ranged(int, 1, 2048)  # image and crop sides
GRID = ranged(int, 1, 64)  # patch and window sides
SPAN = ranged(float, 0, 10_000)  # warm-ups in epochs (as long as --epochs can be)


def add_backbone_args(parser, arch="vit_small", drop_path_rate=0.1):
    g = parser.add_argument_group("backbone")
    g.add_argument("--arch", default=arch, choices=list(ARCHS),
                   help="ViT (DINO Table 8) or Swin (EsViT Table 6); *_pico: tiny CPU test models")
    g.add_argument("--patch_size", default=16, type=GRID,
                   help="ViT patch size: 16 or 8 (better, much slower), or a divisor of small "
                        "crops (4 at 32 px)")
    g.add_argument("--window_size", default=7, type=GRID, help="Swin window size (7 or 14)")
    g.add_argument("--fit_window", default=False, type=bool_flag,
                   help="small images: per Swin stage the largest window <= --window_size that "
                        "tiles every crop's grid")
    g.add_argument("--drop_path_rate", default=drop_path_rate, type=FRACTION,
                   help="stochastic depth of the student")
    return g


def add_multicrop_args(parser, global_crops_scale=(0.4, 1.0), local_crops_scale=(0.05, 0.4),
                       local_crops_number=8):
    g = parser.add_argument_group("multi-crop augmentation")
    g.add_argument("--global_crops_scale", type=AREA_FRACTION, nargs=2, default=global_crops_scale,
                   help="area range of the 2 global crops (DINO: (0.14, 1) without local crops)")
    g.add_argument("--local_crops_number", type=ranged(int, 0, 64), default=local_crops_number,
                   help="number of small local crops (0 disables multi-crop)")
    g.add_argument("--local_crops_scale", type=AREA_FRACTION, nargs=2, default=local_crops_scale,
                   help="area range of the local crops")
    g.add_argument("--global_crop_size", type=PIXELS, default=224, help="pixels")
    g.add_argument("--local_crop_size", type=PIXELS, default=96, help="pixels")
    return g


def add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="folder", choices=DATASETS,
                   help="folder = an ImageFolder at --data_path; synthetic = procedural shapes")
    g.add_argument("--data_path", default=None, type=str,
                   help="image folder, or a dataset's local root")
    g.add_argument("--synthetic_images", default=2000, type=ranged(int, 1, 10 ** 7),
                   help="size of the synthetic train split")
    g.add_argument("--synthetic_image_size", default=64, type=PIXELS,
                   help="side of synthetic images (pixels)")
    g.add_argument("--synthetic_seed", default=0, type=COUNT, help="which synthetic set to draw")
    g.add_argument("--holdout", default=0, type=COUNT,
                   help="a validation split: N train images (the last N; of a folder, sorted by "
                        "class, N drawn with seed 0) are the test split, the others the train "
                        "split (training and the k-NN bank), so settings are chosen without the "
                        "test set")
    g.add_argument("--skip_bad_images", action="store_true",
                   help="skip (log and count) unreadable images, not stop")
    g.add_argument("--num_workers", default=10, type=ranged(int, 0, 256),
                   help="data loader processes per GPU/process")
    return g


def add_head_size_args(group):
    """The DINO head's MLP sizes (the authors' 2048 / 256; smaller for tiny CPU backbones)."""
    group.add_argument("--head_hidden_dim", default=2048, type=ranged(int, 1, 8192),
                       help="width of the head's hidden MLP layers")
    group.add_argument("--head_bottleneck_dim", default=256, type=ranged(int, 1, 8192),
                       help="width of the l2-normalised bottleneck before the K-way last layer")


def add_run_args(parser, saveckp_freq=20):
    g = parser.add_argument_group("run")
    g.add_argument("--output_dir", default=f"runs/{Path(parser.prog).stem}", type=str,
                   help="checkpoints and logs; a run resumes from here; one run at a time (.lock)")
    g.add_argument("--allow_changed_args", action="store_true",
                   help="resume although what is trained, or the dataset (then from the epoch's "
                        "start), changed")
    g.add_argument("--saveckp_freq", default=saveckp_freq, type=COUNT,
                   help="keep a copy every N epochs")
    g.add_argument("--seed", default=0, type=COUNT,
                   help="seeds weights, data order and augmentations")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when present), cpu, cuda, or cuda:N (one process; torchrun: "
                        "LOCAL_RANK's GPU)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="autocast dtype. auto: bf16 where the GPU or CPU has native bf16, fp16 "
                        "with a grad scaler on older GPUs (as the authors), else fp32; the choice "
                        "is logged. On CUDA fp32 uses TF32")
    g.add_argument("--save_every_iters", default=0, type=COUNT,
                   help="also write checkpoint.pth every N steps (long epochs; resumes at the "
                        "next unseen batch)")
    g.add_argument("--max_steps_per_epoch", default=0, type=COUNT,
                   help="stop each epoch after N steps (0: full epoch)")
    return g


def run_script(main, parser, argv=None):
    """Every script's entry point: `main(args)`, then the process group left (gloo's threads can
    abort an exiting process)."""
    atexit.register(end_loader_workers)  # after multiprocessing's exit handler: runs before it
    main(parser.parse_args(argv))
    if is_dist():
        dist.destroy_process_group()


