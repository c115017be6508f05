"""DRLoc: dense relative localization as an auxiliary loss of supervised training (Liu et al.,
"Efficient Training of Visual Transformers with Small-Size Datasets", NeurIPS 2021).

The loss is `DRLocLoss`, the model `DRLoc` (backbone + classifier + `LocalizationMLP`). DRLoc is not
built on DINO: the file keeps the same layout (arguments, loss, model, train_one_epoch, main), but
`diff dino.py drloc.py` shows a supervised loop rather than an addition.

Idea. A vision transformer trained from scratch on a small labelled set lacks the locality bias
of a CNN. DRLoc adds a pretext task to ordinary supervised training: from the final k x k grid of
token embeddings of each image, sample m random pairs of tokens and ask a small MLP to predict,
from the two embeddings alone, how far apart they are on the grid (rows and columns). It is not
a self-supervised method on its own: it needs no second view and no teacher, only one extra MLP
over the embeddings of the same forward pass, and it regularises the cross-entropy training.

Loss (paper Eq. 1-2 and Table 1b, as the authors' code computes it). For a pair of grid positions
a = (i, j) and b = (p, h) of an image, with embeddings e_a, e_b and Delta = a - b:

    target t = |Delta|                     ("abs", the published recipe)
             = Delta + (k - 1)             ("signed", the paper's L*; shifted to 0 .. 2k-2)
    l1:   L_drloc = mean over the B*m pairs and the 2 axes of |t - f(cat(e_a, e_b))|
    ce:   L_drloc = sum over the 2 axes of mean_pairs CE(f_axis(e_a, e_b), t_axis)
    reg:  L_drloc = sum over the 2 axes of mean_pairs (t - mu)^2 / s2 + 0.001 log s2      (Eq. 6)
          with beta = softmax(f_axis), mu = sum_c beta_c c, s2 = sum_c beta_c (c - mu)^2 + 1e-8
    all:  the l1 loss with one MLP per Swin stage output, summed over stages              (Eq. 7)
    exh:  the l1 loss over every token once, each with a random partner              (appendix C)

    L = L_ce(logits, mixup/cutmix soft labels) + lambda(epoch) * L_drloc

Where the paper's text and the authors' code differ, this file follows the code:
  * targets are integer grid offsets, not divided by k (Eq. 1, 3), and the L1 is a mean over both
    coordinates, not their sum: the loss scale differs from Eq. 2 by k/2, and lambda = 0.5 (Swin;
    0.1 for T2T/CvT) is tuned for the code's scale. `--drloc_normalize` gives normalised targets as
    the code's (unused) path computes them: abs / (k-1) and (Delta + k-1) / (2(k-1)), both in
    [0, 1] (Eq. 1's / k would stop short of 1);
  * the signed targets are shifted by k-1, and ce / reg classify over 0 .. k-1 (abs) or 0 .. 2k-2
    (signed) offsets: k or 2k-1 classes, not the paper's 2k+1 over {-k .. k};
  * reg (the code's "cbr") regularises with 0.001 log sigma^2 (Eq. 6: alpha log sigma);
  * lambda is warmed up linearly from 0 over 20 epochs, then decays linearly towards 0 at the end
    of training (the paper: constant). Here the schedule spans the epochs actually run (the
    authors' loop stops at epoch 101 while its schedule assumes 300);
  * the DRLoc grid is Swin's last-stage output *before* the final LayerNorm; "all" takes every
    stage's output *after* its patch merging (the official layout merges at the end of a stage),
    plus the last stage: at 224 px, Swin-T grids of 28, 14, 7 and 7;
  * ViT grids are average-pooled with AvgPool2d(3, stride 2, padding 1, count_include_pad=False)
    (the paper: "2 x 2 average pooling"; the T2T code pools its post-norm grid, here every backbone
    uses the pre-norm grid);
  * the supervised recipe is Swin's: AdamW, lr 5e-4 x batch / 512, weight decay 0.05 (not on
    biases, norms and position tables), global-norm gradient clipping 5.0, RandAugment, random
    erasing 0.25, Mixup 0.8 / CutMix 1.0 with label smoothing 0.1, LayerNorm eps 1e-5.
Where this file departs from the authors' code:
  * a ViT grid is always pooled (14 x 14 -> 7 x 7 at 224 px), where the authors' ViT-B uses its
    unpooled 14 x 14 grid;
  * the lr follows its cosine down to --min_lr over --epochs, where the authors' 100-epoch runs
    stop a 300-epoch schedule at epoch 100 (about 0.75 x the peak lr at the end);
  * the authors train in fp32 (apex `--amp-opt-level O0`, their default); here the precision is
    `--precision`'s choice (`--precision fp32` is theirs).
Other choices of this file: the pairs are gathered with one tensor index, not a loop over images;
the exhaustive partners come from an argsort of uniform noise (a random permutation per image); the
pairs of a step come from a generator seeded by (seed, epoch, step), drawn for the images of all
processes, each keeping its rows: an image gets the same pairs with 1 or n processes and after a
resume (the draw is the authors' pair of randint calls); the lr warms up from 5e-7 x batch / 512
and then follows `common.cosine_scheduler` over the remaining iterations (the Swin code's timm
scheduler runs its cosine over all iterations, warmup included, and their loop updates the lr after
each step, so their step s uses the schedule's value at s - 1: the warm-up start twice;
tests/test_trajectories.py shows both facts); `--lambda_drloc 0` builds no DRLoc head at all: the
plain supervised baseline.
"""
import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageOps
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.models import swin_transformer, vision_transformer

import checks
import common


# ================================================================================================
# Arguments (defaults: the paper's Swin-T recipe, Swin's training code where the paper is silent)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("drloc.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_backbone_args(p, arch="swin_tiny", drop_path_rate=0.2)

    g = p.add_argument_group("DRLoc loss")
    g.add_argument("--lambda_drloc", default=0.5, type=common.NONNEGATIVE,
                   help="weight of L_drloc: 0.5 for Swin, 0.1 for T2T/CvT-like models; 0 = plain "
                        "supervised baseline")
    g.add_argument("--lambda_schedule", default="warmup_decay",
                   choices=["warmup_decay", "constant"],
                   help="warmup_decay (the authors' code): linear 0 -> lambda over "
                        "--lambda_warmup_epochs, then linear decay towards 0 at the last epoch; "
                        "constant: the paper's text")
    g.add_argument("--lambda_warmup_epochs", default=20, type=common.ranged(int, 0, 10_000),
                   help="epochs of lambda warmup (warmup_decay)")
    g.add_argument("--drloc_mode", default="l1", choices=["l1", "ce", "reg", "all", "exh"],
                   help="l1 (best in the paper), ce (classify offsets), reg (Gaussian-prior "
                        "regression, Eq. 6), all (one l1 head per Swin stage; below the baseline "
                        "in the paper), exh (every token once with a random partner, m = k^2)")
    g.add_argument("--drloc_targets", default="abs", choices=["abs", "signed"],
                   help="abs |Delta| (the published recipe) or signed Delta + k - 1 (the paper's "
                        "L*, worse)")
    g.add_argument("--drloc_pairs", default=64, type=common.ranged(int, 1, 4096),
                   help="m, pairs per image (the paper: 64 beats 32, 128 and 256 on CIFAR-100)")
    g.add_argument("--drloc_normalize", default=False, type=common.bool_flag,
                   help="normalised targets in [0, 1] (l1 modes only) instead of the code's "
                        "integer offsets: divided by k-1 (abs) or 2(k-1) (signed), and so is the "
                        "loss; retune --lambda_drloc")

    g = p.add_argument_group("supervised training")
    g.add_argument("--input_size", default=224, type=common.PIXELS,
                   help="image side in pixels; the paper resizes every dataset to 224 (Swin: "
                        "7 x 7 final grid)")
    g.add_argument("--pretrained", default="", type=str,
                   help="backbone weights to fine-tune from (timm or official Swin keys); the "
                        "paper gives no fine-tuning lr and the authors' script has one recipe: the "
                        "defaults apply")
    g.add_argument("--aa", default="rand-m9-mstd0.5-inc1", type=str,
                   help="timm RandAugment policy ('' = none)")
    g.add_argument("--reprob", default=0.25, type=common.FRACTION, help="random erasing rate")
    g.add_argument("--mixup", default=0.8, type=common.NONNEGATIVE,
                   help="mixup alpha (0 with --cutmix 0 = no mixing)")
    g.add_argument("--cutmix", default=1.0, type=common.NONNEGATIVE, help="cutmix alpha")
    g.add_argument("--smoothing", default=0.1, type=common.FRACTION, help="label smoothing")
    g.add_argument("--train_subset", default=0, type=common.COUNT,
                   help="train on the first N images only (0 = all)")
    g.add_argument("--val_subset", default=0, type=common.COUNT,
                   help="validate on the first N images only (0 = all)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size_per_gpu", default=128, type=common.POSITIVE_INT,
                   help="images per process (the paper: 1024 in total)")
    g.add_argument("--epochs", default=100, type=common.EPOCHS,
                   help="training epochs (the paper's from-scratch and fine-tuning runs: 100)")
    g.add_argument("--lr", default=5e-4, type=common.NONNEGATIVE,
                   help="peak lr at total batch 512 (linear scaling)")
    g.add_argument("--warmup_lr", default=5e-7, type=common.NONNEGATIVE,
                   help="lr at the first step, at total batch 512")
    g.add_argument("--min_lr", default=5e-6, type=common.NONNEGATIVE,
                   help="lr at the end of the cosine, at total batch 512")
    g.add_argument("--warmup_epochs", default=20, type=common.ranged(int, 0, 10_000),
                   help="linear lr warmup (from scratch 20, fine-tuning 10)")
    g.add_argument("--weight_decay", default=0.05, type=common.NONNEGATIVE,
                   help="AdamW weight decay (not on biases, norms and position tables)")
    g.add_argument("--clip_grad", default=5.0, type=common.NONNEGATIVE,
                   help="global gradient-norm clip (0 = off)")

    common.add_data_args(p)
    common.add_run_args(p, saveckp_freq=20)
    return p


# ================================================================================================
# Loss
# ================================================================================================
def sample_pairs(batch, k, m, generator=None):
    """m pairs per image, both positions uniform over the k x k grid with replacement (self-pairs
    allowed): pos_a, pos_b [B, m, 2] (row, col), from two randint calls as the authors' code."""
    return (torch.randint(k, (batch, m, 2), generator=generator),
            torch.randint(k, (batch, m, 2), generator=generator))


def exhaustive_pairs(batch, k, generator=None):
    """Appendix C: every position once, in raster order, against a random partner (a random
    permutation of the grid per image): pos_a, pos_b [B, k*k, 2]."""
    raster = torch.arange(k * k).expand(batch, -1)
    partner = torch.rand(batch, k * k, generator=generator).argsort(dim=1)
    return torch.stack([raster // k, raster % k], -1), torch.stack([partner // k, partner % k], -1)


def pair_generator(seed, epoch, step):
    """The CPU generator of a step's pairs, of (seed, epoch, step) only (the trailing 1 keeps it
    apart from the augmentation's per-sample seeds)."""
    return torch.Generator().manual_seed(common.sample_seed(seed, epoch, step, 1))


def relative_targets(pos_a, pos_b, k, signed=False, normalize=False):
    """[B*m, 2] float targets (row axis, column axis) of the pairs: |Delta| or Delta + k - 1,
    optionally normalised to [0, 1] by k - 1 or 2(k - 1)."""
    delta = (pos_a - pos_b).reshape(-1, 2).float()
    target = delta + (k - 1) if signed else delta.abs()
    if normalize:
        target = target / ((2 if signed else 1) * (k - 1))
    return target


class DRLocLoss(nn.Module):
    """L = L_ce + lambda * sum over DRLoc heads of L_drloc (each mode: the module docstring); hard
    labels give a (label-smoothed) cross-entropy, mixup's soft labels a soft-target one."""

    def __init__(self, mode="l1", signed=False, normalize=False, smoothing=0.1):
        super().__init__()
        self.criterion = mode if mode in ("ce", "reg") else "l1"     # "all" and "exh" are l1 losses
        self.signed = signed
        self.normalize = normalize
        self.smoothing = smoothing
        self.soft_cross_entropy = SoftTargetCrossEntropy()

    def forward(self, outputs, labels, lambda_drloc):
        logits = outputs["logits"].float()
        if labels.is_floating_point():
            loss_ce = self.soft_cross_entropy(logits, labels.float())
        else:
            loss_ce = F.cross_entropy(logits, labels, label_smoothing=self.smoothing)
        loss_drloc = logits.new_zeros(())
        for head in outputs["drloc"]:
            target = relative_targets(head["pos_a"], head["pos_b"], head["k"], self.signed,
                                      self.normalize)
            target = target.to(logits.device, non_blocking=True)
            loss_drloc = loss_drloc + self.localization_loss(head["pred"].float(), target)
        return {"loss": loss_ce + lambda_drloc * loss_drloc, "L_ce": loss_ce, "L_drloc": loss_drloc}

    def localization_loss(self, pred, target):
        """pred [N, 2] (l1) or [N, classes, 2] logits (ce, reg); target [N, 2]."""
        if self.criterion == "l1":
            return (pred - target).abs().mean()
        if self.criterion == "ce":
            return F.cross_entropy(pred, target.long(), reduction="none").mean(dim=0).sum()
        beta = pred.softmax(dim=1)                                        # [N, classes, 2]
        classes = torch.arange(pred.shape[1], device=pred.device, dtype=pred.dtype)[:, None]
        mu = (beta * classes).sum(dim=1)                                  # [N, 2]
        var = (beta * (classes - mu[:, None]) ** 2).sum(dim=1) + 1e-8
        return ((target - mu) ** 2 / var + 0.001 * var.log()).mean(dim=0).sum()


# ================================================================================================
# Model: backbone + linear classifier + localization MLP(s) on the pre-norm grid(s)
# ================================================================================================
class LocalizationMLP(nn.Module):
    """f(e_a, e_b) on cat(e_a, e_b): Linear(2D, 512)-ReLU-Linear(512, 512)-ReLU-Linear(512, o)
    (paper Table 8). l1: o = 2 offsets (row, column). ce / reg: the third Linear is 512 wide, with
    no activation after it, and feeds one Linear(512, classes) per axis: logits [N, classes, 2]."""

    def __init__(self, in_dim, classes=None):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * in_dim, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, 512 if classes else 2))
        self.axis_heads = (nn.ModuleList([nn.Linear(512, classes) for _ in range(2)])
                           if classes else None)

    def forward(self, pairs):
        h = self.mlp(pairs)
        return (h if self.axis_heads is None
                else torch.stack([head(h) for head in self.axis_heads], dim=-1))


def swin_init(module):
    """Swin's init of every Linear, the DRLoc MLPs' too (the authors'): N(0, 0.02) truncated, 0."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    return module


def gather_pairs(grid, pos_a, pos_b):
    """cat(e_a, e_b) [B, m, 2D] at (row, col) positions pos_a, pos_b [B, m, 2] of [B, h, w, D]."""
    b = torch.arange(len(grid), device=grid.device)[:, None]
    pos_a, pos_b = (p.to(grid.device, non_blocking=True) for p in (pos_a, pos_b))
    return torch.cat([grid[b, pos_a[..., 0], pos_a[..., 1]],
                      grid[b, pos_b[..., 0], pos_b[..., 1]]], dim=-1)


class DRLoc(nn.Module):
    """The classifier (Swin: final-norm tokens averaged; ViT: final-norm CLS; then a Linear) and,
    in training, one localization MLP per DRLoc grid with its pairs, drawn from `generator`
    (`positions`, a list of (pos_a, pos_b) per head, replaces the draw, for tests). forward returns
    {"logits": [B, classes], "drloc": [{"pred", "pos_a", "pos_b", "k"} per head]}."""

    def __init__(self, backbone, num_classes, mode="l1", pairs=64, heads=()):
        super().__init__()
        self.backbone = backbone
        self.mode = mode
        self.pairs = pairs
        self.pool = (None if isinstance(backbone, common.Swin)
                     else nn.AvgPool2d(3, 2, 1, count_include_pad=False))
        self.head = swin_init(nn.Linear(backbone.num_features, num_classes))
        self.drloc = nn.ModuleList([swin_init(LocalizationMLP(dim, classes))  # one per grid
                                    for dim, classes in heads])

    def features(self, images):
        """Global feature [B, D] and the DRLoc grids [B, k, k, D] (taken before the final norm)."""
        if self.mode == "all":                           # every Swin stage, after its patch merging
            x = self.backbone.patch_embed(images)
            grids = []
            for i, stage in enumerate(self.backbone.layers):
                x = stage.downsample(x)                  # timm merges at the next stage's start
                if i > 0:
                    grids.append(x)
                x = stage.blocks(x)
            return self.backbone.norm(x).mean(dim=(1, 2)), grids + [x]
        feature, grid = self.backbone.forward_dense(images, norm=False)
        if self.pool is None:                            # Swin: mean of the final-norm tokens
            return self.backbone.norm(grid).mean(dim=(1, 2)), [grid]
        grid = self.pool(grid.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return self.backbone.norm(feature), [grid]       # ViT: final-norm CLS token

    def forward(self, images, positions=None, generator=None):
        feature, grids = self.features(images)
        outputs = {"logits": self.head(feature), "drloc": []}
        if not self.training:                            # the pretext task exists in training only
            return outputs
        for i, (grid, mlp) in enumerate(zip(grids, self.drloc)):
            k = grid.shape[1]
            pos_a, pos_b = (positions[i] if positions is not None
                            else self.sample(len(grid), k, generator))
            pred = mlp(gather_pairs(grid, pos_a, pos_b)).flatten(0, 1)  # image-major rows b*m + s
            outputs["drloc"].append({"pred": pred, "pos_a": pos_a, "pos_b": pos_b, "k": k})
        return outputs

    def sample(self, batch, k, generator):
        """This process's pairs: drawn for the global batch, whose images r, r + n, ... process r
        holds (the sampler deals round robin): an image gets the pairs of a one-process run."""
        n, r = common.get_world_size(), common.get_rank()
        if self.mode == "exh":
            pos_a, pos_b = exhaustive_pairs(batch * n, k, generator)
        else:
            pos_a, pos_b = sample_pairs(batch * n, k, self.pairs, generator)
        return pos_a[r::n], pos_b[r::n]


def build_model(args, num_classes):
    """Backbone + classifier, and DRLoc heads sized from one forward of a blank image (with
    --lambda_drloc 0, none: the plain supervised baseline, initialised identically)."""
    eps = 1e-5 if args.arch.startswith("swin") else 1e-6
    backbone = common.backbone_from_args(args, args.drop_path_rate, img_size=args.input_size,
                                         layer_norm_eps=eps)
    heads = []
    if args.lambda_drloc:
        with torch.random.fork_rng(devices=[]), torch.no_grad():   # leaves the RNG as it was
            blank = torch.zeros(1, 3, args.input_size, args.input_size)
            grids = DRLoc(backbone, num_classes, args.drloc_mode).eval().features(blank)[1]
        backbone.train()
        sides = [g.shape[1] for g in grids]
        if min(sides) < 2:
            common.die(f"DRLoc grid(s) {sides} at --input_size {args.input_size}: a grid needs at "
                       "least 2 x 2 tokens; raise --input_size or use --lambda_drloc 0")
        shapes = [f"{k}x{k}x{g.shape[3]}" for k, g in zip(sides, grids)]
        common.log("DRLoc grid(s):", " + ".join(shapes))
        classify = args.drloc_mode in ("ce", "reg")  # k (abs) or 2k - 1 (signed) classes per axis
        heads = [(g.shape[3],
                  (2 * k - 1 if args.drloc_targets == "signed" else k) if classify else None)
                 for k, g in zip(sides, grids)]
    return DRLoc(backbone, num_classes, args.drloc_mode, args.drloc_pairs, heads)


# ================================================================================================
# Supervised recipe: lambda schedule, parameter groups, seeded timm augmentation, data helpers
# ================================================================================================
def lambda_schedule(lambda_drloc, epochs, warmup_epochs=20, kind="warmup_decay"):
    """Per-epoch lambda. warmup_decay (the authors'): lambda e / warmup up to the warmup epoch, then
    lambda (1 - (e - warmup) / (epochs - warmup)); constant: lambda throughout."""
    e = np.arange(epochs, dtype=np.float64)
    if kind == "constant":
        return np.full(epochs, float(lambda_drloc))
    warmup = lambda_drloc * e / max(warmup_epochs, 1)
    decay = lambda_drloc * (1 - (e - warmup_epochs) / max(epochs - warmup_epochs, 1))
    return np.where(e < warmup_epochs, warmup, decay)


# Swin's rule: position tables are not decayed either (nor norms and biases, as everywhere).
NO_WEIGHT_DECAY = ("relative_position_bias_table", "pos_embed", "cls_token")


def train_transform(args):
    """Swin's training augmentation, built by timm: RandomResizedCrop (bicubic) + flip + RandAugment
    + normalise + random erasing (all its draws are seeded per sample by common.SeededDataset)."""
    try:
        transform = create_transform(args.input_size, is_training=True, color_jitter=0.4,
                                     auto_augment=args.aa or None, interpolation="bicubic",
                                     re_prob=args.reprob, re_mode="pixel", re_count=1)
    except AssertionError as e:     # timm's check of the policy's name
        common.die(f"--aa {args.aa!r}: {e}; give a timm policy, e.g. rand-m9-mstd0.5-inc1 (the "
                   "default), or '' for none")
    for t in transform.transforms:
        for op in getattr(t, "ops", ()):    # RandAugment's and AugMix's operations
            if op.name.startswith("Posterize"):
                op.aug_fn = posterize
    return transform


def posterize(img, bits_to_keep, **_):
    """timm's RandAugment asks for posterize(bits=0) at magnitude 10 ("inc1"), which Pillow >= 12
    rejects; keeping 0 bits gives the black image that older Pillow returned."""
    if bits_to_keep >= 8:
        return img
    return (ImageOps.posterize(img, bits_to_keep) if bits_to_keep >= 1
            else Image.new(img.mode, img.size))


def check_args(args):
    """One-line errors for flag combinations that cannot work."""
    if args.warmup_epochs > args.epochs:
        common.die(f"--warmup_epochs {args.warmup_epochs} exceeds --epochs {args.epochs}; lower it")
    patch = (args.patch_size if common.ARCHS[args.arch]["family"] == "vit"
             else common.ARCHS[args.arch].get("patch_size", 4))
    if args.input_size % patch:  # before the backbone, whose own error would name a global crop
        common.die(f"--input_size {args.input_size} is not a multiple of the patch size {patch}")
    if args.drloc_mode == "all" and common.ARCHS[args.arch]["family"] != "swin":
        common.die("--drloc_mode all needs a Swin --arch (one DRLoc head per stage)")
    if args.drloc_normalize and args.drloc_mode in ("ce", "reg"):
        common.die("--drloc_normalize applies to the l1 modes only; --drloc_mode "
                   f"{args.drloc_mode} classifies integer offsets")
    if args.drloc_targets == "signed" and args.drloc_mode in ("all", "exh"):
        common.die(f"--drloc_mode {args.drloc_mode} is defined with abs targets; use "
                   "--drloc_targets abs")
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size_per_gpu % 2:
        common.die(f"mixup/cutmix need an even --batch_size_per_gpu, not {args.batch_size_per_gpu}")
    if (args.lambda_drloc and args.lambda_schedule == "warmup_decay"
            and args.lambda_warmup_epochs >= args.epochs):
        common.log(f"warning: --lambda_warmup_epochs {args.lambda_warmup_epochs} >= --epochs "
                   f"{args.epochs}: lambda never reaches {args.lambda_drloc}")


def count_classes(dataset):
    labels = getattr(dataset, "targets", None)
    labels = getattr(dataset, "labels", None) if labels is None else labels
    return len(dataset.classes) if getattr(dataset, "classes", None) else int(np.max(labels)) + 1


def first(dataset, n, flag):
    """The first n images of `dataset` (all of them for n = 0): a deterministic subset."""
    if n > len(dataset):
        common.die(f"{flag} {n} exceeds the {len(dataset)} images of the split; lower it")
    return torch.utils.data.Subset(dataset, range(n)) if n else dataset


def load_pretrained(backbone, path):
    """Backbone weights from a timm, an official Swin / DeiT, or this repository's checkpoint;
    classifier and DRLoc keys are dropped (fine-tuning starts new ones)."""
    state = common.load_checkpoint(path)
    state = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        common.die(f"--pretrained {path} holds a {type(state).__name__}, not a network's weights "
                   "(a state dict)")
    if any(k.startswith("backbone.") for k in state):     # this file's checkpoint.pth
        state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    family = swin_transformer if isinstance(backbone, common.Swin) else vision_transformer
    state = {k: v for k, v in state.items() if not k.startswith("drloc.")}
    state = family.checkpoint_filter_fn(state, backbone)
    state = {k: v for k, v in state.items() if not k.startswith("head")}
    common.load_state_dict_strict(backbone, state, what=f"--pretrained {path}")
    common.log(f"backbone initialised from {path}")


# ================================================================================================
# One epoch
# ================================================================================================
def train_one_epoch(model, criterion, loader, optimizer, scaler, mixup, schedules, epoch,
                    start_step, args, device):
    model.train()
    n_steps = len(schedules["lr"]) // args.epochs
    totals = {}
    start = time.time()
    images_seen = 0
    lambda_drloc = float(schedules["lambda"][epoch])
    bar = common.progress(loader, desc=f"epoch {epoch}", total=n_steps - start_step)
    for it, (images, labels) in enumerate(bar, start=start_step):
        if it >= n_steps:
            break
        step = epoch * n_steps + it                      # global iteration: indexes the lr schedule
        lr = float(schedules["lr"][step])
        for group in optimizer.param_groups:
            group["lr"] = lr
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        if mixup is not None:
            images, labels = mixup(images, labels)       # soft labels; DRLoc sees the mixed images

        with common.autocast(device, args.precision):
            outputs = model(images, generator=pair_generator(args.seed, epoch, it))
            losses = criterion(outputs, labels, lambda_drloc)
        loss = losses["loss"]
        stats, preempted = common.average_step_stats(losses)  # the step's one host sync
        checks.check_finite(stats, epoch, args, model, None, optimizer, criterion)  # checks

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                       # global-norm clipping, as Swin's code
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf)
        scaler.step(optimizer)
        scaler.update()

        stats.update(lr=lr, grad_norm=grad_norm.double(), lambda_drloc=lambda_drloc)  # on device
        del outputs, losses, loss, grad_norm  # not held through the next forward
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
        images_seen += len(images) * common.get_world_size()
        bar.set_postfix(L_ce=f"{stats['L_ce']:.4f}", L_drloc=f"{stats['L_drloc']:.4f}",
                        lam=f"{lambda_drloc:.3f}", lr=f"{lr:.2e}")

        periodic = args.save_every_iters and (it + 1) % args.save_every_iters == 0
        if (preempted or periodic) and it + 1 < n_steps:  # at the epoch's end main() saves
            save_checkpoints(model, optimizer, scaler, criterion, epoch, it + 1, args,
                             loader.dataset)
            if preempted:
                common.exit_after_preemption(args.output_dir)
    record = {k: float(v) / max(n_steps - start_step, 1) for k, v in totals.items()}
    record.update(epoch=epoch, images_per_s=images_seen / (time.time() - start),
                  peak_memory_mb=common.peak_memory_mb(device))
    return record


@torch.no_grad()
def validate(model, loader, device, args):
    """Collective: top-1 / top-5 accuracy (%) with hard labels, summed over all processes, and how
    many images they count: each once (the padding with which the sampler evens out the processes is
    left out), the unreadable ones (--skip_bad_images: labelled SKIPPED) left out and counted."""
    model.eval()
    counts = torch.zeros(4, device=device)  # correct@1, correct@5, images, unreadable images
    distinct = loader.sampler.distinct_samples()        # this process's rows that are not padding
    for images, labels in common.progress(loader, desc="validation"):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with common.autocast(device, args.precision):
            logits = model(images)["logits"]
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        top = (top5 == labels[:, None])[:max(distinct, 0)]  # an unreadable image's is never right
        read = (labels != common.ImageFolderSafe.SKIPPED)[:max(distinct, 0)]
        distinct -= len(labels)
        counts += torch.stack([top[:, 0].sum(), top.any(dim=1).sum(), read.sum(), (~read).sum()])
    correct1, correct5, n, unreadable = common.all_reduce_sum(counts).tolist()
    if not n:                                           # an accuracy over no image is none
        common.die(f"none of the {int(unreadable)} validation images could be read "
                   f"(--skip_bad_images left them all out): there is no accuracy to report")
    return {"val_acc1": 100 * correct1 / n, "val_acc5": 100 * correct5 / n, "val_images": int(n),
            "val_skipped_images": int(unreadable)}


# ================================================================================================
# main
# ================================================================================================
@checks.one_line_exits  # checks
def main(args):
    device = common.init_distributed(args.device)
    args.precision, args.precision_auto = common.resolve_precision(args.precision, device)
    common.install_preemption_handler()
    common.fix_random_seeds(args.seed + common.get_rank())  # Swin's: Mixup, drop path per process
    check_args(args)  # checks
    checks.claim_output_dir(args.output_dir, "drloc.py")  # checks
    ckpt = common.checkpoint_to_resume(args.output_dir)  # None: a fresh start
    args.world_size = common.get_world_size()  # recorded: with the batch, the peak lr
    checks.check_resumed_args(ckpt, args, "drloc", run_only=["val_subset"])  # checks
    if ckpt is None and args.pretrained and not Path(args.pretrained).is_file():  # before any work
        common.die(f"--pretrained {args.pretrained} is not a file")
    common.log("\n".join(f"{k}: {v}" for k, v in sorted(vars(args).items())))

    # ---- data: every sample's augmentation depends only on (seed, epoch, index)
    train_base, val_base = common.build_eval_splits(args)  # val labels numbered as train's classes
    num_classes = count_classes(train_base)
    train_base = first(train_base, args.train_subset, "--train_subset")
    val_base = first(val_base, args.val_subset, "--val_subset")
    dataset = common.SeededDataset(train_base, train_transform(args), seed=args.seed)
    val_transform = common.eval_transform(int(args.input_size * 256 / 224), args.input_size)
    val_dataset = common.SeededDataset(val_base, val_transform)
    loader, sampler = common.make_loader(dataset, args.batch_size_per_gpu, args.num_workers,
                                         train=True, seed=args.seed)
    val_loader, _ = common.make_loader(val_dataset, args.batch_size_per_gpu, args.num_workers,
                                       train=False)
    mixup = (Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                   label_smoothing=args.smoothing, num_classes=num_classes)
             if args.mixup > 0 or args.cutmix > 0 else None)
    common.log(f"data: {len(dataset)} train / {len(val_dataset)} val images, {num_classes} "
               f"classes, {len(loader)} steps per epoch")

    # ---- model: backbone + classifier + DRLoc head(s)
    model = build_model(args, num_classes).to(device)
    if args.pretrained and ckpt is None:               # (a resumed run restores its own weights)
        load_pretrained(model.backbone, args.pretrained)
    common.log(f"model: {args.arch} + {len(model.drloc)} DRLoc head(s), "
               f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    if common.is_dist():
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None)

    criterion = DRLocLoss(args.drloc_mode, args.drloc_targets == "signed", args.drloc_normalize,
                          args.smoothing).to(device)
    optimizer = torch.optim.AdamW(common.get_params_groups(model, NO_WEIGHT_DECAY),
                                  weight_decay=args.weight_decay)
    scaler = common.make_grad_scaler(device, args.precision)

    # ---- schedules: lr per iteration (scaled linearly with the total batch), lambda per epoch
    n_steps = min(len(loader), args.max_steps_per_epoch or len(loader))
    scale = args.batch_size_per_gpu * common.get_world_size() / 512
    schedules = {
        "lr": common.cosine_scheduler(args.lr * scale, args.min_lr * scale, args.epochs, n_steps,
                                      args.warmup_epochs,
                                      start_warmup_value=args.warmup_lr * scale),
        "lambda": lambda_schedule(args.lambda_drloc, args.epochs, args.lambda_warmup_epochs,
                                  args.lambda_schedule),
    }

    ckpt_path = Path(args.output_dir) / "checkpoint.pth"  # resumed from, if it exists
    checks.check_resumed_dataset(ckpt, dataset, args)  # checks
    start_epoch, start_step = common.resume_position(ckpt, args.output_dir)
    if ckpt is not None:
        common.restore(ckpt, model=model, optimizer=optimizer, scaler=scaler, drloc_loss=criterion)
        common.set_rng_state(ckpt["rng"][common.get_rank() % len(ckpt["rng"])])
        common.log(f"resumed from {ckpt_path} at epoch {start_epoch}, step {start_step}")

    common.save_args(args, "drloc.py")  # every start-up check passed
    if start_epoch == args.epochs:  # --epochs lowered to those trained: a finished run's files
        common.log(f"nothing left to train: {ckpt_path} has trained all {args.epochs} epochs")
        save_checkpoints(model, optimizer, scaler, criterion, args.epochs, 0, args, dataset)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch, start_batch=start_step)  # mid-epoch resume: skips seen batches
        record = train_one_epoch(model, criterion, loader, optimizer, scaler, mixup, schedules,
                                 epoch, start_step, args, device)
        start_step = 0
        record.update(validate(model, val_loader, device, args))
        record["skipped_images"] = common.skipped_images_all_ranks(dataset, device)  # all ranks
        common.append_log(args.output_dir, record)  # before the checkpoint
        save_checkpoints(model, optimizer, scaler, criterion, epoch + 1, 0, args, dataset)
        common.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items()))
        if any(common.all_gather_objects(common.preemption_requested(device))):  # any signal
            common.exit_after_preemption(args.output_dir)
    common.log(f"done; backbone for evaluation: {Path(args.output_dir) / 'backbone.pth'}")


def save_checkpoints(model, optimizer, scaler, criterion, epoch, step, args, dataset):
    """Collective: checkpoint.pth, everything needed to resume at batch `step` of `epoch` (every
    process takes part: each one's RNG state is saved). At an epoch boundary (step 0) also a copy
    every saveckp_freq epochs and the backbone alone with timm key names (for eval_knn.py,
    eval_linear.py and timm)."""
    state = {"model": common.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict(), "drloc_loss": criterion.state_dict(), "epoch": epoch,
             "step": step, "args": vars(args), "method": "drloc",
             "backbone": common.backbone_record(common.unwrap(model).backbone),
             "dataset": common.dataset_record(dataset),
             "rng": common.all_gather_objects(common.rng_state())}
    if not common.is_main_process():
        return
    out = Path(args.output_dir)
    common.save_checkpoint(state, out / "checkpoint.pth")
    if step == 0 and (args.saveckp_freq and epoch % args.saveckp_freq == 0 or epoch == args.epochs):
        if epoch < args.epochs:
            common.save_checkpoint(state, out / f"checkpoint{epoch:04d}.pth")
        common.save_checkpoint(common.unwrap(model).backbone.state_dict(), out / "backbone.pth")


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
