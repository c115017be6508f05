"""GLSD: global-local self-distillation (Lebailly & Tuytelaars, "Global-Local Self-Distillation for
Visual Representation Learning", WACV 2023; arXiv 2207.14676, 2022).

The loss is `GLSDLoss` (view + region terms, three matchings), the model `GLSD`; `diff esvit.py
glsd.py` shows how its matching differs from EsViT's, `diff dino.py glsd.py` what it adds to DINO.

Idea. EsViT's two-level self-distillation (a view loss on the global feature, a region loss on the
tokens of the last feature map, teacher = EMA of the student) with another rule for pairing the
tokens of two crops. EsViT pairs a student token with the teacher token whose *features* are most
similar; in low-data regimes this matching can collapse (every token matched to one teacher token).
GLSD pairs tokens by *geometry* instead: each token's centre is known in the original image from
the crop box and flip, a student token is paired with the nearest teacher token, and pairs farther
apart than half a token cell's diagonal (no overlap) are dropped. Three settings
(`--local_matching`, the paper's Table 1): none (Vanilla: DINO's loss on a Swin), similarity
(EsViT's loss exactly), geometric (the paper's proposal, the default).

Loss (paper Eq. 2-7 and 8-10, as the authors' code computes it). With student temperature
tau_s = 0.1, teacher temperature tau_t, view centre c, region centre c_r, crop pairs
P = {(x, x') : x in {x1_g, x2_g}, x' in V, x' != x}, view head h, region head h', backbone tokens
z_1..z_T (after the final norm) and the average-pooled view feature z_bar (Swin; ViT: CLS token),
e_i = centre of token i in original-image pixels, hd(x) = half the diagonal of one token cell of x:

    P_t(x)   = softmax((h(z_bar_t(x)) - c) / tau_t)     P_s(x')   = softmax(h(z_bar_s(x')) / tau_s)
    P_t(x)_j = softmax((h'(z_t(x)_j) - c_r) / tau_t)    P_s(x')_i = softmax(h'(z_s(x')_i) / tau_s)
    geometric:  j*(i)  = argmin_j |e_s(x')_i - e_t(x)_j|^2
                kept_i = [ min_j |...|^2 < max(hd(x)^2, hd(x')^2) ]
    similarity: j*(i)  = argmax_j cos(z_s(x')_i, z_t(x)_j)      (teacher tokens may be reused)
                kept_i = 1
    L_G(x, x') = mean_batch H(P_t(x), P_s(x'))
    L_L(x, x') = mean_batch 1/T' sum_i kept_i H(P_t(x)_j*(i), P_s(x')_i)  (T' counts rejected too)
    L = 1 / |P| * sum_{(x, x') in P} (0.5 L_G(x, x') + 0.5 L_L(x, x'))    (none: L = 1/|P| sum L_G)

    with H(a, b) = -sum_k a_k log b_k, and after each step, from the raw teacher outputs of both
    global crops:
    c   <- 0.9 c   + 0.1 mean_{batch, crops} h(z_bar_t)
    c_r <- 0.9 c_r + 0.1 mean_{batch, crops, tokens} h'(z_t)

Where the paper's text and the authors' code differ, this file follows the code:
  * in the similarity and geometric settings each pair's loss is 0.5 L_G + 0.5 L_L (EsViT's
    halves); the paper writes L = L_G + L_L. The none setting has weight 1, as the paper;
  * the similarity matching uses the cosine of the l2-normalised backbone tokens, as EsViT's code;
  * a rejected geometric match contributes 0 but still counts in the mean over the student's
    tokens (the paper's 1/K of Eq. 6), so the region term shrinks when crops overlap little;
  * the teacher temperature warms up 0.04 -> 0.07 over 30 epochs (the published Swin-T command);
  * the authors measure positions by resizing a per-pixel coordinate map with the crop and
    average-pooling it over each 32 px token; here the centres are computed exactly from the box
    (`common.grid_centers`). The two agree to < 0.003 px at 224/96 px (the bicubic resize bends
    the authors' per-pixel map by up to 0.11 px near borders, but the pooled centres match), and
    every matching index and keep mask of the reference cases is the same. Their pixel centres are
    shifted by -0.5 px, which cancels in every distance;
  * EsViT's Swin (used by the authors) pads 96 px token maps before the cyclic shift; timm shifts
    first; the two differ slightly on 96 px crops (accepted, see esvit.py).
Other choices of this file: distances are in pixels of the original image on both axes, so
non-square images are not distorted; the losses are tensor operations over all crop pairs of a
resolution group; the region term computes the cross-entropy of every (student token, teacher
token) pair and then picks the matched one (no [pairs, B, T, K] gather); losses are computed in
float32 outside the autocast region (autocast would run their einsums in bf16 / fp16). Crop sizes
must be multiples of the token stride (32 px for the papers' Swins, 8 px for swin_pico3, the patch
size for ViT) so that the token grid tiles the crop exactly.
"""
import argparse
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import common
import device_crops


# ================================================================================================
# Arguments (defaults: the paper's Swin-T recipe, else EsViT's published command; advice in
# the help strings)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("glsd.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_backbone_args(p, arch="swin_tiny", drop_path_rate=0.1)

    g = p.add_argument_group("GLSD heads and loss")
    # K = 1: the loss is 0; past 2**18 (DINO tried up to 262144) the last layer is too large
    g.add_argument("--out_dim", default=65536, type=common.ranged(int, 2, 2 ** 18),
                   help="K, the number of prototypes of both the view head and the region head")
    g.add_argument("--local_matching", default="geometric",
                   choices=["none", "similarity", "geometric"],
                   help="how student tokens are paired with teacher tokens: geometric (nearest "
                        "token centre in the original image; robust in low-data regimes), "
                        "similarity (EsViT: most similar backbone token; can collapse on small "
                        "datasets), none (Vanilla: view loss only, no region head)")
    g.add_argument("--match_threshold", default=True, type=common.bool_flag,
                   help="geometric: drop pairs whose centres are farther apart than half a token "
                        "cell's diagonal (on/off)")
    g.add_argument("--norm_last_layer", default=False, type=common.bool_flag,
                   help="freeze the gain of the weight-normalised last layers (stabler; the "
                        "published Swin recipes use false)")
    g.add_argument("--use_bn_in_head", default=False, type=common.bool_flag,
                   help="batch norm in the head MLPs")
    common.add_head_size_args(g)
    g.add_argument("--momentum_teacher", default=0.996, type=common.FRACTION,
                   help="EMA momentum base, cosine to 1; use 0.9995 with batches of 256 or less")
    g.add_argument("--warmup_teacher_temp", default=0.04, type=common.POSITIVE,
                   help="teacher temperature at epoch 0")
    g.add_argument("--teacher_temp", default=0.07, type=common.POSITIVE,
                   help="teacher temperature after warmup; above 0.07 training becomes unstable")
    g.add_argument("--warmup_teacher_temp_epochs", default=30, type=common.SPAN,
                   help="epochs of linear teacher-temperature warmup; whole epochs ramp per epoch "
                        "as the authors' code, a fraction per step (0.5 = half an epoch)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size_per_gpu", default=32, type=common.POSITIVE_INT,
                   help="images per process (the paper: 32 x 16 GPUs = 512)")
    g.add_argument("--epochs", default=300, type=common.EPOCHS,
                   help="training epochs (GLSD: 300)")
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
                   help="epochs during which the last layers of both heads are not updated (a "
                        "fraction counts steps)")
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="adamw (ViT) or sgd")

    common.add_multicrop_args(p)
    device_crops.add_args(p)  # device_crops
    common.add_data_args(p)
    common.add_run_args(p, saveckp_freq=20)
    return p


# ================================================================================================
# Loss
# ================================================================================================
class Outputs(NamedTuple):
    """What the model returns for a list of crops (rows crop-major: crop c, sample b at c * B + b).

    `region`, `tokens` and `grids` have one entry per resolution group (consecutive crops of equal
    size, `common.resolution_groups`); token t of an (h, w) grid is at row t // w, column t % w."""
    view: torch.Tensor        # [ncrops * B, K]    view-head logits of the global features
    region: list | None       # [n * B, h * w, K]  region-head logits of every token (None: no head)
    tokens: list              # [n * B, h * w, D]  final-norm backbone tokens (used for matching)
    grids: list               # (h, w) token grid of the group


class GLSDLoss(nn.Module):
    """View-level DINO loss + region-level loss on matched tokens, averaged over the 2*ncrops - 2
    (teacher global crop, other student crop) pairs; each pair weighs 0.5 view + 0.5 region.
    local_matching: "geometric" (nearest token centre, optionally thresholded), "similarity"
    (EsViT's loss exactly) or "none" (DINO's loss exactly, weight 1 on the view term)."""

    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, local_matching="geometric",
                 match_threshold=True, student_temp=0.1, center_momentum=0.9, niter_per_ep=1):
        super().__init__()
        self.ncrops = ncrops
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.local_matching = local_matching
        self.match_threshold = match_threshold
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.register_buffer("center_grid", torch.zeros(1, out_dim))
        self.register_buffer("other_pairs", common.other_crop_pairs(ncrops), persistent=False)
        self.teacher_temp_schedule = common.teacher_temperature_schedule(
            warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs, niter_per_ep)

    def forward(self, student, teacher, step, geometry=None):
        """student: `Outputs` of all crops; teacher: `Outputs` of the 2 global crops; geometry: one
        dict per crop from `common.MultiCropAugmentation` (batched), needed by geometric matching;
        `step`, the global iteration, picks the teacher temperature."""
        temp = self.teacher_temp_schedule[step]
        log_p = F.log_softmax(student.view.float() / self.student_temp, dim=-1)
        log_p = log_p.unflatten(0, (self.ncrops, -1))
        q = F.softmax((teacher.view.float() - self.center) / temp, dim=-1)
        q = q.detach().unflatten(0, (2, -1))
        batch = q.shape[1]
        view_ce = -torch.einsum("tbk,sbk->ts", q, log_p) / batch  # [teacher crop, student crop]
        out = {"view_loss": self.other_crops_mean(view_ce)}
        if self.local_matching != "none":
            region_ce, distinct, kept = self.region_cross_entropy(student, teacher, temp, geometry)
            out["region_loss"] = self.other_crops_mean(region_ce)
            out["loss"] = 0.5 * out["view_loss"] + 0.5 * out["region_loss"]
            out["matched_teacher_tokens"] = self.other_crops_mean(distinct)
            if self.local_matching == "geometric":
                out["kept_fraction"] = self.other_crops_mean(kept)
        else:
            out["loss"] = out["view_loss"]
        self.update_centers(teacher)
        out.update(teacher_entropy=-(q * q.clamp_min(1e-12).log()).sum(-1).mean(),
                   center_norm=self.center.norm(), center_grid_norm=self.center_grid.norm())
        return {k: v if k == "loss" else v.detach() for k, v in out.items()}

    def other_crops_mean(self, matrix):
        """Mean of a [2, ncrops] (teacher crop t, student crop s) matrix over the pairs s != t."""
        return matrix.flatten()[self.other_pairs].mean()

    def region_cross_entropy(self, student, teacher, temp, geometry):
        """[2, ncrops] region cross-entropies (mean over *all* the student's tokens, rejected
        matches counting 0, and over the batch) of every (teacher crop, student crop) pair, the
        number of distinct teacher tokens matched, and the fraction of matches within the
        threshold."""
        (t_region,), (t_tokens,), (t_grid,) = teacher.region, teacher.tokens, teacher.grids
        batch = len(teacher.view) // 2
        q = F.softmax((t_region.float() - self.center_grid) / temp, dim=-1).detach()
        # [B, 2, T_t, K], laid out once as every group's einsum reads it (it would copy q per group)
        q = q.unflatten(0, (2, batch)).transpose(0, 1).contiguous()
        t_tokens = t_tokens.float().unflatten(0, (2, batch))      # [2, B, T_t, D]
        if self.local_matching == "geometric":
            if geometry is None:
                raise ValueError("geometric matching needs the crops' geometry (one dict per crop)")
            t_geometry = token_geometry(geometry[:2], t_grid, batch)
        ce, distinct, kept = [], [], []
        start = 0                                             # the group's first crop
        # one resolution group at a time
        for region, tokens, grid in zip(student.region, student.tokens, student.grids):
            log_p = F.log_softmax(region.float() / self.student_temp, dim=-1)
            log_p = log_p.unflatten(0, (-1, batch))
            n = log_p.shape[0]                                    # crops start..start+n-1
            if self.local_matching == "similarity":
                s_tokens = tokens.float().unflatten(0, (-1, batch))   # [n, B, T_s, D]
                match = self.match_similarity(s_tokens, t_tokens)     # [2, n, B, T_s]
                within = torch.ones_like(match, dtype=torch.bool)
            else:
                s_geometry = token_geometry(geometry[start:start + n], grid, batch)
                match, within = self.match_geometric(s_geometry, t_geometry)
            start += n
            ce_all = -torch.einsum("bitk,vbsk->ivbst", q, log_p)  # all student x teacher tokens
            ce_matched = ce_all.gather(-1, match[..., None]).squeeze(-1)
            if self.match_threshold:
                ce_matched = ce_matched * within  # a rejected match: 0, still counted in the mean
            ce.append(ce_matched.mean(dim=(2, 3)))                # [2, n]
            hit = torch.zeros(*match.shape[:3], q.shape[2], device=q.device)
            hit.scatter_(-1, match, 1.0)
            distinct.append(hit.sum(-1).mean(-1))                 # [2, n]
            kept.append(within.float().mean(dim=(2, 3)))          # [2, n]
        return torch.cat(ce, dim=1), torch.cat(distinct, dim=1), torch.cat(kept, dim=1)

    @staticmethod
    @torch.no_grad()
    def match_similarity(s_tokens, t_tokens):
        """For every student token, the teacher token with the highest cosine similarity of the
        backbone tokens (not of the head outputs):
        [n, B, T_s, D], [2, B, T_t, D] -> [2, n, B, T_s]."""
        s_tokens, t_tokens = F.normalize(s_tokens, dim=-1), F.normalize(t_tokens, dim=-1)
        return torch.einsum("vbsd,ibtd->ivbst", s_tokens, t_tokens).argmax(dim=-1)

    @staticmethod
    @torch.no_grad()
    def match_geometric(student_geometry, teacher_geometry):
        """For every student token, the teacher token with the nearest centre in the original image,
        and whether that squared distance is strictly below max(hd_t^2, hd_s^2), hd = half the
        diagonal of one token cell of the view. Inputs: (centres [n or 2, B, T, 2],
        hd^2 [n or 2, B]) of the student's and the teacher's crops -> index and keep mask, both
        [2, n, B, T_s]."""
        (s_xy, s_hd2), (t_xy, t_hd2) = student_geometry, teacher_geometry
        # [2, n, B, T_s, T_t]: every student token against every teacher token
        dist2 = (t_xy[:, None, :, None] - s_xy[None, :, :, :, None]).pow(2).sum(-1)
        dist2, match = dist2.min(dim=-1)
        threshold = torch.maximum(t_hd2[:, None], s_hd2[None])  # [2, n, B]
        return match, dist2 < threshold[..., None]

    @torch.no_grad()
    def update_centers(self, teacher):
        """Collective: EMA of the mean raw teacher outputs over both global crops of every process:
        `center` from the view logits, `center_grid` from the region logits of every token."""
        outputs = [(self.center, teacher.view)]
        if self.local_matching != "none":
            outputs.append((self.center_grid, teacher.region[0].flatten(0, 1)))
        for center, output in outputs:
            batch_center = common.all_reduce_sum(
                output.sum(dim=0, keepdim=True, dtype=torch.float32))
            batch_center = batch_center / (len(output) * common.get_world_size())
            center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)


def token_geometry(geometry, grid, batch):
    """Token centres [n, B, h*w, 2] and squared half-diagonals of one token cell [n, B], in pixels
    of the original image, for n consecutive crops (a list of per-crop geometry dicts) seen as an
    (h, w) grid."""
    # crop-major rows, like the tokens
    crops = {k: torch.cat([g[k] for g in geometry]) for k in geometry[0]}
    centres = common.grid_centers(crops, grid)
    size = crops["box"][:, 2:].float() * crops["image_size"].float()  # crop (w, h) in pixels
    # per cell; Python numbers: no copy to the GPU
    cell = torch.stack([size[:, 0] / grid[1], size[:, 1] / grid[0]], -1)
    return centres.unflatten(0, (-1, batch)), (cell / 2).pow(2).sum(-1).unflatten(0, (-1, batch))


# ================================================================================================
# Model: backbone + view head on the global feature + region head on every token
# ================================================================================================
class GLSD(nn.Module):
    """Backbone (global feature: Swin average-pooled tokens, ViT CLS; dense: the final-norm tokens)
    + view head + region head (same architecture, separate weights). Consecutive crops of equal
    resolution go through the backbone as one batch; each head sees all its rows at once."""

    def __init__(self, backbone, head, region_head=None):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.region_head = region_head

    def forward(self, crops):
        # per resolution group: (global features, token grid [n*B, h, w, D])
        groups = common.forward_multicrop(self.backbone.forward_dense, crops)
        view = self.head(torch.cat([g for g, _ in groups]))
        tokens = [grid.flatten(1, 2) for _, grid in groups]
        region = None
        if self.region_head is not None:
            sizes = [t.shape[0] * t.shape[1] for t in tokens]
            # one call for every token of every crop
            flat = self.region_head(torch.cat([t.flatten(0, 1) for t in tokens]))
            region = [r.view(*t.shape[:2], -1) for r, t in zip(flat.split(sizes), tokens)]
        return Outputs(view, region, tokens, [tuple(grid.shape[1:3]) for _, grid in groups])


def build_model(args, drop_path_rate):
    backbone = common.backbone_from_args(args, drop_path_rate)
    heads = [common.DINOHead(backbone.num_features, args.out_dim, use_bn=args.use_bn_in_head,
                             norm_last_layer=args.norm_last_layer, hidden_dim=args.head_hidden_dim,
                             bottleneck_dim=args.head_bottleneck_dim)
             for _ in range(1 + (args.local_matching != "none"))]
    return GLSD(backbone, *heads)


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
        crops, geometry = common.crops_on_device(views, device)  # --batched_crops: cut there

        with common.autocast(device, args.precision):
            with torch.no_grad():
                teacher_output = teacher(crops[:2])      # the teacher sees the 2 global crops only
            student_output = student(crops)
        losses = criterion(student_output, teacher_output, step, geometry)  # float32: no autocast
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
        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}",
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
    checks.claim_output_dir(args.output_dir, "glsd.py")  # checks
    ckpt = common.checkpoint_to_resume(args.output_dir)  # None: a fresh start
    args.world_size = common.get_world_size()  # recorded: with the batch, the peak lr
    checks.check_resumed_args(ckpt, args, "glsd")  # checks
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
    criterion = GLSDLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp,
                         args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs,
                         args.local_matching, args.match_threshold, niter_per_ep=n_steps).to(device)
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
                       glsd_loss=criterion)
        common.set_rng_state(ckpt["rng"][common.get_rank() % len(ckpt["rng"])])
        common.log(f"resumed from {ckpt_path} at epoch {start_epoch}, step {start_step}")

    common.save_args(args, "glsd.py")  # every start-up check passed
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
    common.log("done; teacher backbone for evaluation: "
               f"{Path(args.output_dir) / 'teacher_backbone.pth'}")


def save_checkpoints(student, teacher, optimizer, scaler, criterion, epoch, step, args, dataset):
    """Collective: checkpoint.pth, everything needed to resume at batch `step` of `epoch` (every
    process takes part: each one's RNG state is saved). At an epoch boundary (step 0) also a copy
    every saveckp_freq epochs and the teacher backbone alone with timm key names (for eval_knn.py,
    eval_linear.py and timm)."""
    state = {"student": common.unwrap(student).state_dict(), "teacher": teacher.state_dict(),
             "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "glsd_loss": criterion.state_dict(), "epoch": epoch, "step": step, "args": vars(args),
             "method": "glsd", "backbone": common.backbone_record(teacher.backbone),
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
