"""EsViT: efficient self-supervised vision transformers (Li et al., "Efficient Self-supervised
Vision Transformers for Representation Learning", ICLR 2022; arXiv 2106.09785, 2021).

The loss is `EsViTLoss` (view + region terms), the model `EsViT`; `diff dino.py esvit.py` shows what
EsViT adds to DINO.

Idea. DINO's self-distillation on a multi-stage backbone (Swin), plus a region-level task. The
view-level task is DINO's: the student's distribution of every crop predicts the teacher's on the
other global crop. A multi-stage network trained this way loses fine-grained correspondences
between regions, so a second head is applied to every token of the last feature map, and each
student token predicts the teacher's region distribution of the teacher token it resembles most
(highest cosine similarity of the backbone tokens, computed afresh at every step).

Loss (paper Eq. 1-2 and Algorithm 1, as the authors' code computes it). With student temperature
tau_s = 0.1, teacher temperature tau_t, view centre c, region centre c_r, crop pairs
P = {(x, x') : x in {x1_g, x2_g}, x' in V, x' != x}, view head h, region head h', backbone tokens
z_1..z_T (after the final norm) and the average-pooled view feature z_bar (Swin; ViT: CLS token):

    P_t(x)   = softmax((h(z_bar_t(x)) - c) / tau_t)     P_s(x')   = softmax(h(z_bar_s(x')) / tau_s)
    P_t(x)_j = softmax((h'(z_t(x)_j) - c_r) / tau_t)    P_s(x')_i = softmax(h'(z_s(x')_i) / tau_s)
    j*(i)    = argmax_j cos(z_s(x')_i, z_t(x)_j)            (teacher tokens may be reused)
    L_V(x, x') = mean_batch H(P_t(x), P_s(x'))
    L_R(x, x') = mean_batch 1/T' sum_i H(P_t(x)_j*(i), P_s(x')_i)
    L = 1 / |P| * sum_{(x, x') in P} (0.5 L_V(x, x') + 0.5 L_R(x, x'))

    with H(a, b) = -sum_k a_k log b_k, and after each step, from the raw teacher outputs of both
    global crops:
    c   <- 0.9 c   + 0.1 mean_{batch, crops} h(z_bar_t)
    c_r <- 0.9 c_r + 0.1 mean_{batch, crops, tokens} h'(z_t)

Where the paper's text and the authors' code differ, this file follows the code:
  * each pair's loss is 0.5 L_V + 0.5 L_R (Algorithm 1's halves) and the total is the mean over
    the 2 |V| - 2 pairs; the paper's text writes L = L_R + L_V;
  * Algorithm 1 shows two crops and a raw dot product for the matching; the code uses multi-crop
    (every crop against the *other* global crop of the teacher, local crops included) and the
    cosine of Eq. 2 (both token sets l2-normalised);
  * `--use_region_loss false` (the L_V rows of Table 2) trains without a region head and uses
    DINO's loss exactly (no 0.5 factor);
  * continual pre-training (L_R added to a view-only run, Table 8, Fig. 4) is the authors'
    `--pretrained_weights_ckpt`: weights and the epoch come from the checkpoint, the missing region
    head and region centre start fresh, and the optimizer starts anew (its state does not fit the
    larger model); here `--init_from`;
  * the teacher temperature warms up 0.04 -> 0.07 over 30 epochs (the published Swin-T command);
  * EsViT's Swin pads 96 px token maps to the window *before* the cyclic shift; timm (used here)
    shifts first and pads afterwards. The two agree exactly at 224 px and differ slightly on 96 px
    crops; we accept timm's behaviour. Its LayerNorms use eps 1e-6 as EsViT's
    (`common.build_backbone`).
Other choices of this file: the losses are written as tensor operations over all crop pairs of a
resolution group (no loop over pairs); the region term first computes the cross-entropy of every
(student token, teacher token) pair and then picks the matched one, which gives the same number as
gathering the matched teacher distributions without materialising a [pairs, B, T, K] tensor;
losses are computed in float32 outside the autocast region (autocast would run their einsums in
bf16 / fp16). With ViT backbones the patch tokens are the regions and the CLS token is the view
feature.
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
# Arguments (defaults: the authors' published Swin-T command; advice in the help strings)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("esvit.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_backbone_args(p, arch="swin_tiny", drop_path_rate=0.1)

    g = p.add_argument_group("EsViT heads and loss")
    # K = 1: the loss is 0; past 2**18 (DINO tried up to 262144) the last layer is too large
    g.add_argument("--out_dim", default=65536, type=common.ranged(int, 2, 2 ** 18),
                   help="K, the number of prototypes of both the view head and the region head")
    g.add_argument("--use_region_loss", default=True, type=common.bool_flag,
                   help="add the region-matching loss L_R; false = view-level loss L_V only (Table "
                        "2's L_V rows; no region head)")
    g.add_argument("--init_from", default="", type=str,
                   help="checkpoint.pth of a view-only run (or of dino.py with the same --arch) to "
                        "continue with the region loss: weights, view centre and epoch are loaded, "
                        "the region head starts fresh, the optimizer restarts (the paper's "
                        "continual pre-training; Table 8 adds L_R at epoch 200 of 300)")
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
                   help="training epochs (EsViT: 300)")
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


class EsViTLoss(nn.Module):
    """View-level DINO loss + region-level loss on matched tokens, averaged over the 2*ncrops - 2
    (teacher global crop, other student crop) pairs; each pair weighs 0.5 view + 0.5 region.
    Without the region loss: DINO's loss exactly (weight 1 on the view term)."""

    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, use_region_loss=True, student_temp=0.1,
                 center_momentum=0.9, niter_per_ep=1):
        super().__init__()
        self.ncrops = ncrops
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.use_region_loss = use_region_loss
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.register_buffer("center_grid", torch.zeros(1, out_dim))
        self.register_buffer("other_pairs", common.other_crop_pairs(ncrops), persistent=False)
        self.teacher_temp_schedule = common.teacher_temperature_schedule(
            warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs, niter_per_ep)

    def forward(self, student, teacher, step):
        """student: `Outputs` of all crops; teacher: `Outputs` of the 2 global crops; `step`, the
        global iteration, picks the teacher temperature."""
        temp = self.teacher_temp_schedule[step]
        log_p = F.log_softmax(student.view.float() / self.student_temp, dim=-1)
        log_p = log_p.unflatten(0, (self.ncrops, -1))
        q = F.softmax((teacher.view.float() - self.center) / temp, dim=-1)
        q = q.detach().unflatten(0, (2, -1))
        batch = q.shape[1]
        view_ce = -torch.einsum("tbk,sbk->ts", q, log_p) / batch  # [teacher crop, student crop]
        out = {"view_loss": self.other_crops_mean(view_ce)}
        if self.use_region_loss:
            region_ce, distinct = self.region_cross_entropy(student, teacher, temp)
            out["region_loss"] = self.other_crops_mean(region_ce)
            out["loss"] = 0.5 * out["view_loss"] + 0.5 * out["region_loss"]
            out["matched_teacher_tokens"] = self.other_crops_mean(distinct)
        else:
            out["loss"] = out["view_loss"]
        self.update_centers(teacher)
        out.update(teacher_entropy=-(q * q.clamp_min(1e-12).log()).sum(-1).mean(),
                   center_norm=self.center.norm(), center_grid_norm=self.center_grid.norm())
        return {k: v if k == "loss" else v.detach() for k, v in out.items()}

    def other_crops_mean(self, matrix):
        """Mean of a [2, ncrops] (teacher crop t, student crop s) matrix over the pairs s != t."""
        return matrix.flatten()[self.other_pairs].mean()

    def region_cross_entropy(self, student, teacher, temp):
        """[2, ncrops] region cross-entropies (mean over the student's tokens and the batch) of
        every (teacher crop, student crop) pair, and the number of distinct teacher tokens matched
        [2, ncrops]."""
        (t_region,), (t_tokens,) = teacher.region, teacher.tokens  # the 2 global crops: one group
        batch = len(teacher.view) // 2
        q = F.softmax((t_region.float() - self.center_grid) / temp, dim=-1).detach()
        # [B, 2, T_t, K], laid out once as every group's einsum reads it (it would copy q per group)
        q = q.unflatten(0, (2, batch)).transpose(0, 1).contiguous()
        t_tokens = t_tokens.float().unflatten(0, (2, batch))      # [2, B, T_t, D]
        ce, distinct = [], []
        for region, tokens in zip(student.region, student.tokens):  # one resolution group at a time
            log_p = F.log_softmax(region.float() / self.student_temp, dim=-1)
            log_p = log_p.unflatten(0, (-1, batch))
            s_tokens = tokens.float().unflatten(0, (-1, batch))   # [n, B, T_s, D]
            match = self.match_similarity(s_tokens, t_tokens)     # [2, n, B, T_s]
            ce_all = -torch.einsum("bitk,vbsk->ivbst", q, log_p)  # all student x teacher tokens
            ce_matched = ce_all.gather(-1, match[..., None]).squeeze(-1)
            ce.append(ce_matched.mean(dim=(2, 3)))                # [2, n]
            hit = torch.zeros(*match.shape[:3], q.shape[2], device=q.device)
            hit.scatter_(-1, match, 1.0)
            distinct.append(hit.sum(-1).mean(-1))                 # [2, n]
        return torch.cat(ce, dim=1), torch.cat(distinct, dim=1)

    @staticmethod
    @torch.no_grad()
    def match_similarity(s_tokens, t_tokens):
        """For every student token, the teacher token with the highest cosine similarity of the
        backbone tokens (not of the head outputs):
        [n, B, T_s, D], [2, B, T_t, D] -> [2, n, B, T_s]."""
        s_tokens, t_tokens = F.normalize(s_tokens, dim=-1), F.normalize(t_tokens, dim=-1)
        return torch.einsum("vbsd,ibtd->ivbst", s_tokens, t_tokens).argmax(dim=-1)

    @torch.no_grad()
    def update_centers(self, teacher):
        """Collective: EMA of the mean raw teacher outputs over both global crops of every process:
        `center` from the view logits, `center_grid` from the region logits of every token."""
        outputs = [(self.center, teacher.view)]
        if self.use_region_loss:
            outputs.append((self.center_grid, teacher.region[0].flatten(0, 1)))
        for center, output in outputs:
            batch_center = common.all_reduce_sum(
                output.sum(dim=0, keepdim=True, dtype=torch.float32))
            batch_center = batch_center / (len(output) * common.get_world_size())
            center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)


# ================================================================================================
# Model: backbone + view head on the global feature + region head on every token
# ================================================================================================
class EsViT(nn.Module):
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
             for _ in range(1 + args.use_region_loss)]
    return EsViT(backbone, *heads)


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
            with torch.no_grad():
                teacher_output = teacher(crops[:2])      # the teacher sees the 2 global crops only
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
    checks.claim_output_dir(args.output_dir, "esvit.py")  # checks
    ckpt = common.checkpoint_to_resume(args.output_dir)  # None: a fresh start
    args.world_size = common.get_world_size()  # recorded: with the batch, the peak lr
    checks.check_resumed_args(ckpt, args, "esvit")  # checks
    # refused before any data or model work
    if ckpt is None and args.init_from and not Path(args.init_from).is_file():
        common.die(f"--init_from {args.init_from} is not a file")
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
    criterion = EsViTLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp,
                          args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs,
                          args.use_region_loss, niter_per_ep=n_steps).to(device)
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

    # ---- resume from output_dir/checkpoint.pth if it exists, else continue a view-only run
    # (--init_from)
    ckpt_path = Path(args.output_dir) / "checkpoint.pth"
    checks.check_resumed_dataset(ckpt, dataset, args)  # checks
    start_epoch, start_step = common.resume_position(ckpt, args.output_dir)
    if ckpt is not None:
        common.restore(ckpt, student=student, teacher=teacher, optimizer=optimizer, scaler=scaler,
                       esvit_loss=criterion)
        common.set_rng_state(ckpt["rng"][common.get_rank() % len(ckpt["rng"])])
        common.log(f"resumed from {ckpt_path} at epoch {start_epoch}, step {start_step}")
    elif args.init_from:
        start_epoch, start_step = init_from_view_only(args.init_from, student, teacher,
                                                      criterion, args)
        if start_step >= n_steps:  # a mid-epoch checkpoint of longer epochs: none of it is left
            common.die(f"--init_from {args.init_from} stopped after step {start_step} of epoch "
                       f"{start_epoch}, but this run's epochs have {n_steps} steps (other data or "
                       f"--max_steps_per_epoch?); give a checkpoint of an epoch's end, or the "
                       f"run's data and steps")

    common.save_args(args, "esvit.py")  # every start-up check passed
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


def init_from_view_only(path, student, teacher, criterion, args):
    """The paper's continual pre-training: start from a view-only checkpoint (esvit.py
    --use_region_loss false, or dino.py with the same --arch) and add the region loss. Student and
    teacher weights, the view centre and the position (epoch, step) come from the checkpoint; the
    region head (absent from it) and the region centre keep their fresh initialisation; the
    optimizer starts anew. Returns (epoch, step) to continue from."""
    ckpt = common.load_checkpoint(path)
    if isinstance(ckpt, dict) and isinstance(ckpt.get("args"), argparse.Namespace):
        common.die(f"--init_from {path} was written by the authors' code, not esvit.py or dino.py: "
                   "evaluate it with --pretrained_weights of eval_knn.py or eval_linear.py")
    if not isinstance(ckpt, dict) or ckpt.get("method") not in ("esvit", "dino"):
        common.die(f"--init_from {path} is not a checkpoint.pth of esvit.py or dino.py")
    fresh = []
    for name, module in (("student", common.unwrap(student)), ("teacher", teacher)):
        if name not in ckpt:
            common.die(f"--init_from {path} has no {name!r} entry (not a checkpoint.pth of "
                       "esvit.py or dino.py?)")
        own = module.state_dict()
        missing = {k: v for k, v in own.items()
                   if k.startswith("region_head.") and k not in ckpt[name]}
        common.load_state_dict_strict(module, {**missing, **ckpt[name]},
                                      what=f"{name} (--init_from {path})")
        fresh += [f"{name}.{k}" for k in missing]
    view_loss = ckpt.get("esvit_loss", ckpt.get("dino_loss"))
    if view_loss is None:
        common.die(f"--init_from {path} has no esvit_loss or dino_loss entry with the view centre")
    criterion.center.copy_(view_loss["center"])
    if ckpt["epoch"] >= args.epochs:
        common.die(f"--init_from {path} ends at epoch {ckpt['epoch']}; raise --epochs above it")
    common.log(f"initialised from {path} at epoch {ckpt['epoch']}, step {ckpt.get('step', 0)} "
               f"(optimizer restarted); {len(fresh)} region-head tensors not in the checkpoint "
               "start fresh" + (f": {', '.join(fresh[:4])} ..." if fresh else ""))
    return ckpt["epoch"], ckpt.get("step", 0)


def save_checkpoints(student, teacher, optimizer, scaler, criterion, epoch, step, args, dataset):
    """Collective: checkpoint.pth, everything needed to resume at batch `step` of `epoch` (every
    process takes part: each one's RNG state is saved). At an epoch boundary (step 0) also a copy
    every saveckp_freq epochs and the teacher backbone alone with timm key names (for eval_knn.py,
    eval_linear.py and timm)."""
    state = {"student": common.unwrap(student).state_dict(), "teacher": teacher.state_dict(),
             "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "esvit_loss": criterion.state_dict(), "epoch": epoch, "step": step, "args": vars(args),
             "method": "esvit", "backbone": common.backbone_record(teacher.backbone),
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
