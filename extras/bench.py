"""Speed, memory and efficiency of every method's training step, and of the multi-crop data pipeline.

Not a test (pytest collects only tests/test_*.py); `tests/test_bench_smoke.py` keeps it running.

What is timed. For each method the script builds what the method's `main()` builds, from the
method's own argument parser (`get_args_parser().parse_args([...])`): student, EMA teacher, loss,
AdamW parameter groups, grad scaler, and one batch of `synthetic` images through the method's own
augmentation (multi-crop with geometry; DRLoc: timm's supervised transform). A step is the body of
the method's `train_one_epoch` loop on that batch, in two halves:
  forward-backward  teacher forward (no grad) + student forward + loss + non-finite check + backward
  update            unscale + gradient clipping + frozen last layer + AdamW step + EMA of the teacher
(DRLoc: mixup + model + loss + backward; global-norm clip + AdamW). Data loading is not in the step.
After W warm-up steps, N timed steps give the median, min and max time per step.

How the step is split (each part timed on its own, N times, on the step's own tensors):
  backbone    the backbone calls of the step, replayed with the recorded inputs: student forward +
              backward, teacher forward (no grad)
  heads+loss  the step's forward-backward with every backbone call answered from a recording (the
              backbone does not run), minus `extra`: heads, aggregation module, losses, centers
              (DRLoc: and mixup)
  update      the update half above, on the gradients of a real step
  extra       the method's own work beyond heads and losses: token matching (EsViT, GLSD
              similarity: cosine argmax; GLSD geometric: token centres + nearest centre + threshold),
              SelfPatch's neighbour selection (top-k of the 8 adjacent patches), DRLoc's pair
              sampling + gathering (forward and backward) + targets
Shares are of the median step; being timed separately, they need not add up to exactly 100%.

FLOPs: one forward-backward under `torch.utils.flop_counter.FlopCounterMode` (matmuls and
convolutions; optimizer and elementwise work count 0). FlopCounterMode counts the fused attention
kernels of CUDA (flash / efficient / cuDNN) but not the CPU kernel `scaled_dot_product_attention`
dispatches to (checked with torch 2.14: `_scaled_dot_product_flash_attention_for_cpu` has no FLOP
formula, so it counts 0): where it does not, every SDPA call is counted analytically (QK^T and PV:
2 * batch * heads * Lq * Lk * (d_k + d_v) forward, twice that backward). The header says which.
MFU = FLOPs per step / median step time / the measured dense-matmul peak of the same dtype.

Memory: CPU, the peak resident set size during the timed steps (VmHWM, reset before them) minus
the resident size before the method's models were built; CUDA, the peak allocated memory during the
timed steps minus the allocated memory before the models were built.

Data pipeline: images/s of one process (= one loader worker) over 64 generated 500 x 375 JPEGs,
decoding included: `common.MultiCropAugmentation` under `common.SeededDataset` (records each crop's
geometry) against a plain torchvision/PIL pipeline with DINO's transforms.

Commands:
  python extras/bench.py                                       # CPU preset (vit_pico), ~2-3 minutes
  python extras/bench.py --arch swin_pico                      # the same with a Swin (no SelfPatch)
  python extras/bench.py --preset paper --device cuda          # ViT-S/16, 2 x 224 + 8 x 96, batch 64
  python extras/bench.py --preset paper --device cuda --arch swin_tiny
  python extras/bench.py --methods dino glsd_geometric --precisions bf16 --steps 2
  python extras/bench.py --recipe quickstart                   # the README quick start, old vs new path

--recipe quickstart (instead of the rows above): the README quick start's DINO training (vit_pico/4,
batch 128, 2 x 32 + 4 x 16 px crops of Fashion-MNIST), run by dino.train_one_epoch itself on a real
loader, in several configurations side by side in one process, interleaved (rounds of --recipe_steps
steps each, the first step of every round not counted), so that a shared machine's load hits all
alike: img/s = batch / median step time (data wait included); CPU s/step = the CPU time a step
costs this process and its loader workers (robust to other load, which wall time is not). Then the profile of one step of each
configuration (each part timed on its own: building the batch's crops in this process, teacher
forward, student forward, loss, backward, clipping, AdamW, EMA, per-step bookkeeping), its FLOPs and
its share of the dense-matmul peak, and the number of operators a step dispatches.
"""
import argparse
import contextlib
import ctypes
import gc
import io
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFilter
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode
from torchvision import datasets as tv_datasets
from torchvision import transforms

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dino  # noqa: E402
import drloc  # noqa: E402
import esvit  # noqa: E402
import glsd  # noqa: E402
import selfpatch  # noqa: E402

# name -> (module, extra command-line flags of that module)
METHODS = {
    "dino": (dino, []),
    "esvit": (esvit, ["--use_region_loss", "true"]),
    "esvit_view": (esvit, ["--use_region_loss", "false"]),
    "glsd_none": (glsd, ["--local_matching", "none"]),
    "glsd_similarity": (glsd, ["--local_matching", "similarity"]),
    "glsd_geometric": (glsd, ["--local_matching", "geometric"]),
    "selfpatch": (selfpatch, []),
    "drloc": (drloc, []),
    "drloc_base": (drloc, ["--lambda_drloc", "0"]),
}

# The CPU preset keeps the heads in proportion to the 64-wide vit_pico: per token, a 256-wide head
# with K = 1024 costs 0.7x the backbone, as the papers' 2048-wide head with K = 65536 costs about
# 1x ViT-S/16 (the papers' head on vit_pico would cost 25x the backbone and hide everything else).
PRESETS = {
    "cpu": dict(arch="vit_pico", patch_size=8, global_crop_size=64, local_crop_size=32, local_crops_number=4,
                batch_size=16, out_dim=1024, patch_out_dim=256, head_hidden_dim=256, head_bottleneck_dim=64),
    "paper": dict(arch="vit_small", patch_size=16, global_crop_size=224, local_crop_size=96, local_crops_number=8,
                  batch_size=64, out_dim=65536, patch_out_dim=4096, head_hidden_dim=2048, head_bottleneck_dim=256),
}
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def get_args_parser():
    p = argparse.ArgumentParser("bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="defaults of the flags below: cpu (vit_pico, 2 x 64 + 4 x 32 px, batch 16, small heads) "
                        "or paper (ViT-S/16, 2 x 224 + 8 x 96 px, batch 64, the papers' heads); flags override it")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="rows to run")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PRECISION_DTYPES),
                   help="autocast dtypes (fp16: CUDA only)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    g = p.add_argument_group("model and crops (default: from --preset)")
    g.add_argument("--arch", choices=list(common.ARCHS))
    g.add_argument("--patch_size", type=int, help="ViT patch size")
    g.add_argument("--window_size", type=int, default=7, help="Swin window size")
    g.add_argument("--global_crop_size", type=int, help="pixels (DRLoc's --input_size too)")
    g.add_argument("--local_crop_size", type=int, help="pixels")
    g.add_argument("--local_crops_number", type=int)
    g.add_argument("--batch_size", type=int, help="images per step")
    g.add_argument("--out_dim", type=int, help="K of every DINO head")
    g.add_argument("--patch_out_dim", type=int, help="K_p of SelfPatch's patch head")
    g.add_argument("--head_hidden_dim", type=int)
    g.add_argument("--head_bottleneck_dim", type=int)
    g = p.add_argument_group("measurement")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    g.add_argument("--steps", type=int, default=5, help="timed steps (and repetitions of each part)")
    g.add_argument("--peak_seconds", type=float, default=1.0, help="time spent measuring each matmul peak")
    g.add_argument("--profile", action="store_true",
                   help="also print each row's 8 most expensive operators (torch.profiler, one step): "
                        "where the time goes")
    g.add_argument("--skip_data", action="store_true", help="skip the data-pipeline section")
    g.add_argument("--data_images", type=int, default=64, help="JPEGs in the data-pipeline section")
    g.add_argument("--data_passes", type=int, default=3, help="passes over them per pipeline (median)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("recipe (instead of the method rows)")
    g.add_argument("--recipe", choices=["quickstart"], help="time a README recipe end to end, old path vs new path")
    g.add_argument("--recipe_rounds", type=int, default=3, help="interleaved rounds per configuration")
    g.add_argument("--recipe_steps", type=int, default=8, help="training steps per round")
    g.add_argument("--recipe_threads", type=int, help="torch threads of the training process (default: torch's); "
                                                      "1 on a busy machine: CPU s/step then counts work, not spinning")
    return p


def parse_args(argv=None):
    parser = get_args_parser()
    preset = parser.parse_known_args(argv)[0].preset
    parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    args.methods = list(dict.fromkeys(args.methods))
    if args.warmup < 1 or args.steps < 1:
        common.die("--warmup and --steps must be at least 1 (a warm-up step records the backbone calls)")
    return args


# ================================================================================================
# Measuring: time, FLOPs, memory, matmul peak
# ================================================================================================
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, reps, device, warmup=0):
    """Seconds of each of `reps` calls of fn (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


class AttentionFlops(TorchFunctionMode):
    """Counts every F.scaled_dot_product_attention call analytically: QK^T and PV, 2 * (batch x heads)
    * Lq * Lk * (d_k + d_v) FLOPs forward, and twice that again when autograd will run its backward."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            forward = 2 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
            backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            self.flops += forward * (3 if backward else 1)
        return func(*args, **(kwargs or {}))


def count_flops(fn, sdpa_in_counter):
    """(total FLOPs, attention FLOPs counted analytically) of one call of fn."""
    with FlopCounterMode(display=False) as counter, AttentionFlops() as attention:
        fn()
    analytic = 0 if sdpa_in_counter else attention.flops
    return counter.get_total_flops() + analytic, attention.flops


def sdpa_counted_by_flop_counter(device):
    """Whether FlopCounterMode counts F.scaled_dot_product_attention on this device."""
    q = torch.randn(1, 1, 8, 8, device=device)
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, q, q)
    return counter.get_total_flops() > 0


def matmul_peak(device, dtype, seconds):
    """Best FLOP/s of square matmuls (CPU: 1024 and 2048, CUDA: 4096 and 8192) in `dtype`."""
    best = 0.0
    for n in ((4096, 8192) if device.type == "cuda" else (1024, 2048)):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline:
            best = max(best, 2 * n ** 3 / min(timed(lambda: torch.mm(a, b), 1, device)))
    return best


def measure_peaks(device, args, before=None):
    """Matmul peak per precision; the best of this measurement and `before` (on a shared machine a
    busy moment lowers one of them)."""
    return {p: max(matmul_peak(device, PRECISION_DTYPES[p], args.peak_seconds), (before or {}).get(p, 0.0))
            for p in args.precisions}


def _proc_status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_now(device):
    """Bytes in use: allocated on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        return _proc_status_kb("VmRSS") * 1024
    except (OSError, KeyError):   # no /proc (macOS): the process peak is the best there is
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory(device):
    """Return freed memory to the system (CUDA cache; glibc's heap via malloc_trim), so that the next
    row's baseline does not hold the previous row's freed tensors."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:   # "5" resets the peak RSS (Linux >= 4.0)
            f.write("5")


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        return _proc_status_kb("VmHWM") * 1024
    except (OSError, KeyError):
        return memory_now(device)


# ================================================================================================
# Backbone calls: record them in a real step, then replay them (to time the backbone alone) or
# answer them from the recording (to time everything but the backbone)
# ================================================================================================
def detached(out, requires_grad=False):
    if isinstance(out, tuple):
        return tuple(detached(o, requires_grad) for o in out)
    if out is None:
        return None
    return out.detach().requires_grad_(requires_grad and out.is_floating_point())


@contextlib.contextmanager
def backbone_calls(backbone, calls, answer=False):
    """Within the block, every call of `backbone.forward` or `backbone.forward_dense` (the only entry
    points the method files use) is appended to `calls` as (method, args, kwargs, detached output);
    with `answer=True` the calls are answered, in order, from `calls` without running the backbone.
    Answers are new leaf tensors that require grad under grad mode, so the student's backward stops
    at them, as it would at the real backbone's output."""
    position = iter(range(len(calls)))
    for name in ("forward", "forward_dense"):
        original = getattr(backbone, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            if answer:
                return detached(calls[next(position)][3], torch.is_grad_enabled())
            out = _original(*args, **kwargs)
            calls.append((_name, args, kwargs, detached(out)))
            return out
        setattr(backbone, name, wrapper)
    try:
        yield
    finally:
        for name in ("forward", "forward_dense"):
            delattr(backbone, name)            # back to the class's methods


def run_recorded_calls(backbone, calls):
    """Run the recorded calls again; returns their outputs (a flat list of tensors)."""
    outs = []
    for name, args, kwargs, _ in calls:
        out = getattr(backbone, name)(*args, **kwargs)
        outs += [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    return outs


# ================================================================================================
# One method's training step, built like its main()
# ================================================================================================
def method_args(name, precision, args, output_dir):
    """The method's own args from its own parser, with the bench's backbone, crops and heads."""
    module, flags = METHODS[name]
    argv = ["--arch", args.arch, "--patch_size", str(args.patch_size), "--window_size", str(args.window_size),
            "--batch_size_per_gpu", str(args.batch_size), "--dataset", "synthetic",
            "--synthetic_images", str(max(args.batch_size, 10)),
            "--synthetic_image_size", str(args.global_crop_size), "--precision", precision,
            "--device", args.device, "--output_dir", output_dir, "--num_workers", "0", "--seed", str(args.seed)]
    if module is drloc:
        argv += ["--input_size", str(args.global_crop_size)]
    else:
        argv += ["--global_crop_size", str(args.global_crop_size), "--local_crop_size", str(args.local_crop_size),
                 "--local_crops_number", str(args.local_crops_number), "--out_dim", str(args.out_dim),
                 "--head_hidden_dim", str(args.head_hidden_dim), "--head_bottleneck_dim", str(args.head_bottleneck_dim)]
    if module is selfpatch:
        argv += ["--patch_out_dim", str(args.patch_out_dim)]
    return module.get_args_parser().parse_args(argv + flags)


def one_batch(dataset, batch_size):
    return torch.utils.data.default_collate([dataset[i] for i in range(batch_size)])


class SelfDistillationStep:
    """DINO, EsViT, GLSD, SelfPatch: student, EMA teacher, loss and AdamW as in their main()."""

    def __init__(self, name, a, device):
        self.name, self.a, self.device = name, a, device
        self.module = module = METHODS[name][0]
        common.check_crop_sizes(a)
        augment = common.MultiCropAugmentation(a.global_crops_scale, a.local_crops_scale, a.local_crops_number,
                                               a.global_crop_size, a.local_crop_size)
        dataset = common.SeededDataset(common.build_dataset(a, train=True), augment, seed=a.seed)
        (crops, geometry), _ = one_batch(dataset, a.batch_size_per_gpu)
        self.crops = [c.to(device) for c in crops]
        self.geometry = [{k: v.to(device) for k, v in g.items()} for g in geometry]
        self.student = module.build_model(a, a.drop_path_rate).to(device)
        self.teacher = module.build_model(a, 0.0).to(device)
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)
        self.criterion = self.build_criterion().to(device)
        params = common.get_params_groups(self.student)
        self.optimizer = (torch.optim.AdamW(params) if a.optimizer == "adamw"
                          else torch.optim.SGD(params, lr=0, momentum=0.9))
        self.scaler = common.make_grad_scaler(device, a.precision)
        # a typical step: after the frozen-last-layer epochs, lr and wd at their base values
        self.epoch, self.momentum = a.freeze_last_layer, a.momentum_teacher
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = a.lr * a.batch_size_per_gpu / 256
            if i == 0:
                group["weight_decay"] = a.weight_decay

    def build_criterion(self):
        a, ncrops = self.a, self.a.local_crops_number + 2
        temps = (a.warmup_teacher_temp, a.teacher_temp, a.warmup_teacher_temp_epochs, a.epochs)
        if self.module is dino:
            return dino.DINOLoss(a.out_dim, ncrops, *temps)
        if self.module is esvit:
            return esvit.EsViTLoss(a.out_dim, ncrops, *temps, a.use_region_loss)
        if self.module is glsd:
            return glsd.GLSDLoss(a.out_dim, ncrops, *temps, a.local_matching, a.match_threshold)
        return selfpatch.SelfPatchLoss(a.out_dim, a.patch_out_dim, ncrops, *temps, a.patch_loss_weight)

    def backbones(self):
        return {"student": self.student.backbone, "teacher": self.teacher.backbone}

    def forward_backward(self):
        a, crops = self.a, self.crops
        with common.autocast(self.device, a.precision):
            with torch.no_grad():
                if self.module is selfpatch:
                    teacher_output = self.teacher(crops, aggregate_positives=True)
                else:
                    teacher_output = self.teacher(crops[:2])
            student_output = self.student(crops)
        if self.module is glsd:
            losses = self.criterion(student_output, teacher_output, self.epoch, self.geometry)
        else:
            losses = self.criterion(student_output, teacher_output, self.epoch)
        common.stop_if_not_finite(losses["loss"], self.epoch, a, lambda: {
            "student": self.student.state_dict(), "teacher": self.teacher.state_dict()})
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(losses["loss"]).backward()
        return losses

    def update(self):
        if self.a.clip_grad:
            self.scaler.unscale_(self.optimizer)
            common.clip_gradients(self.student, self.a.clip_grad)
        common.cancel_gradients_last_layer(self.epoch, self.student, self.a.freeze_last_layer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        common.update_teacher(self.student, self.teacher, self.momentum)

    def extra(self, calls):
        """The method's own work beyond heads and losses, on the recorded backbone outputs; None if none."""
        batch, name = self.a.batch_size_per_gpu, self.name
        student_grids = [out[1] for _, _, _, out in calls["student"] if isinstance(out, tuple)]  # forward_dense
        teacher_grids = [out[1] for _, _, _, out in calls["teacher"] if isinstance(out, tuple)]
        if name in ("esvit", "glsd_similarity"):
            match = self.criterion.match_similarity
            t_tokens = teacher_grids[0].flatten(1, 2).float().unflatten(0, (2, batch))
            s_tokens = [g.flatten(1, 2).float().unflatten(0, (-1, batch)) for g in student_grids]
            return lambda: [match(s, t_tokens) for s in s_tokens]
        if name == "glsd_geometric":
            groups = common.resolution_groups(self.crops)

            def geometric():
                t_geometry = glsd.token_geometry(self.geometry[:2], tuple(teacher_grids[0].shape[1:3]), batch)
                for (start, end), grid in zip(groups, student_grids):
                    s_geometry = glsd.token_geometry(self.geometry[start:end], tuple(grid.shape[1:3]), batch)
                    self.criterion.match_geometric(s_geometry, t_geometry)
            return geometric
        if name == "selfpatch":
            return lambda: [self.teacher.positives(grid) for grid in teacher_grids]
        return None


class DRLocStep:
    """DRLoc: supervised model + DRLoc head(s), mixup, AdamW as in drloc.main()."""

    def __init__(self, name, a, device):
        self.name, self.a, self.device = name, a, device
        drloc.check_args(a)
        base = common.build_dataset(a, train=True)
        dataset = common.SeededDataset(base, drloc.train_transform(a), seed=a.seed)
        images, labels = one_batch(dataset, a.batch_size_per_gpu)
        self.images, self.labels = images.to(device), labels.to(device)
        num_classes = drloc.count_classes(base)
        self.mixup = None
        if a.mixup > 0 or a.cutmix > 0:
            self.mixup = drloc.Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, label_smoothing=a.smoothing,
                                     num_classes=num_classes)
        self.model = drloc.build_model(a, num_classes).to(device)
        self.model.train()
        self.criterion = drloc.DRLocLoss(a.drloc_mode, a.drloc_targets == "signed", a.drloc_normalize,
                                         a.smoothing).to(device)
        self.optimizer = torch.optim.AdamW(common.get_params_groups(self.model, drloc.NO_WEIGHT_DECAY),
                                           weight_decay=a.weight_decay)
        self.scaler = common.make_grad_scaler(device, a.precision)
        for group in self.optimizer.param_groups:
            group["lr"] = a.lr * a.batch_size_per_gpu / 512
        self.epoch, self.it, self.lambda_drloc = 0, 0, a.lambda_drloc

    def backbones(self):
        return {"student": self.model.backbone}

    def forward_backward(self):
        a = self.a
        images, labels = self.images, self.labels
        if self.mixup is not None:
            images, labels = self.mixup(images, labels)
        with common.autocast(self.device, a.precision):
            outputs = self.model(images, generator=drloc.pair_generator(a.seed, self.epoch, self.it))
            losses = self.criterion(outputs, labels, self.lambda_drloc)
        common.stop_if_not_finite(losses["loss"], self.epoch, a, lambda: {"model": self.model.state_dict()})
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(losses["loss"]).backward()
        self.it += 1
        return losses

    def update(self):
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.a.clip_grad or math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def extra(self, calls):
        """Pair sampling, gathering the pairs' embeddings (forward and backward) and their targets."""
        if not len(self.model.drloc):
            return None
        a, model = self.a, self.model
        with common.autocast(self.device, a.precision), torch.no_grad():
            _, grids = model.features(self.images)

        def pairs():
            generator = drloc.pair_generator(a.seed, self.epoch, self.it)
            gathered = []
            for grid in grids:
                k = grid.shape[1]
                pos_a, pos_b = model.sample(len(grid), k, generator)
                gathered.append(drloc.gather_pairs(grid.detach().requires_grad_(), pos_a, pos_b).float().sum())
                drloc.relative_targets(pos_a, pos_b, k, a.drloc_targets == "signed", a.drloc_normalize)
            sum(gathered).backward()
        return pairs


def build_step(name, precision, args, device, output_dir):
    a = method_args(name, precision, args, output_dir)
    common.fix_random_seeds(args.seed)                  # same initial weights for fp32 and bf16
    with contextlib.redirect_stdout(io.StringIO()):     # the method files log as they build
        if METHODS[name][0] is drloc:
            return DRLocStep(name, a, device)
        return SelfDistillationStep(name, a, device)


def measure(name, precision, args, device, output_dir, flops_cache, sdpa_counted):
    """One row: times, memory, FLOPs and the split of the step of one method in one precision."""
    release_free_memory(device)
    memory_before = memory_now(device)
    step = build_step(name, precision, args, device, output_dir)
    backbones = step.backbones()
    calls = {role: [] for role in backbones}
    losses = []

    def full_step():
        out = step.forward_backward()
        step.update()
        losses.append({k: v.item() for k, v in out.items()}["loss"])   # the loop's .item() of every stat

    for i in range(args.warmup):
        with contextlib.ExitStack() as stack:
            if i == args.warmup - 1:                    # the last warm-up step records the backbone calls
                for role, backbone in backbones.items():
                    stack.enter_context(backbone_calls(backbone, calls[role]))
            full_step()
    losses.clear()
    reset_peak_memory(device)
    step_times = timed(full_step, args.steps, device)
    memory = peak_memory(device) - memory_before
    step_losses = list(losses)

    if name not in flops_cache:                         # the same in every precision
        flops_cache[name] = count_flops(step.forward_backward, sdpa_counted)
    flops, attention_flops = flops_cache[name]

    def backbone_only():
        with common.autocast(device, step.a.precision):
            if "teacher" in calls:
                with torch.no_grad():
                    run_recorded_calls(backbones["teacher"], calls["teacher"])
            outs = run_recorded_calls(backbones["student"], calls["student"])
        sum(o.float().mean() for o in outs).backward()
        step.optimizer.zero_grad(set_to_none=True)

    def without_backbone():
        with contextlib.ExitStack() as stack:
            for role, backbone in backbones.items():
                stack.enter_context(backbone_calls(backbone, calls[role], answer=True))
            step.forward_backward()

    reps = args.steps
    t_backbone = statistics.median(timed(backbone_only, reps, device, warmup=1))
    t_rest = statistics.median(timed(without_backbone, reps, device, warmup=1))
    step.forward_backward()                             # real gradients for every parameter
    t_update = statistics.median(timed(step.update, reps, device, warmup=1))
    extra = step.extra(calls)
    t_extra = statistics.median(timed(extra, reps, device, warmup=1)) if extra else 0.0
    if args.profile:
        with torch.profiler.profile() as profiler:
            full_step()
        print(f"{name} {precision}: one step under torch.profiler, by self time")
        print(profiler.key_averages().table(sort_by="self_device_time_total" if device.type == "cuda"
                                            else "self_cpu_time_total", row_limit=8))
    median = statistics.median(step_times)
    return dict(method=name, precision=precision, median=median, min=min(step_times), max=max(step_times),
                images_per_s=step.a.batch_size_per_gpu / median, memory=memory, flops=flops,
                attention_flops=attention_flops, backbone=t_backbone / median,
                heads=(t_rest - t_extra) / median, update=t_update / median,
                extra=t_extra / median if extra else None, losses=step_losses)


# ================================================================================================
# Data pipeline: the repository's multi-crop vs a plain PIL pipeline with DINO's transforms
# ================================================================================================
def make_jpegs(folder, n, seed=0, size=(500, 375)):
    """n photo-like JPEGs (smooth colour fields, shapes with edges, sensor-like noise), ImageNet's
    typical size and quality, in folder/images/ (an ImageFolder with one class)."""
    rng = np.random.default_rng(seed)
    out = Path(folder) / "images"
    out.mkdir(parents=True)
    for i in range(n):
        field = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        draw = ImageDraw.Draw(field)
        for _ in range(12):
            x, y = rng.uniform(0, size[0]), rng.uniform(0, size[1])
            r = rng.uniform(10, 80)
            fill = tuple(int(c) for c in rng.integers(0, 256, 3))
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape([x - r, y - r * 0.7, x + r, y + r * 0.7], fill=fill)
        pixels = np.asarray(field.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.float32)
        pixels += rng.normal(0, 10, pixels.shape)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out / f"{i:03d}.jpg", quality=90)
    return Path(folder)


class PILBlur:
    """DINO's Gaussian blur: with probability p, a PIL blur of radius ~ U(0.1, 2)."""

    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        if random.random() >= self.p:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


class ReferenceMultiCrop:
    """DINO's multi-crop as plain torchvision transforms on PIL images (no geometry recorded)."""

    def __init__(self, global_size, local_size, n_local, global_scale=(0.4, 1.0), local_scale=(0.05, 0.4)):
        bicubic = transforms.InterpolationMode.BICUBIC
        flip_color = [transforms.RandomHorizontalFlip(),
                      transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                      transforms.RandomGrayscale(p=0.2)]
        tensor = [transforms.ToTensor(), transforms.Normalize(common.IMAGENET_MEAN, common.IMAGENET_STD)]

        def crop(size, scale):
            return [transforms.RandomResizedCrop(size, scale=scale, interpolation=bicubic)]
        self.global1 = transforms.Compose(crop(global_size, global_scale) + flip_color + [PILBlur(1.0)] + tensor)
        self.global2 = transforms.Compose(crop(global_size, global_scale) + flip_color
                                          + [PILBlur(0.1), transforms.RandomSolarize(128, p=0.2)] + tensor)
        self.local = transforms.Compose(crop(local_size, local_scale) + flip_color + [PILBlur(0.5)] + tensor)
        self.n_local = n_local

    def __call__(self, img):
        return [self.global1(img), self.global2(img)] + [self.local(img) for _ in range(self.n_local)]


class PassInWorker(torch.utils.data.Dataset):
    """One item: the seconds of a full pass over `dataset`, timed inside a loader worker, where
    training runs it (SeededDataset skips its generator save/restore there)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return 1

    def __getitem__(self, _):
        start = time.perf_counter()
        for i in range(len(self.dataset)):
            self.dataset[i]
        return time.perf_counter() - start


def seconds_per_pass_in_a_worker(dataset):
    return next(iter(torch.utils.data.DataLoader(PassInWorker(dataset), batch_size=None, num_workers=1)))


def bench_data(args, folder):
    """Rows of images/s (one loader worker) for the bench's crops and, if different, the papers' 2 x 224 + 8 x 96."""
    configs = [(args.global_crop_size, args.local_crop_size, args.local_crops_number)]
    if configs[0] != (224, 96, 8):
        configs.append((224, 96, 8))
    rows = []
    for global_size, local_size, n_local in configs:
        ours = common.SeededDataset(common.ImageFolderSafe(str(folder)), common.MultiCropAugmentation(
            (0.4, 1.0), (0.05, 0.4), n_local, global_size, local_size), seed=args.seed)
        reference = tv_datasets.ImageFolder(str(folder), transform=ReferenceMultiCrop(global_size, local_size, n_local))
        rates = {"repo": [], "reference": []}
        for name, dataset in (("repo", ours), ("reference", reference)):
            for i in range(min(4, len(dataset))):      # warm-up: file cache, lazy imports
                dataset[i]
        for epoch in range(1, args.data_passes + 1):    # alternate, so that load changes hit both alike
            ours.set_epoch(epoch)                       # new crops every pass, as the reference draws
            for name, dataset in (("repo", ours), ("reference", reference)):
                rates[name].append(len(dataset) / seconds_per_pass_in_a_worker(dataset))
        rows.append(dict(crops=f"2 x {global_size} + {n_local} x {local_size}",
                         repo=statistics.median(rates["repo"]), reference=statistics.median(rates["reference"])))
    return rows


# ================================================================================================
# Report
# ================================================================================================
def pct(x):
    if x is None:
        return "—"
    return f"{100 * x:.1f}%" if abs(x) < 0.1 else f"{100 * x:.0f}%"


def print_table(rows, peaks):
    dino_time = {r["precision"]: r["median"] for r in rows if r["method"] == "dino"}
    print("| method | precision | ms/step median (min–max) | img/s | peak MB | GFLOP/step | GFLOP/s | MFU "
          "| vs DINO | backbone | heads+loss | update | extra |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        achieved = r["flops"] / r["median"]
        mfu = achieved / peaks[r["precision"]]
        versus = f"{r['median'] / dino_time[r['precision']]:.2f}x" if r["precision"] in dino_time else "—"
        print(f"| {r['method']} | {r['precision']} | {1e3 * r['median']:.0f} ({1e3 * r['min']:.0f}–"
              f"{1e3 * r['max']:.0f}) | {r['images_per_s']:.1f} | {r['memory'] / 2 ** 20:.0f} | "
              f"{r['flops'] / 1e9:.1f} | {achieved / 1e9:.1f} | {pct(mfu)} | {versus} | {pct(r['backbone'])} | "
              f"{pct(r['heads'])} | {pct(r['update'])} | {pct(r['extra'])} |")


def print_targets(rows, data_rows, peaks, args):
    """The issue's targets that this run can check, each met or missed."""
    print("\nTargets")
    for r in rows:
        if r["extra"] is not None:
            ok = r["extra"] <= 0.05
            print(f"  {'met   ' if ok else 'MISSED'} {r['method']} {r['precision']}: own extra work "
                  f"{pct(r['extra'])} of the step (target <= 5%)")
    mfu = {(r["method"], r["precision"]): r["flops"] / r["median"] / peaks[r["precision"]] for r in rows}
    for (method, precision), value in mfu.items():
        reference = mfu.get(("dino", precision))
        if method != "dino" and reference:
            ok = value >= 0.9 * reference
            print(f"  {'met   ' if ok else 'MISSED'} {method} {precision}: MFU {pct(value)} vs DINO's "
                  f"{pct(reference)} (target: at least 90% of DINO's)")
    native_bf16 = has_native_bf16(torch.device(args.device))
    for method in dict.fromkeys(r["method"] for r in rows):
        by = {r["precision"]: r for r in rows if r["method"] == method}
        if "fp32" in by and "bf16" in by:
            speedup = by["fp32"]["median"] / by["bf16"]["median"]
            gap = max(abs(a - b) for a, b in zip(by["fp32"]["losses"], by["bf16"]["losses"]))
            status = ("met   " if speedup >= 1.4 else "MISSED") if native_bf16 else "n/a   "
            print(f"  {status} {method}: bf16 {speedup:.2f}x faster than fp32 (target >= 1.4x, "
                  f"{'native bf16' if native_bf16 else 'only with native bf16: emulated here'}); loss fp32 "
                  f"{by['fp32']['losses'][-1]:.4f} vs bf16 "
                  f"{by['bf16']['losses'][-1]:.4f} after {len(by['bf16']['losses'])} timed steps "
                  f"(max gap {gap:.4f})")
    for d in data_rows:
        ok = d["repo"] >= d["reference"]
        print(f"  {'met   ' if ok else 'MISSED'} data pipeline {d['crops']}: {d['repo']:.1f} vs reference "
              f"{d['reference']:.1f} img/s (target: not slower, while recording geometry)")
    dino_fp32 = [r for r in rows if (r["method"], r["precision"]) == ("dino", "fp32")]
    if dino_fp32 and (args.arch, args.patch_size) == ("vit_small", 16):
        value = mfu[("dino", "fp32")]
        print(f"  {'met   ' if value >= 0.85 else 'MISSED'} dino fp32 ViT-S/16: MFU {pct(value)} (target >= 85%)")
    elif dino_fp32:
        print("  (DINO ViT-S/16 fp32 MFU >= 85%: measured with --preset paper --precisions fp32 --methods dino)")


def has_native_bf16(device):
    """Whether this GPU or CPU computes in bf16 (elsewhere torch emulates it, many times slower)."""
    facts = common.precision_facts(device)
    return facts["cuda_bf16"] if device.type == "cuda" else facts["cpu_native_bf16"]


def print_header(args, argv, device, sdpa_counted):
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            hardware = names[0] if names else hardware
    print(f"# bench.py: {hardware}, {device}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    facts = common.precision_facts(device)
    auto, why = common.choose_precision(**facts)
    print(f"CPU capability (torch): {facts['cpu_capability']}; native bf16 on {device.type}: "
          f"{'yes' if has_native_bf16(device) else 'no (bf16 rows are emulated)'}; "
          f"--precision auto would train in {auto} ({why})")
    print(f"command: python extras/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    vit = common.ARCHS[args.arch]["family"] == "vit"
    backbone = f"patch {args.patch_size}" if vit else f"window {args.window_size}"
    print(f"config: {args.arch} ({backbone}), 2 x {args.global_crop_size} + {args.local_crops_number} x "
          f"{args.local_crop_size} px crops, batch {args.batch_size}, heads {args.head_hidden_dim}/"
          f"{args.head_bottleneck_dim}/K={args.out_dim} (SelfPatch K_p={args.patch_out_dim}); DRLoc: one "
          f"{args.global_crop_size} px view; {args.warmup} warm-up + {args.steps} timed steps")
    print(f"FlopCounterMode counts scaled_dot_product_attention on {device.type}: "
          f"{'yes' if sdpa_counted else 'no (attention FLOPs added analytically)'}")


# ================================================================================================
# A README recipe end to end: the current path against the faster one, side by side
# ================================================================================================
# The README quick start's training command (its --output_dir and --num_workers come from each configuration).
QUICKSTART = ("--arch vit_pico --patch_size 4 --dataset fashion_mnist --global_crop_size 32 --local_crop_size 16 "
              "--local_crops_number 4 --out_dim 4096 --head_hidden_dim 512 --head_bottleneck_dim 128 "
              "--norm_last_layer false --batch_size_per_gpu 128 --lr 0.004 --weight_decay 0.04 "
              "--weight_decay_end 0.04 --freeze_last_layer 0 --momentum_teacher 0.99 --drop_path_rate 0 "
              "--warmup_epochs 0.5").split()
# name -> flags: the PIL path in loader workers and fp32 (what the quick start ran before the batched
# crops, and what --precision auto chose for vit_pico before bf16 paid at that size) against the batched
# crops in fp32 and at --precision auto (bf16 on a CPU with native bf16; the README quick start's row).
RECIPE_CONFIGS = {
    "PIL crops, 1 worker, fp32": ["--num_workers", "1", "--precision", "fp32"],
    "PIL crops, 2 workers, fp32": ["--num_workers", "2", "--precision", "fp32"],
    "batched crops, 0 workers, fp32": ["--num_workers", "0", "--batched_crops", "true", "--precision", "fp32"],
    "batched crops, 0 workers, auto (the README quick start)": ["--num_workers", "0", "--batched_crops", "true",
                                                                "--precision", "auto"],
    "batched crops, 1 worker, auto": ["--num_workers", "1", "--batched_crops", "true", "--precision", "auto"],
}


def cpu_seconds(pids):
    """CPU time (user + system) so far of this process and of the processes `pids` (Linux /proc)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class StepClock:
    """Iterates over a loader and records when each batch is handed out, in wall time and in CPU
    time of this process and its loader workers: the gaps are the steps (training on a batch plus
    waiting for the next one). CPU time is the work a step costs, whatever else the machine runs."""

    def __init__(self, loader):
        self.loader, self.times, self.cpu = loader, [], []

    def __len__(self):
        return len(self.loader)

    def _tick(self, iterator):
        workers = [w.pid for w in getattr(iterator, "_workers", [])]
        self.times.append(time.perf_counter())
        self.cpu.append(cpu_seconds(workers))

    def __iter__(self):
        iterator = iter(self.loader)
        for batch in iterator:
            self._tick(iterator)
            yield batch
        self._tick(iterator)


class RecipeRun:
    """One configuration of the quick start, built as dino.main() builds it, trained round by round."""

    def __init__(self, flags, args, output_dir):
        self.a = a = dino.get_args_parser().parse_args(
            QUICKSTART + flags + ["--output_dir", output_dir, "--epochs", str(args.recipe_rounds),
                                  "--seed", str(args.seed)])
        device = self.device = torch.device("cpu")
        common.resolve_precision(a, device)
        augment = common.MultiCropAugmentation(a.global_crops_scale, a.local_crops_scale, a.local_crops_number,
                                               a.global_crop_size, a.local_crop_size)
        images = range(args.recipe_steps * a.batch_size_per_gpu)   # an epoch is one round: no batch left over
        base = torch.utils.data.Subset(common.build_dataset(a, train=True), images)
        self.dataset = common.SeededDataset(base, augment, seed=a.seed, batched=a.batched_crops)
        self.loader, self.sampler = common.make_loader(self.dataset, a.batch_size_per_gpu, a.num_workers, seed=a.seed)
        common.fix_random_seeds(a.seed)                     # every configuration starts from the same weights
        self.student = dino.build_model(a, a.drop_path_rate).to(device)
        self.teacher = dino.build_model(a, 0.0).to(device)
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)
        n = args.recipe_steps
        self.criterion = dino.DINOLoss(a.out_dim, a.local_crops_number + 2, a.warmup_teacher_temp, a.teacher_temp,
                                       a.warmup_teacher_temp_epochs, a.epochs, niter_per_ep=n).to(device)
        self.optimizer = torch.optim.AdamW(common.get_params_groups(self.student))
        self.scaler = common.make_grad_scaler(device, a.precision)
        self.schedules = {
            "lr": common.cosine_scheduler(a.lr * a.batch_size_per_gpu / 256, a.min_lr, a.epochs, n, a.warmup_epochs),
            "wd": common.cosine_scheduler(a.weight_decay, a.weight_decay_end, a.epochs, n),
            "momentum": common.cosine_scheduler(a.momentum_teacher, 1, a.epochs, n)}
        self.step_times, self.step_cpu, self.losses = [], [], []

    def train_round(self, epoch):
        self.sampler.set_epoch(epoch)
        clock = StepClock(self.loader)
        record = dino.train_one_epoch(self.student, self.teacher, self.criterion, clock, self.optimizer, self.scaler,
                                      self.schedules, epoch, 0, self.a, self.device)
        self.step_times += list(np.diff(clock.times))[1:]        # the first step waits for a cold loader
        self.step_cpu += list(np.diff(clock.cpu))[1:]
        self.losses.append(record["loss"])

    def batch(self):
        """The crops of one batch built in this process, as the loader builds them, and its time."""
        indices = [(i, 0) for i in range(self.a.batch_size_per_gpu)]
        start = time.perf_counter()
        items = self.dataset.__getitems__(indices)
        batch = items if self.dataset.batched else torch.utils.data.default_collate(items)
        return batch, time.perf_counter() - start


def profile_recipe_step(run, reps):
    """Median seconds of each part of dino.train_one_epoch's step, each part timed on its own."""
    a, student, teacher, criterion, optimizer = run.a, run.student, run.teacher, run.criterion, run.optimizer
    parts = {k: [] for k in ("data (crops, this process)", "teacher forward", "student forward", "loss",
                             "backward", "clip gradients", "AdamW step", "EMA update", "bookkeeping (.item())")}
    for _ in range(reps + 1):
        ((crops, _), _), data_time = run.batch()
        t = [time.perf_counter()]
        with common.autocast(run.device, a.precision):
            with torch.no_grad():
                teacher_output = teacher(crops[:2])
            t.append(time.perf_counter())
            student_output = student(crops)
        t.append(time.perf_counter())
        losses = criterion(student_output, teacher_output, 0)
        common.stop_if_not_finite(losses["loss"], 0, a, dict)
        t.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(losses["loss"]).backward()
        t.append(time.perf_counter())
        run.scaler.unscale_(optimizer)
        common.clip_gradients(student, a.clip_grad)
        t.append(time.perf_counter())
        run.scaler.step(optimizer)
        run.scaler.update()
        t.append(time.perf_counter())
        common.update_teacher(student, teacher, a.momentum_teacher)
        t.append(time.perf_counter())
        {k: v.item() for k, v in losses.items()}
        t.append(time.perf_counter())
        for name, seconds in zip(parts, [data_time] + list(np.diff(t))):
            parts[name].append(seconds)
    return {k: statistics.median(v[1:]) for k, v in parts.items()}, crops


def recipe_flops_and_ops(run, crops):
    """FLOPs of one forward-backward (matmuls, convolutions, attention) and operators per step."""
    a = run.a

    def forward_backward():
        with common.autocast(run.device, a.precision):
            with torch.no_grad():
                teacher_output = run.teacher(crops[:2])
            student_output = run.student(crops)
        run.criterion(student_output, teacher_output, 0)["loss"].backward()
    flops, _ = count_flops(forward_backward, sdpa_counted_by_flop_counter(run.device))
    with torch.profiler.profile() as prof:
        forward_backward()
    return flops, sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def attention_kernels(reps):
    """Median ms of forward + backward of vit_pico's attention on the quick start's two crop sizes
    (batch 128: 256 global crops of 65 tokens, 512 local crops of 17 tokens; 2 heads of 32 dims), by
    kernel: the fused one (what F.scaled_dot_product_attention picks on CPU) in fp32 and bf16, and
    the explicit softmax(q k^T) v that `common.Attention` takes under CPU bf16 autocast."""
    def fused(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def explicit(q, k, v):
        return ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
    rows = {}
    for name, kernel, dtype in (("fused, fp32", fused, torch.float32), ("fused, bf16", fused, torch.bfloat16),
                                ("explicit, bf16", explicit, torch.bfloat16)):
        inputs = [[torch.randn(batch, 2, tokens, 32, dtype=dtype, requires_grad=True) for _ in range(3)]
                  for batch, tokens in ((256, 65), (512, 17))]

        def step(kernel=kernel, inputs=inputs):
            for qkv in inputs:
                torch.autograd.grad(kernel(*qkv).float().sum(), qkv)
        rows[name] = statistics.median(timed(step, reps, torch.device("cpu"), warmup=1)) * 1e3
    return rows


def bench_recipe(args):
    if args.recipe_threads:
        torch.set_num_threads(args.recipe_threads)
    peaks = measure_peaks(torch.device("cpu"), argparse.Namespace(precisions=["fp32", "bf16"],
                                                                   peak_seconds=args.peak_seconds))
    print(f"recipe: the README quick start (DINO, vit_pico/4, batch 128, 2 x 32 + 4 x 16 px, Fashion-MNIST); "
          f"{args.recipe_rounds} interleaved rounds of {args.recipe_steps} steps per configuration; "
          f"{torch.get_num_threads()} torch threads")
    results = {}
    with tempfile.TemporaryDirectory() as output_dir:
        runs = {name: RecipeRun(flags, args, str(Path(output_dir) / str(i)))
                for i, (name, flags) in enumerate(RECIPE_CONFIGS.items())}
        for epoch in range(args.recipe_rounds):
            for run in runs.values():
                run.train_round(epoch)
        base = statistics.median(next(iter(runs.values())).step_times)
        base_cpu = statistics.median(next(iter(runs.values())).step_cpu)
        print(f"load average (1 min) after the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print("\n| configuration | precision | s/step (median) | min | max | img/s | vs the first "
              "| CPU s/step (median) | vs the first | loss of the last round |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, run in runs.items():
            median, cpu = statistics.median(run.step_times), statistics.median(run.step_cpu)
            results[name] = dict(median=median, images_per_s=run.a.batch_size_per_gpu / median, cpu=cpu,
                                 loss=run.losses[-1])
            print(f"| {name} | {run.a.precision} | {median:.3f} | {min(run.step_times):.3f} | {max(run.step_times):.3f} | "
                  f"{run.a.batch_size_per_gpu / median:.0f} | {base / median:.2f}x | {cpu:.3f} | "
                  f"{base_cpu / cpu:.2f}x | "
                  f"{run.losses[-1]:.4f} |")
        print("\nProfile of one step (each part timed alone in this process, median of "
              f"{args.steps}); FLOPs: forward + backward; MFU: GFLOP/s of the model part (forward, loss, "
              "backward) / the dense matmul peak of its precision")
        profiled = {}
        profiled_elsewhere = ("PIL crops, 2 workers, fp32", "batched crops, 1 worker, auto")  # the same step
        for name, run in runs.items():
            if name in profiled_elsewhere:
                continue
            parts, crops = profile_recipe_step(run, args.steps)
            flops, ops = recipe_flops_and_ops(run, crops)
            profiled[name] = (parts, flops, ops, run.a.precision)
        names = list(profiled)
        print("\n| part | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        for part in next(iter(profiled.values()))[0]:
            print(f"| {part} | " + " | ".join(f"{profiled[n][0][part] * 1e3:.0f} ms" for n in names) + " |")
        print("| GFLOP / step | " + " | ".join(f"{profiled[n][1] / 1e9:.1f}" for n in names) + " |")
        model_parts = ("teacher forward", "student forward", "loss", "backward")
        model_seconds = {n: sum(profiled[n][0][p] for p in model_parts) for n in names}
        print("| MFU of forward + backward | " + " | ".join(
            pct(profiled[n][1] / model_seconds[n] / peaks[profiled[n][3]]) for n in names) + " |")
        print("| aten operators / forward-backward | " + " | ".join(str(profiled[n][2]) for n in names) + " |")
        for name in names:
            results[name]["parts"], results[name]["flops"] = profiled[name][0], profiled[name][1]
    kernels = attention_kernels(args.steps)
    print("\nattention forward + backward per step, one block (vit_pico, the quick start's crops): "
          + ", ".join(f"{name} {ms:.1f} ms" for name, ms in kernels.items()))
    results["attention_ms"] = kernels
    print("\ndense matmul peak (measured before the runs): "
          + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in peaks.items()))
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.recipe:
        wall = time.perf_counter()
        results = bench_recipe(args)
        print(f"\nwall time {time.perf_counter() - wall:.0f} s")
        return {"recipe": results}
    wall = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        common.die("--device cuda requested but no GPU is visible")
    if "fp16" in args.precisions and device.type != "cuda":
        common.die("--precisions fp16 needs a GPU; use fp32 or bf16 on CPU")
    sdpa_counted = sdpa_counted_by_flop_counter(device)
    peaks = measure_peaks(device, args)
    print_header(args, argv, device, sdpa_counted)

    rows, flops_cache = [], {}
    with tempfile.TemporaryDirectory() as output_dir:
        for precision in args.precisions:
            for name in args.methods:
                try:
                    rows.append(measure(name, precision, args, device, output_dir, flops_cache, sdpa_counted))
                except SystemExit as e:                 # e.g. SelfPatch on a Swin, crops not a multiple of the stride
                    print(f"{name} {precision}: skipped ({e})")
    peaks = measure_peaks(device, args, before=peaks)
    print("dense matmul peak (best before and after the rows): "
          + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()) + "\n")
    print_table(rows, peaks)
    print("\nms/step: one training step (teacher + student forward, loss, backward, clipping, AdamW, EMA) on a "
          "batch in memory; img/s = batch / median (DINO family: each image with all its crops; DRLoc: one "
          "view); peak MB: peak memory of the timed steps above what was in use before the models were "
          "built; GFLOP/step: FlopCounterMode over forward + backward (+ analytic attention where not "
          "counted); MFU: GFLOP/s / the dense matmul peak of the same dtype; vs DINO: median step time over "
          "DINO's, same precision; backbone / heads+loss / update / extra: each part timed alone on the "
          "step's tensors, as a share of the median step (see the docstring of extras/bench.py).")

    data_rows = []
    if not args.skip_data:
        with tempfile.TemporaryDirectory() as folder:
            make_jpegs(folder, args.data_images, seed=args.seed)
            data_rows = bench_data(args, folder)
        print(f"\nData pipeline, one loader worker, {args.data_images} JPEGs of 500 x 375 (decoding included)")
        print("| crops | repo: MultiCropAugmentation + geometry, img/s | reference PIL/torchvision DINO, img/s "
              "| ratio |")
        print("|---|---:|---:|---:|")
        for d in data_rows:
            print(f"| {d['crops']} | {d['repo']:.1f} | {d['reference']:.1f} | {d['repo'] / d['reference']:.2f} |")

    print_targets(rows, data_rows, peaks, args)
    print(f"\nwall time {time.perf_counter() - wall:.0f} s")
    return {"rows": rows, "data": data_rows, "peaks": peaks}


if __name__ == "__main__":
    with common.user_errors():
        main()
