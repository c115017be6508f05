"""SelfPatch: adjacent patches as positives, trained jointly with DINO (Yun et al., "Patch-level
Representation Learning for Self-supervised Vision Transformers", CVPR 2022).

The loss is `SelfPatchLoss` (image term + patch term), the model `SelfPatch` with its
`AggregationModule`; `diff dino.py selfpatch.py` shows what SelfPatch adds to DINO.

Idea. DINO learns one vector per image; SelfPatch adds a task for every patch token. Adjacent
patches of an image often show the same object, so a patch should be predictable from those of
its neighbours that look like it. For each patch i the teacher picks k positives among the 8
cells around i (the most cosine-similar raw backbone tokens), summarises them with a small
aggregation module (a learned query and two class-attention blocks), and the student must predict
the distribution of that summary from patch i's own token, on the same crop. The same module,
applied to all patches, gives the image token on which DINO's loss is computed (the ViT has no
CLS token).

Model (authors' code). Backbone: ViT without CLS token and without final norm, raw tokens
x_1..x_N; CA = class attention (only the query is updated), q = a learned query:

    image token     z   = CA2(CA1(q, {x_1..x_N}))
    student patch   s_i = LN(x_i)                       teacher patch   y_i = LN(CA2(CA1(q, P_i)))
    P_i = top-k of the 8 cells of the 3x3 window around i by cos(x_i, x_j)
          (teacher tokens, no gradient)

then a DINO head g (K = 65536) on LN(z) and a second DINO head h (K_p = 4096) on each patch.

Loss (authors' code). Temperatures tau_s = 0.1 and tau_t, centers c and c_p, crops V (2 global +
N local), H(a, b) = -sum_k a_k log b_k:

    L_cls   = DINO's loss on g(LN(z)): the teacher's 2 global crops against every other crop,
              mean over the 2 |V| - 2 pairs
    L_patch = 1 / |V| sum_{v in V} mean_{b, i} H(softmax((h_t(y_i^v) - c_p) / tau_t),
                                                 softmax(h_s(s_i^v) / tau_s))
    L       = L_cls + 0.1 L_patch

    after the step  c   <- 0.9 c   + 0.1 mean over the teacher image logits of *all* crops
                    c_p <- 0.9 c_p + 0.1 mean over the teacher patch logits (all patches, all crops)

The student's patch outputs bypass the aggregation blocks, so the patch loss trains the backbone,
the final LayerNorm and h; the query and the blocks learn through L_cls only (the teacher
aggregates positives with their EMA).

Where the paper (our copy is the supplementary) and the authors' code differ or the paper is
silent, this file follows the code:
  * the 3x3 window wraps around the grid borders (the code indexes modulo the grid side; the
    paper says "adjacent"); `--neighbors_wrap false` gives the non-wrapping variant, where corner
    patches have 3 candidates and edge patches 5;
  * the teacher runs on every crop, the local ones too (every crop has a patch term; a comment in
    the code says otherwise), and the image-token center averages the teacher outputs of all crops
    (DINO: the 2 global crops, the only teacher image outputs used as targets; `--center_crops
    global` gives DINO's choice);
  * crop area ranges are (0.25, 1) global and (0.05, 0.25) local (DINO: (0.4, 1) and (0.05, 0.4));
  * DINO's code choices carry over: mean over crop pairs, per-parameter gradient clipping, DINO's
    bicubic position-embedding interpolation for other grid sizes (`common.ViT`).
Other choices of this file: the authors' code accepts only 14x14 and 6x6 grids; here the
neighbour table is built for any grid, and a grid too small for k positives stops with an error.
`--patch_teacher_temp` gives the patch term a temperature of its own (the paper and the code use
one temperature for both terms; the option is for small-image experiments, off by default).
Key names follow the authors' code (backbone, ca_head, c_head, p_head), so their checkpoints load.
Only ViT backbones (SelfPatch's backbone has no CLS token and no final norm).

Recipes (supplementary A):
  ImageNet (the defaults): ViT-S/16, 200 epochs, batch 1024, 2 x 224 + 8 x 96 crops, K = 65536
  and K_p = 4096, e.g. on 16 GPUs:
    torchrun --nproc_per_node 8 --nnodes 2 ... selfpatch.py --data_path /path/to/imagenet/train
  MS COCO train2017: ViT-Ti/16, 200 epochs, batch 256, 2 x 224 + 2 x 96 crops, K = K_p = 4096.
  Make a folder whose only sub-folder is train2017 (`mkdir coco && ln -s /data/coco/train2017
  coco/`), then on 4 GPUs:
    torchrun --nproc_per_node 4 selfpatch.py --arch vit_tiny --data_path coco \
        --batch_size_per_gpu 64 --local_crops_number 2 --out_dim 4096 --patch_out_dim 4096
"""
import argparse
import time
from functools import lru_cache, partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import common
import device_crops


# ================================================================================================
# Arguments (defaults: the paper's ImageNet recipe, else the authors' main_selfpatch.py)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("selfpatch.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_backbone_args(p, arch="vit_small", drop_path_rate=0.1)

    g = p.add_argument_group("DINO and SelfPatch heads and loss")
    # K = 1: the loss is 0; past 2**18 (DINO tried up to 262144) the last layer is too large
    g.add_argument("--out_dim", default=65536, type=common.ranged(int, 2, 2 ** 18),
                   help="K, the number of prototypes of the image-token head (4096 for COCO)")
    g.add_argument("--patch_out_dim", default=4096, type=common.ranged(int, 2, 2 ** 18),
                   help="K_p, the number of prototypes of the patch head (4096 for ImageNet "
                        "and COCO)")
    g.add_argument("--k_num", default=4, type=common.POSITIVE_INT,
                   help="k, positives per patch among its 8 neighbours; the paper advises 4 for 8 "
                        "and 16 px patches of 224 px images, 2 for 32 px patches")
    g.add_argument("--neighbors_wrap", default=True, type=common.bool_flag,
                   help="the 3x3 window wraps around the grid borders, as in the authors' code; "
                        "with false, corner patches have only 3 candidates, so --k_num must be at "
                        "most 3")
    g.add_argument("--center_crops", default="all", choices=["all", "global"],
                   help="teacher image outputs averaged into the image-token center: of all crops "
                        "(authors' code) or of the 2 global crops, the only ones used as targets "
                        "(DINO)")
    g.add_argument("--patch_loss_weight", default=0.1, type=common.NONNEGATIVE,
                   help="weight of the patch loss (authors' code)")
    g.add_argument("--norm_last_layer", default=True, type=common.bool_flag,
                   help="freeze the gain of the weight-normalised last layer of both heads "
                        "(stabler)")
    g.add_argument("--use_bn_in_head", default=False, type=common.bool_flag,
                   help="batch norm in the head MLPs (not with ViTs)")
    common.add_head_size_args(g)
    g.add_argument("--momentum_teacher", default=0.996, type=common.FRACTION,
                   help="EMA momentum base, cosine to 1; use 0.9995 with batches of 256 or less")
    g.add_argument("--warmup_teacher_temp", default=0.04, type=common.POSITIVE,
                   help="teacher temperature at epoch 0")
    g.add_argument("--teacher_temp", default=0.04, type=common.POSITIVE,
                   help="teacher temperature after warmup (both terms); above 0.07 training "
                        "becomes unstable")
    g.add_argument("--patch_teacher_temp", default=None, type=common.POSITIVE,
                   help="a constant teacher temperature for the patch term alone; None: the image "
                        "term's schedule")
    g.add_argument("--warmup_teacher_temp_epochs", default=0, type=common.SPAN,
                   help="epochs of linear teacher-temperature warmup; whole epochs ramp per epoch "
                        "as the authors' code, a fraction per step (0.5 = half an epoch)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size_per_gpu", default=64, type=common.POSITIVE_INT,
                   help="images per process (the paper: 1024 in total)")
    g.add_argument("--epochs", default=200, type=common.EPOCHS,
                   help="training epochs (SelfPatch on ImageNet: 200)")
    g.add_argument("--lr", default=0.0005, type=common.NONNEGATIVE,
                   help="peak lr at total batch 256 (linear scaling)")
    g.add_argument("--min_lr", default=1e-6, type=common.NONNEGATIVE,
                   help="lr at the end of the cosine schedule")
    g.add_argument("--warmup_epochs", default=10, type=common.SPAN,
                   help="linear lr warmup from 0 (a fraction counts steps: 0.5 = half an epoch)")
    g.add_argument("--weight_decay", default=0.04, type=common.NONNEGATIVE,
                   help="weight decay at the start (cosine)")
    g.add_argument("--weight_decay_end", default=0.4, type=common.NONNEGATIVE,
                   help="weight decay at the end")
    g.add_argument("--clip_grad", default=3.0, type=common.NONNEGATIVE,
                   help="per-parameter gradient norm clip (0 = off)")
    g.add_argument("--freeze_last_layer", default=1, type=common.SPAN,
                   help="epochs during which the heads' last layers are not updated (helps early "
                        "training; a fraction counts steps)")
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="adamw (ViT) or sgd")

    common.add_multicrop_args(p, global_crops_scale=(0.25, 1.0), local_crops_scale=(0.05, 0.25))
    device_crops.add_args(p)  # device_crops
    common.add_data_args(p)
    common.add_run_args(p, saveckp_freq=10)
    return p


# ================================================================================================
# Loss
# ================================================================================================
class SelfPatchLoss(nn.Module):
    """DINO's loss on the image tokens plus the patch loss: on every crop, the student's
    distribution of patch i against the teacher's distribution of the aggregate of i's positives.

        L = L_cls + w * 1/|V| sum_v mean_{b, i} H(softmax((t_i^v - c_p) / tau_t),
                                                   softmax(s_i^v / tau_s))
    """

    def __init__(self, out_dim, patch_out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, patch_loss_weight=0.1, student_temp=0.1,
                 center_momentum=0.9, center_crops="all", patch_teacher_temp=None, niter_per_ep=1):
        super().__init__()
        self.ncrops = ncrops
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.patch_loss_weight = patch_loss_weight
        if center_crops not in ("all", "global"):
            raise ValueError("center_crops must be 'all' (authors' code) or 'global' (DINO), not "
                             f"{center_crops!r}")
        self.center_crops = center_crops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.register_buffer("patch_center", torch.zeros(1, patch_out_dim))
        self.register_buffer("other_pairs", common.other_crop_pairs(ncrops), persistent=False)
        self.teacher_temp_schedule = common.teacher_temperature_schedule(
            warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs, niter_per_ep)
        self.patch_teacher_temp = patch_teacher_temp            # None: the image term's schedule

    def forward(self, student_output, teacher_output, step):
        """Each output is (image logits [ncrops*B, K], patch logits [[n*B, N, K_p] per resolution
        group]), crop-major rows, as `SelfPatch.forward` returns them; `step`, the global iteration,
        picks the teacher temperature."""
        student_image, student_patches = student_output
        teacher_image, teacher_patches = teacher_output
        student_image, teacher_image = student_image.float(), teacher_image.float()
        temp = self.teacher_temp_schedule[step]
        # image tokens: DINO's loss, the teacher's 2 global crops against every other crop
        log_p = F.log_softmax(student_image / self.student_temp, dim=-1)
        log_p = log_p.unflatten(0, (self.ncrops, -1))
        teacher_global = teacher_image.unflatten(0, (self.ncrops, -1))[:2]
        q = F.softmax((teacher_global - self.center) / temp, dim=-1).detach()
        batch = q.shape[1]
        ce = -torch.einsum("tbk,sbk->ts", q, log_p) / batch  # [teacher crop t, student crop s]
        cls_loss = ce.flatten()[self.other_pairs].mean()     # the pairs of different crops
        # patches: same crop for both networks; mean over the patches of each crop, then over crops
        patch_temp = temp if self.patch_teacher_temp is None else self.patch_teacher_temp
        patch_ce = []
        for s, t in zip(student_patches, teacher_patches):  # one [n*B, N, K_p] pair per resolution
            q_patch = F.softmax((t.float() - self.patch_center) / patch_temp, dim=-1).detach()
            log_p_patch = F.log_softmax(s.float() / self.student_temp, dim=-1)
            patch_ce.append(-(q_patch * log_p_patch).sum(-1).mean(-1))
        patch_loss = torch.cat(patch_ce).mean()                 # [ncrops*B] per-(crop, image) means
        loss = cls_loss + self.patch_loss_weight * patch_loss
        self.update_centers(teacher_image, teacher_patches)
        teacher_entropy = -(q * q.clamp_min(1e-12).log()).sum(-1).mean()
        return {"loss": loss, "cls_loss": cls_loss.detach(), "patch_loss": patch_loss.detach(),
                "teacher_entropy": teacher_entropy.detach(), "center_norm": self.center.norm(),
                "patch_center_norm": self.patch_center.norm()}

    @torch.no_grad()
    def update_centers(self, teacher_image, teacher_patches):
        """Collective: EMA of the mean raw teacher output of every process: image logits of all
        crops (or of the 2 global ones, `center_crops="global"`), and patch logits of all patches of
        all crops (each patch weighs the same, whatever its crop's size)."""
        world = common.get_world_size()
        if self.center_crops == "global":  # crop-major rows: the first 2 crops
            teacher_image = teacher_image[: 2 * len(teacher_image) // self.ncrops]
        image_center = common.all_reduce_sum(teacher_image.sum(dim=0, keepdim=True))
        image_center = image_center / (len(teacher_image) * world)
        patch_sum = sum(t.sum(dim=(0, 1), dtype=torch.float32) for t in teacher_patches)
        patch_sum = common.all_reduce_sum(patch_sum[None])
        patch_center = patch_sum / (sum(t.shape[0] * t.shape[1] for t in teacher_patches) * world)
        self.center.mul_(self.center_momentum).add_(image_center, alpha=1 - self.center_momentum)
        self.patch_center.mul_(self.center_momentum).add_(patch_center,
                                                          alpha=1 - self.center_momentum)


# ================================================================================================
# Positives: the k most similar of the 8 adjacent patches
# ================================================================================================
WINDOW = [(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if (dr, dc) != (0, 0)]


@lru_cache(maxsize=None)
def neighbor_table(h, w, wrap=True):
    """Candidate positives of every patch of an h x w grid (row-major flat indices i = row*w + col):
    the cells of its 3x3 window. Returns (index [N, 8] ascending per row, valid [N, 8] bool).

    wrap=True (the authors' code): rows and columns wrap around the borders, so every patch has 8
    candidates; on a side shorter than 3 a cell counts once and never as its own neighbour.
    wrap=False: cells outside the grid are invalid (3 candidates at corners, 5 along edges).
    Invalid entries hold the patch's own index, so that indexing with the table stays in range.
    """
    rows = torch.arange(h).repeat_interleave(w)[:, None] + torch.tensor([dr for dr, _ in WINDOW])
    cols = torch.arange(w).repeat(h)[:, None] + torch.tensor([dc for _, dc in WINDOW])
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    index = (rows % h) * w + cols % w
    itself = torch.arange(h * w)[:, None]
    valid = (torch.ones_like(inside) if wrap else inside) & (index != itself)
    same_as_earlier = (index[:, :, None] == index[:, None, :]) & valid[:, None, :]
    valid &= ~same_as_earlier.tril(diagonal=-1).any(-1)
    index, order = torch.where(valid, index, itself).sort(dim=1)
    return index, valid.gather(1, order)


@torch.no_grad()
def select_positives(tokens, neighbors, valid, k):
    """tokens [B, N, C] (the teacher's raw backbone tokens) -> [B, N, k]: flat indices of each
    patch's k valid candidates (`neighbor_table`) with the highest cosine similarity to it. In
    float32 under any autocast, as the DINO head: bf16 similarities (8 bits) reorder near ties and
    pick other positives."""
    with torch.autocast(tokens.device.type, enabled=False):
        x = F.normalize(tokens.float(), dim=-1)
        similarity = x @ x.transpose(1, 2)                                   # [B, N, N]
        similarity = similarity.gather(2, neighbors.expand(len(x), -1, -1))  # [B, N, 8]
    # [B, N, k] positions in the table
    best = similarity.masked_fill(~valid, float("-inf")).topk(k, dim=-1).indices
    return neighbors.expand(len(x), -1, -1).gather(2, best)


# ================================================================================================
# Model: ViT without CLS token + aggregation module + image and patch heads over all crops
# ================================================================================================
class AggregationModule(common.ClassAttentionPool):
    """The authors' `SelfPatchHead` (`common.ClassAttentionPool`: a learned query, two
    class-attention blocks, a final LayerNorm) over a set of tokens: all patches of an image (the
    image token), or the positives of one patch."""

    def forward(self, tokens, positives=None):
        """tokens [B, N, C] -> LN([image token; patch outputs]) [B, 1 + N, C]. The patch outputs
        are the tokens themselves (student), or given positives [B, N, k] (teacher) the summary of
        each patch's k positives, the patch itself not included."""
        image = self.summarize(tokens)[:, None]
        if positives is not None:
            B, N, k = positives.shape
            rows = torch.arange(B, device=tokens.device)[:, None, None]
            gathered = tokens[rows, positives]  # [B, N, k, C]
            tokens = self.summarize(gathered.flatten(0, 1)).unflatten(0, (B, N))
        return self.norm(torch.cat([image, tokens], dim=1))


class SelfPatch(nn.Module):
    """Backbone (ViT without CLS token or final norm) -> aggregation module -> DINO head on the
    image token (c_head) and DINO head on every patch (p_head). Consecutive crops of equal
    resolution go through the backbone as one batch."""

    def __init__(self, backbone, ca_head, c_head, p_head, k_num=4, neighbors_wrap=True):
        super().__init__()
        self.backbone = backbone
        self.ca_head = ca_head
        self.c_head = c_head
        self.p_head = p_head
        self.k_num = k_num
        self.neighbors_wrap = neighbors_wrap

    def forward(self, crops, aggregate_positives=False):
        """(image logits [ncrops*B, K], patch logits [[n*B, N, K_p] per resolution group]). Patch i
        is the student's own token, or with `aggregate_positives` (teacher) the aggregate of its
        positives."""
        image_logits, patch_logits = [], []
        dense = partial(self.backbone.forward_dense, norm=False)
        for _, grid in common.forward_multicrop(dense, crops):
            positives = self.positives(grid) if aggregate_positives else None
            out = self.ca_head(grid.flatten(1, 2), positives)            # [n*B, 1 + N, C]
            image_logits.append(self.c_head(out[:, 0]))
            patch_logits.append(self.p_head(out[:, 1:].flatten(0, 1)).unflatten(0, (len(out), -1)))
        return torch.cat(image_logits), patch_logits

    def positives(self, grid):
        """grid [B, h, w, C] raw tokens -> [B, h*w, k] flat indices of every patch's positives."""
        neighbors, valid = candidates(*grid.shape[1:3], self.neighbors_wrap, self.k_num,
                                      grid.device)
        return select_positives(grid.flatten(1, 2), neighbors, valid, self.k_num)


@lru_cache(maxsize=None)
def candidates(h, w, wrap, k, device):
    """`neighbor_table` on `device`, checked to offer k positives everywhere: once per grid and
    device, not a copy to the GPU and a read back every step."""
    neighbors, valid = neighbor_table(h, w, wrap)
    fewest = int(valid.sum(1).min())
    if not 1 <= k <= fewest:
        fix = "larger crops or a smaller --patch_size" if wrap else "--neighbors_wrap true"
        common.die(f"--k_num {k} needs 1 to {fewest} positives on a {h}x{w} patch grid with "
                   f"--neighbors_wrap {str(wrap).lower()}: lower --k_num, or use {fix}")
    return neighbors.to(device), valid.to(device)


def check_args(args):
    """Refused before any data or model work: a Swin; a --k_num that a crop's patch grid cannot
    offer (`candidates`)."""
    if common.ARCHS[args.arch]["family"] != "vit":
        common.die(f"--arch {args.arch}: SelfPatch is implemented for ViT backbones only (vit_*)")
    for size in {args.global_crop_size,
                 args.local_crop_size if args.local_crops_number else args.global_crop_size}:
        candidates(size // args.patch_size, size // args.patch_size, args.neighbors_wrap,
                   args.k_num, "cpu")


def build_model(args, drop_path_rate):
    backbone = common.backbone_from_args(args, drop_path_rate, class_token=False, final_norm=False)
    dim = backbone.num_features
    ca_head = AggregationModule(dim, backbone.blocks[0].attn.num_heads)
    c_head = common.DINOHead(dim, args.out_dim, use_bn=args.use_bn_in_head,
                             norm_last_layer=args.norm_last_layer, hidden_dim=args.head_hidden_dim,
                             bottleneck_dim=args.head_bottleneck_dim)
    p_head = common.DINOHead(dim, args.patch_out_dim, use_bn=args.use_bn_in_head,
                             norm_last_layer=args.norm_last_layer, hidden_dim=args.head_hidden_dim,
                             bottleneck_dim=args.head_bottleneck_dim)
    return SelfPatch(backbone, ca_head, c_head, p_head, args.k_num, args.neighbors_wrap)


# ================================================================================================
# One epoch
# ================================================================================================
def train_one_epoch(student, teacher, criterion, loader, optimizer, scaler, schedules, epoch,
                    start_step, args, device):
    n_steps = len(schedules["lr"]) // args.epochs
    totals = {}
    start = time.time()
    images = 0
    bar = common.progress(loader, desc=f"epoch {epoch}", total=n_steps - start_step)
    for it, (views, _labels) in enumerate(bar, start=start_step):
        if it >= n_steps:
            break
        step = epoch * n_steps + it                      # global iteration: indexes every schedule
        lr, wd, momentum = (float(schedules[k][step]) for k in ("lr", "wd", "momentum"))
        for i, group in enumerate(optimizer.param_groups):
            group["lr"] = lr
            if i == 0:                                   # only the first group is regularised
                group["weight_decay"] = wd
        crops, _geometry = common.crops_on_device(views, device)  # --batched_crops: cut there

        with common.autocast(device, args.precision):
            with torch.no_grad():  # the teacher sees every crop: each has a patch term
                teacher_output = teacher(crops, aggregate_positives=True)
            student_output = student(crops)
        losses = criterion(student_output, teacher_output, step)  # float32: outside autocast
        loss = losses["loss"]
        stats, preempted = common.average_step_stats(losses)  # the step's one host sync
        checks.check_finite(stats, epoch, args, student, teacher, optimizer, criterion)  # checks

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_grad:
            scaler.unscale_(optimizer)
            common.clip_gradients(student, args.clip_grad)
        common.cancel_gradients_last_layer(epoch + it / n_steps, student, args.freeze_last_layer)
        scaler.step(optimizer)
        scaler.update()
        common.update_teacher(student, teacher, momentum)

        del teacher_output, student_output, losses, loss  # not held through the next forward
        stats.update(lr=lr, wd=wd, momentum=momentum,
                     teacher_temp=float(criterion.teacher_temp_schedule[step]))
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
        images += len(crops[0]) * common.get_world_size()
        bar.set_postfix(loss=f"{stats['loss']:.4f}", cls=f"{stats['cls_loss']:.4f}",
                        patch=f"{stats['patch_loss']:.4f}", lr=f"{stats['lr']:.2e}",
                        wd=f"{stats['wd']:.3f}", mom=f"{stats['momentum']:.4f}",
                        H_t=f"{stats['teacher_entropy']:.2f}")

        periodic = args.save_every_iters and (it + 1) % args.save_every_iters == 0
        # a signal in any process; at the epoch's end main() saves
        if (preempted or periodic) and it + 1 < n_steps:
            save_checkpoints(student, teacher, optimizer, scaler, criterion, epoch, it + 1, args,
                             loader.dataset)
            if preempted:
                common.exit_after_preemption(args.output_dir)
    record = {k: v / max(n_steps - start_step, 1) for k, v in totals.items()}
    record.update(epoch=epoch, images_per_s=images / (time.time() - start),
                  peak_memory_mb=common.peak_memory_mb(device))
    return record


# ================================================================================================
# main
# ================================================================================================
@checks.one_line_exits  # checks
def main(args):
    device = common.init_distributed(args.device)
    args.precision, args.precision_auto = common.resolve_precision(args.precision, device)
    common.install_preemption_handler()
    common.fix_random_seeds(args.seed)
    checks.check_start_args(args)  # checks
    check_args(args)  # checks
    checks.claim_output_dir(args.output_dir, "selfpatch.py")  # checks
    ckpt = common.checkpoint_to_resume(args.output_dir)  # None: a fresh start
    args.world_size = common.get_world_size()  # recorded: with the batch, the peak lr
    checks.check_resumed_args(ckpt, args, "selfpatch")  # checks
    common.log("\n".join(f"{k}: {v}" for k, v in sorted(vars(args).items())))

    # ---- data: every sample's crops depend only on (seed, epoch, index)
    augment = common.MultiCropAugmentation(args.global_crops_scale, args.local_crops_scale,
                                           args.local_crops_number, args.global_crop_size,
                                           args.local_crop_size)
    dataset = common.SeededDataset(common.build_dataset(args, train=True), augment, seed=args.seed)
    if args.batched_crops:  # device_crops: the crops are cut on the training device
        dataset = device_crops.BatchedCrops(dataset, device)  # device_crops
    loader, sampler = common.make_loader(dataset, args.batch_size_per_gpu, args.num_workers,
                                         train=True, seed=args.seed)
    if args.batched_crops:  # device_crops: the next batch cut while the GPU computes
        loader = device_crops.Prefetched(loader, device)  # device_crops
    common.log(f"data: {len(dataset)} images, {len(loader)} steps per epoch")

    # ---- student and teacher start from the same weights; the teacher has no drop path
    student = build_model(args, args.drop_path_rate).to(device)
    teacher = build_model(args, 0.0).to(device)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    if common.is_dist():
        if args.use_bn_in_head:
            student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
            teacher = nn.SyncBatchNorm.convert_sync_batchnorm(teacher)
        student = nn.parallel.DistributedDataParallel(
            student, device_ids=[device] if device.type == "cuda" else None)
    common.log(f"student and teacher: {args.arch}, "
               f"{sum(p.numel() for p in student.parameters()) / 1e6:.1f}M parameters each")

    n_steps = (len(loader) if not args.max_steps_per_epoch
               else min(len(loader), args.max_steps_per_epoch))
    criterion = SelfPatchLoss(args.out_dim, args.patch_out_dim, args.local_crops_number + 2,
                              args.warmup_teacher_temp,
                              args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs,
                              args.patch_loss_weight, center_crops=args.center_crops,
                              patch_teacher_temp=args.patch_teacher_temp,
                              niter_per_ep=n_steps).to(device)
    params = common.get_params_groups(student)
    optimizer = (torch.optim.AdamW(params, fused=device.type == "cuda" or None)  # CUDA: fused
                 if args.optimizer == "adamw" else torch.optim.SGD(params, lr=0, momentum=0.9))
    scaler = common.make_grad_scaler(device, args.precision)

    # ---- schedules, one value per iteration (lr scaled linearly with the total batch)
    total_batch = args.batch_size_per_gpu * common.get_world_size()
    schedules = {
        "lr": common.cosine_scheduler(args.lr * total_batch / 256, args.min_lr, args.epochs,
                                      n_steps, args.warmup_epochs),
        "wd": common.cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs,
                                      n_steps),
        "momentum": common.cosine_scheduler(args.momentum_teacher, 1, args.epochs, n_steps),
    }

    # ---- resume from output_dir/checkpoint.pth when it exists
    ckpt_path = Path(args.output_dir) / "checkpoint.pth"
    checks.check_resumed_dataset(ckpt, dataset, args)  # checks
    start_epoch, start_step = common.resume_position(ckpt, args.output_dir)
    if ckpt is not None:
        common.restore(ckpt, student=student, teacher=teacher, optimizer=optimizer, scaler=scaler,
                       selfpatch_loss=criterion)
        common.set_rng_state(ckpt["rng"][common.get_rank() % len(ckpt["rng"])])
        common.log(f"resumed from {ckpt_path} at epoch {start_epoch}, step {start_step}")

    common.save_args(args, "selfpatch.py")  # every start-up check passed
    if start_epoch == args.epochs:  # --epochs lowered to those trained: a finished run's files
        common.log(f"nothing left to train: {ckpt_path} has trained all {args.epochs} epochs")
        save_checkpoints(student, teacher, optimizer, scaler, criterion,
                         args.epochs, 0, args, dataset)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch, start_batch=start_step)  # mid-epoch resume: skips seen batches
        record = train_one_epoch(student, teacher, criterion, loader, optimizer, scaler, schedules,
                                 epoch, start_step, args, device)
        start_step = 0
        record["skipped_images"] = common.skipped_images_all_ranks(dataset, device)  # all ranks
        common.append_log(args.output_dir, record)  # before the checkpoint
        save_checkpoints(student, teacher, optimizer, scaler, criterion,
                         epoch + 1, 0, args, dataset)
        common.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items()))
        if any(common.all_gather_objects(common.preemption_requested(device))):  # any signal
            common.exit_after_preemption(args.output_dir)
    common.log("done; teacher for evaluation (its image token): "
               f"{Path(args.output_dir) / 'checkpoint.pth'}")


def save_checkpoints(student, teacher, optimizer, scaler, criterion, epoch, step, args, dataset):
    """Collective: checkpoint.pth, everything needed to resume at batch `step` of `epoch` (every
    process takes part: each one's RNG state is saved; eval_knn.py and eval_linear.py read its
    teacher). At an epoch boundary (step 0) also a copy every saveckp_freq epochs and the teacher
    backbone alone with timm key names (for timm and dense tasks)."""
    state = {"student": common.unwrap(student).state_dict(), "teacher": teacher.state_dict(),
             "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "selfpatch_loss": criterion.state_dict(), "epoch": epoch, "step": step,
             "args": vars(args), "method": "selfpatch",
             "backbone": common.backbone_record(teacher.backbone, image_token="ca_head"),
             "dataset": common.dataset_record(dataset),
             "rng": common.all_gather_objects(common.rng_state())}
    if not common.is_main_process():
        return
    out = Path(args.output_dir)
    common.save_checkpoint(state, out / "checkpoint.pth")
    if step == 0 and (args.saveckp_freq and epoch % args.saveckp_freq == 0 or epoch == args.epochs):
        if epoch < args.epochs:
            common.save_checkpoint(state, out / f"checkpoint{epoch:04d}.pth")
        common.save_checkpoint(teacher.backbone.state_dict(), out / "teacher_backbone.pth")


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
