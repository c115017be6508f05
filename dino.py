"""DINO: self-distillation with no labels (Caron et al., "Emerging Properties in Self-Supervised
Vision Transformers", ICCV 2021).

The loss is `DINOLoss`, the model `DINO`. Every other self-distillation file here starts from this
one: `diff dino.py esvit.py` (glsd.py, selfpatch.py) shows what that method adds.

Idea. A student network is trained to predict, from every crop of an image, the output
distribution that a teacher network gives on the two large (global) crops of the same image. The
teacher is not trained: it is an exponential moving average (EMA) of the student. Collapse is
avoided by centering the teacher's outputs (a running mean subtracted before the softmax) and
sharpening them (a low teacher temperature).

Loss (paper Eq. 3, as the authors' code computes it). With student temperature tau_s = 0.1,
teacher temperature tau_t, center c and crops V (2 global + N local):

    P_t(x) = softmax((g_t(x) - c) / tau_t)          (no gradient)
    P_s(x) = softmax(g_s(x) / tau_s)
    L = 1/(2|V| - 2) * sum_{x in {x1_g, x2_g}} sum_{x' in V, x' != x} mean_batch H(P_t(x), P_s(x'))

    with H(a, b) = -sum_k a_k log b_k, and after each step
    c <- 0.9 c + 0.1 mean_{batch, x in globals} g_t(x)

Where the paper's text and the authors' code differ, this file follows the code:
  * the loss is the *mean* over the 2|V| - 2 (teacher, student) crop pairs, not the sum;
  * the teacher temperature defaults to a constant 0.04 (`--warmup_teacher_temp_epochs 0`); the
    paper's 0.04 -> 0.07 over 30 epochs is the longer recipe in the README;
  * gradient clipping is per parameter tensor (each clipped to norm 3.0), not global;
  * position embeddings of local crops are interpolated with DINO's own bicubic formula
    (`common.ViT`), which timm's default resampling does not reproduce.
Other choices of this file: the loss is written as one [2, |V|] matrix of pairwise
cross-entropies (an einsum) instead of a double Python loop; losses are computed in float32 under
mixed precision.
"""
import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import common
import device_crops


# ================================================================================================
# Arguments (defaults: the authors' main_dino.py; the paper's advice in the help strings)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("dino.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_backbone_args(p, arch="vit_small", drop_path_rate=0.1)

    g = p.add_argument_group("DINO head and loss")
    # K = 1: the loss is 0; past 2**18 (DINO tried up to 262144) the last layer is too large
    g.add_argument("--out_dim", default=65536, type=common.ranged(int, 2, 2 ** 18),
                   help="K, the number of prototypes; 65536 works well for ViT-S/16 on ImageNet")
    g.add_argument("--norm_last_layer", default=True, type=common.bool_flag,
                   help="freeze the gain of the weight-normalised last layer (stabler; set false "
                        "for better ViT-S performance if training is stable)")
    g.add_argument("--use_bn_in_head", default=False, type=common.bool_flag,
                   help="batch norm in the head MLP (not with ViTs)")
    common.add_head_size_args(g)
    g.add_argument("--momentum_teacher", default=0.996, type=common.FRACTION,
                   help="EMA momentum base, cosine to 1; use 0.9995 with batches of 256 or less")
    g.add_argument("--warmup_teacher_temp", default=0.04, type=common.POSITIVE,
                   help="teacher temperature at epoch 0")
    g.add_argument("--teacher_temp", default=0.04, type=common.POSITIVE,
                   help="teacher temperature after warmup; above 0.07 training becomes unstable")
    g.add_argument("--warmup_teacher_temp_epochs", default=0, type=common.SPAN,
                   help="epochs of linear teacher-temperature warmup (the paper: 30, with "
                        "--teacher_temp 0.07); whole epochs ramp per epoch as the authors' code, a "
                        "fraction per step")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size_per_gpu", default=64, type=common.POSITIVE_INT,
                   help="images per process")
    g.add_argument("--epochs", default=100, type=common.EPOCHS,
                   help="training epochs; the paper's ViT-S/16 recipe: 300 "
                        "(the authors' default 100)")
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
                   help="epochs during which the head's last layer is not updated (helps early "
                        "training; a fraction counts steps)")
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
class DINOLoss(nn.Module):
    """Cross-entropy between the centered, sharpened teacher distribution of each global crop and
    the student distribution of every *other* crop, averaged over the 2*ncrops - 2 pairs."""

    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, student_temp=0.1, center_momentum=0.9,
                 niter_per_ep=1):
        super().__init__()
        self.ncrops = ncrops
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.register_buffer("other_pairs", common.other_crop_pairs(ncrops), persistent=False)
        self.teacher_temp_schedule = common.teacher_temperature_schedule(
            warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs, niter_per_ep)

    def forward(self, student_output, teacher_output, step):
        """student_output [ncrops*B, K] and teacher_output [2*B, K], crop-major rows; `step`, the
        global iteration, picks the teacher temperature."""
        student_output, teacher_output = student_output.float(), teacher_output.float()
        temp = self.teacher_temp_schedule[step]
        log_p = F.log_softmax(student_output / self.student_temp, dim=-1)
        log_p = log_p.unflatten(0, (self.ncrops, -1))
        q = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().unflatten(0, (2, -1))
        batch = q.shape[1]
        ce = -torch.einsum("tbk,sbk->ts", q, log_p) / batch  # [teacher crop t, student crop s]
        loss = ce.flatten()[self.other_pairs].mean()         # the pairs of different crops
        self.update_center(teacher_output)
        teacher_entropy = -(q * q.clamp_min(1e-12).log()).sum(-1).mean()
        return {"loss": loss, "teacher_entropy": teacher_entropy.detach(),
                "center_norm": self.center.norm()}

    @torch.no_grad()
    def update_center(self, teacher_output):
        """Collective: EMA of the mean raw teacher output over both global crops of every
        process."""
        batch_center = common.all_reduce_sum(teacher_output.sum(dim=0, keepdim=True))
        batch_center = batch_center / (len(teacher_output) * common.get_world_size())
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)


# ================================================================================================
# Model: backbone + projection head over all crops
# ================================================================================================
class DINO(nn.Module):
    """Backbone (global feature: ViT CLS, Swin average-pooled tokens) + DINO projection head.
    Consecutive crops of equal resolution go through the backbone as one batch."""

    def __init__(self, backbone, head):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, crops):
        return self.head(torch.cat(common.forward_multicrop(self.backbone, crops)))


def build_model(args, drop_path_rate):
    backbone = common.backbone_from_args(args, drop_path_rate)
    head = common.DINOHead(backbone.num_features, args.out_dim, use_bn=args.use_bn_in_head,
                           norm_last_layer=args.norm_last_layer, hidden_dim=args.head_hidden_dim,
                           bottleneck_dim=args.head_bottleneck_dim)
    return DINO(backbone, head)


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
    checks.claim_output_dir(args.output_dir, "dino.py")  # checks
    ckpt = common.checkpoint_to_resume(args.output_dir)  # None: a fresh start
    args.world_size = common.get_world_size()  # recorded: with the batch, the peak lr
    checks.check_resumed_args(ckpt, args, "dino")  # checks
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
    criterion = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp,
                         args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs,
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
                       dino_loss=criterion)
        common.set_rng_state(ckpt["rng"][common.get_rank() % len(ckpt["rng"])])
        common.log(f"resumed from {ckpt_path} at epoch {start_epoch}, step {start_step}")

    common.save_args(args, "dino.py")  # every start-up check passed
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
             "dino_loss": criterion.state_dict(), "epoch": epoch, "step": step, "args": vars(args),
             "method": "dino", "backbone": common.backbone_record(teacher.backbone),
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
