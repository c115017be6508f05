"""The authors' DINO beside ours on one machine: the training step alone, speed levers, and end to
end on JPEG files.

    python extras/perf/side_by_side.py --authors_code .authors_dino        # a GPU
    python extras/perf/side_by_side.py --authors_code DIR --device cpu --smoke   # the plumbing

--authors_code DIR holds the authors' main_dino.py, utils.py and vision_transformer.py
(facebookresearch/dino). They are imported from there and run as they are; nothing of theirs is
copied here. To take them to a GPU machine, copy them into `.authors_dino/` of the checkout (a
folder git ignores).

Step alone (`--parts step`). Their ViT + DINOHead + MultiCropWrapper + DINOLoss, AdamW on their
parameter groups, and their own `train_one_epoch` (its clipping, last-layer freeze, fp16 grad
scaler and EMA), against dino.py's model, loss and `train_one_epoch`; each wrapped in DDP in a
process group of one, as under torchrun, on the SAME random batch of 2 x 224 + 8 x 96 px crops
already on the device, for each --batches. Each runs in its own precision (theirs fp16 with a grad
scaler, their --use_fp16 default; ours --precision auto, bf16 on a GPU with native bf16) and in the
other's. The last layer is trained (their --freeze_last_layer 1 spares it in epoch 0 only).
Reported: the median step after --warmup steps (synchronised at each step's start and end), peak
memory (`torch.cuda.max_memory_allocated`), and MFU: the FLOPs of one image (FlopCounterMode,
once per model: 3x the student's forward for its forward and backward, plus the teacher's) over the
step time and the GPU's dense peak for the precision (PEAK_TFLOPS; unknown devices: no MFU).
Levers (`--parts levers`), ours only, at the first batch, off by default in training until a GPU
run shows their worth: torch.compile of both backbones, fused AdamW.
End to end (`--parts e2e`): each with its own loader on jpeg_folder.py's ImageNet-like JPEGs,
--num_workers workers, for --e2e_warmup + --e2e_steps steps: theirs (DataAugmentationDINO,
ImageFolder, DataLoader) and ours (dino.py's loader, PIL crops and --batched_crops). Reported: the
epoch's images/s over the wall time of the measured steps, and the mean data wait.

Their code is imported and run by authors_dino.py (with its shims: the precision measured; on a
CPU, no CUDA calls). The order: steps alone, end to end, then the levers (compiling is the slowest
to start: on a busy 2-core CPU 142 s for vit_pico, 296 s for ViT-Ti). One JSON line per
measurement is appended to --out as it ends, with its provenance (extras/experiments/provenance.py).
"""
import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "extras" / "experiments")]
import authors_dino  # noqa: E402
import common  # noqa: E402
import device_crops  # noqa: E402
import dino  # noqa: E402
import gpu_check  # noqa: E402  (step_figures: the same figures as the GPU check's)
import jpeg_folder  # noqa: E402
import provenance  # noqa: E402

# Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets, TFLOP/s, by a part of the name
# torch.cuda.get_device_name gives; the first match wins (the H100 PCIe before the SXM).
PEAK_TFLOPS = [("H200", {"bf16": 989, "fp16": 989}), ("H100 PCIe", {"bf16": 756, "fp16": 756}),
               ("H100", {"bf16": 989, "fp16": 989}), ("A100", {"bf16": 312, "fp16": 312})]
# The model both sides build: the paper's ViT-S/16 DINO, or a small one for a CPU's smoke run
# (its steps alone on 64 and 32 px crops). End to end the crops are the authors' 224 and 96 px,
# which their DataAugmentationDINO fixes.
SPECS = {"paper": dict(arch="vit_small", patch_size=16, out_dim=65536, hidden_dim=2048,
                       bottleneck_dim=256, global_size=224, local_size=96, local_crops=8),
         "smoke": dict(arch="vit_tiny", patch_size=16, out_dim=1024, hidden_dim=256,
                       bottleneck_dim=64, global_size=64, local_size=32, local_crops=2)}
AUTHORS_CROPS = dict(global_size=224, local_size=96)


# ======== A clock on the batches a train_one_epoch asks for =======================================
class Clock:
    """`steps` batches of `source` (an iterable; a list repeats its one batch), with the time each
    step waited for its batch and lasted (from one batch asked to the next). With `every_step`
    the device is synchronised at each step's end (a step alone), else at the end only."""

    def __init__(self, source, steps, device, every_step):
        self.source = source
        self.steps = steps
        self.device = device
        self.every_step = every_step
        self.timed = []  # (wait, compute) per step, gpu_check.step_figures' form

    def __len__(self):
        return self.steps

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __iter__(self):
        batches = iter(self.source) if not isinstance(self.source, list) else None
        self.sync()
        wait = got = 0.0
        for step in range(self.steps):
            if self.every_step and step:
                self.sync()
            asked = time.perf_counter()
            if step:  # the step before has ended: it asks for the next batch
                self.timed.append((wait, asked - got))
            batch = next(batches) if batches else self.source[0]
            got = time.perf_counter()
            wait = got - asked
            yield batch
        self.sync()
        self.timed.append((wait, time.perf_counter() - got))


# ======== Building both sides ====================================================================
def random_crops(spec, batch, device):
    """The same batch for both: 2 global and N local crops of normal noise, on the device."""
    generator = torch.Generator().manual_seed(0)
    sizes = [spec["global_size"]] * 2 + [spec["local_size"]] * spec["local_crops"]
    return [torch.randn(batch, 3, s, s, generator=generator).to(device) for s in sizes]


def ddp(model, device):
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None)


def our_args(spec, batch, precision, device, output_dir, flags=()):
    """dino.py's arguments for `spec`, parsed by its own parser."""
    return dino.get_args_parser().parse_args([
        "--arch", spec["arch"], "--patch_size", str(spec["patch_size"]),
        "--out_dim", str(spec["out_dim"]), "--head_hidden_dim", str(spec["hidden_dim"]),
        "--head_bottleneck_dim", str(spec["bottleneck_dim"]),
        "--global_crop_size", str(spec["global_size"]),
        "--local_crop_size", str(spec["local_size"]),
        "--local_crops_number", str(spec["local_crops"]), "--batch_size_per_gpu", str(batch),
        "--epochs", "1", "--warmup_epochs", "0", "--freeze_last_layer", "0",
        "--precision", precision, "--device", str(device), "--output_dir", output_dir, *flags])


def build_ours(args, device, steps, lever=None):
    """dino.main's student, teacher, loss, optimizer, scaler and schedules (`lever`: None,
    "compile" or "fused_adamw"); returns (the train_one_epoch call on a loader, the student for
    counting FLOPs)."""
    student = dino.build_model(args, args.drop_path_rate).to(device)
    teacher = dino.build_model(args, 0.0).to(device)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    if lever == "compile":  # the backbones only, in place (the parameters keep their names)
        for model in (student, teacher):
            model.backbone.compile(dynamic=False)
    wrapped = ddp(student, device)
    criterion = dino.DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp,
                              args.teacher_temp, args.warmup_teacher_temp_epochs, args.epochs,
                              niter_per_ep=steps).to(device)
    optimizer = torch.optim.AdamW(common.get_params_groups(wrapped),
                                  fused=True if lever == "fused_adamw" else None)
    scaler = common.make_grad_scaler(device, args.precision)
    peak_lr = args.lr * args.batch_size_per_gpu / 256
    schedules = {"lr": common.cosine_scheduler(peak_lr, args.min_lr, 1, steps),
                 "wd": common.cosine_scheduler(args.weight_decay, args.weight_decay_end, 1, steps),
                 "momentum": common.cosine_scheduler(args.momentum_teacher, 1, 1, steps)}

    def train(loader):
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            record = dino.train_one_epoch(wrapped, teacher, criterion, loader, optimizer, scaler,
                                          schedules, 0, 0, args, device)
        return record["loss"]
    return train, (student, teacher)


def flops_per_image(student, teacher, crops):
    """Training FLOPs of one image: 3x the student's forward on all crops (forward and backward),
    plus the teacher's on the two global ones; attention through its explicit matrix products so
    that the counter sees it on every device."""
    one = [c[:1] for c in crops]
    counts = []
    for model, views in ((student, one), (teacher, one[:2])):
        with (torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as f,
              torch.compiler.set_stance("force_eager")):  # a compiled backbone, counted as it is
            model(views)
        counts.append(f.get_total_flops())
    return 3 * counts[0] + counts[1]


def peak_flops(device, precision):
    """The device's dense peak FLOP/s in `precision` (PEAK_TFLOPS), or None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = next((p for part, p in PEAK_TFLOPS if part in name), {})
    return peaks[precision] * 1e12 if precision in peaks else None


def device_name(device):
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / 2 ** 20
        return f"{torch.cuda.get_device_name(device)} ({memory:,.0f} MiB)"
    return f"CPU: {provenance.cpu_model()}, {os.cpu_count()} cores"


# ======== Measurements ===========================================================================
def measure(train, clock, device, warmup, batch):
    """Run `train` on `clock`; its figures (gpu_check.step_figures) and the peak memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loss = train(clock)
    figures = gpu_check.step_figures(clock.timed, warmup, (0, 0), batch)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None
    warm = sum(w + c for w, c in clock.timed[:warmup])
    return {**figures, "warmup_s": warm, "loss": loss, "peak_memory_mb": peak}


def failure(e):
    """A measurement's error in one line."""
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:300]}"


def released(device):
    """After a measurement: its networks, optimizer states and compiled graphs freed."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_plan(args, precisions):
    """(code, precision, lever, batch) of each step alone: every batch in each side's precisions,
    then the levers (ours, in its own precision, at the first batch)."""
    plan = []
    for batch in args.batches if "step" in args.parts else []:
        plan += [("authors", p, None, batch) for p in precisions["authors"]]
        plan += [("ours", p, None, batch) for p in precisions["ours"]]
    if "levers" in args.parts:
        plan += [("ours", precisions["ours"][0], lever, args.batches[0]) for lever in args.levers]
    return plan


def step_alone(authors, spec, args, device, plan, tmp):
    """The steps alone of `plan` (`step_plan`): yields one record each."""
    steps = args.warmup + args.steps
    flops = {}
    for code, precision, lever, batch in [p for p in plan if authors or p[0] == "ours"]:
        record = {"measure": "step_alone", "code": code, "precision": precision,
                  "lever": lever, "batch_per_gpu": batch}
        try:
            crops = random_crops(spec, batch, device)
            if code == "authors":
                train, models = authors_dino.build(authors, spec, batch, precision, device, steps)
            else:
                train, models = build_ours(our_args(spec, batch, precision, device, tmp), device,
                                           steps, lever)
            if code not in flops:  # once per model
                flops[code] = flops_per_image(*models, crops)
            # each side's batch form: ours ((crops, geometry), labels), theirs (crops, labels)
            one = ((crops, []), None) if code == "ours" else (crops, None)  # no geometry
            figures = measure(train, Clock([one], steps, device, every_step=True), device,
                              args.warmup, batch)
            peak = peak_flops(device, precision)
            achieved = flops[code] * batch / figures["median_step_s"]
            record.update(figures, gflop_per_image=flops[code] / 1e9,
                          peak_tflops=peak and peak / 1e12, mfu=peak and achieved / peak)
        # out of memory, a compile error, a non-finite loss's exit: recorded, the next goes on
        except (Exception, SystemExit) as e:
            record["error"] = failure(e)
        finally:
            train = models = crops = one = None
            released(device)
        yield record


def end_to_end(authors, spec, args, device, precisions, tmp):
    """Each side with its own loader on the JPEG folder: yields one record each; ours batched
    with its step's split (`split_times`)."""
    batch = args.e2e_batch
    steps = args.e2e_warmup + args.e2e_steps
    spec = {**spec, **AUTHORS_CROPS}
    folder = jpeg_folder.make(args.jpeg_cache, args.jpeg_images, size=args.jpeg_size)
    data = {"folder": str(folder), **jpeg_folder.describe(folder)}
    if steps > data["images"] // batch:  # a loader's last batch ends the measurement
        raise SystemExit(f"--e2e_warmup + --e2e_steps: {steps} batches of {batch}, more than "
                         f"the {data['images']} images of {folder} give")
    for code, loader_kind in (("authors", "DataAugmentationDINO"), ("ours", "pil"),
                              ("ours", "batched"))[0 if authors else 1:]:
        precision = precisions[code][0]
        record = {"measure": "end_to_end", "code": code, "precision": precision,
                  "loader": loader_kind, "num_workers": args.num_workers, "batch_per_gpu": batch,
                  "data": data}
        try:
            if code == "authors":
                train, _ = authors_dino.build(authors, spec, batch, precision, device, steps)
                loader = authors_dino.loader(authors, spec, folder, batch, args.num_workers, device)
            else:
                flags = ["--dataset", "folder", "--data_path", str(folder), "--num_workers",
                         str(args.num_workers), "--batched_crops", str(loader_kind == "batched")]
                ours = our_args(spec, batch, precision, device, tmp, flags)
                train, _ = build_ours(ours, device, steps)
                loader = our_loader(ours, device)
            timed = args.e2e_warmup if loader_kind == "batched" else None
            with split_times(device, timed) as split:
                record.update(measure(train, Clock(loader, steps, device, every_step=False),
                                      device, args.e2e_warmup, batch))
            record.update(split)
        except (Exception, SystemExit) as e:
            record["error"] = failure(e)
        finally:
            train = loader = None   # its worker processes end with it
            released(device)
        yield record


def our_loader(args, device):
    """dino.main's data lines: the seeded multi-crop dataset and common.make_loader."""
    augment = common.MultiCropAugmentation(args.global_crops_scale, args.local_crops_scale,
                                           args.local_crops_number, args.global_crop_size,
                                           args.local_crop_size)
    dataset = common.SeededDataset(common.build_dataset(args, train=True), augment, seed=args.seed)
    if args.batched_crops:
        dataset = device_crops.BatchedCrops(dataset, device)
    loader, sampler = common.make_loader(dataset, args.batch_size_per_gpu, args.num_workers,
                                         train=True, seed=args.seed)
    sampler.set_epoch(0)
    return device_crops.Prefetched(loader, device) if args.batched_crops else loader


@contextlib.contextmanager
def split_times(device, warmup):
    """With `warmup` (not None), the batched step's device_crops work split, per step after the
    warm-up, into a dict filled when the block ends: median milliseconds of the decode (from the
    cut's start to the JPEGs on its stream: nvJPEG's wait), of issuing the crops (host time of the
    cut without the decode) and of computing them (the cut's GPU time without the decode), timed
    by CUDA events on the stream the cut runs on (on a CPU, all host times)."""
    split, times = {}, {"decode": [], "cut": []}
    real = {name: getattr(device_crops, name) for name in ("images_on_device", "multicrop_pixels")}

    def timed(name):
        def run(*args):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] \
                if device.type == "cuda" else []
            start = time.perf_counter()
            for e in events[:1]:
                e.record()
            out = real[name](*args)
            for e in events[1:]:
                e.record()
            times["decode" if name == "images_on_device" else "cut"].append(
                (time.perf_counter() - start, events))
            return out
        return run
    if warmup is not None:
        for name in real:
            setattr(device_crops, name, timed(name))
    try:
        yield split
    finally:
        for name, f in real.items():
            setattr(device_crops, name, f)
    if warmup is not None and times["cut"][warmup:]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

        def ms(kind, gpu):
            return [1e3 * (e[0].elapsed_time(e[1]) / 1e3 if gpu and e else h)
                    for h, e in times[kind][warmup:]]
        median = statistics.median
        split.update(decode_wait_ms=median(ms("decode", True)),
                     crop_issue_ms=median(ms("cut", False)) - median(ms("decode", False)),
                     crop_compute_ms=median(ms("cut", True)) - median(ms("decode", True)))


# ======== Output =================================================================================
def line_text(r):
    """One measurement as a line of the printed table."""
    what = r["code"] + (f" + {r['lever']}" if r.get("lever") else "") + (
        f", {r['loader']} loader, {r['num_workers']} workers" if r.get("loader") else "")
    head = f"{r['measure']:10} {what:45} {r['precision']:4} B={r['batch_per_gpu']:<4}"
    if "error" in r:
        return f"{head} FAILED: {r['error']}"
    step = r["median_step_s"]
    text = f"{head} {1e3 * step:7.1f} ms/step median ({r['batch_per_gpu'] / step:.4g} img/s)"
    if r["measure"] == "end_to_end":
        text += (f", epoch {r['images_per_s']:.4g} img/s, data wait mean "
                 f"{1e3 * r['mean_wait_s']:.1f} ms ({r['wait_share']:.0%})")
    if "crop_issue_ms" in r:
        text += (f"; per step: decode wait {r['decode_wait_ms']:.1f} ms, crop issue "
                 f"{r['crop_issue_ms']:.1f} ms, crop compute {r['crop_compute_ms']:.1f} ms")
    if r.get("peak_memory_mb"):
        text += f", {r['peak_memory_mb']:,.0f} MB"
    if r["measure"] == "step_alone":
        text += (f", MFU {r['mfu']:.1%} of {r['peak_tflops']:g} TFLOP/s" if r.get("mfu")
                 else ", MFU unknown (no peak for this device)")
    return text + f", loss {r['loss']:.4g}"


def write_line(path, record, started, device, command):
    """Append `record` to the JSON lines at `path`, with the device and its provenance."""
    line = {**record, "device": device, "command": command, **provenance.stamp(started)}
    with common.open_for_writing(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def get_args_parser():
    p = argparse.ArgumentParser("side_by_side.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--authors_code", required=True,
                   help="folder of the authors' main_dino.py, utils.py, vision_transformer.py")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--smoke", action="store_true",
                   help="a small ViT-Ti model, batch 2, 2 local crops, 1 + 2 steps: the plumbing")
    p.add_argument("--parts", nargs="+", default=["step", "levers", "e2e"],
                   choices=["step", "levers", "e2e"])
    p.add_argument("--batches", nargs="+", type=common.POSITIVE_INT, default=[64, 128],
                   help="images per GPU of the steps alone (the levers and e2e: the first)")
    p.add_argument("--levers", nargs="+", default=["fused_adamw", "compile"],
                   choices=["compile", "fused_adamw"], help="in this order: the cheap one first")
    p.add_argument("--warmup", type=common.POSITIVE_INT, default=5,
                   help="steps alone not counted (compile: its first steps compile)")
    p.add_argument("--steps", type=common.POSITIVE_INT, default=20, help="steps alone counted")
    p.add_argument("--e2e_batch", type=common.POSITIVE_INT, default=128,
                   help="images per GPU end to end (the users' 128)")
    p.add_argument("--e2e_warmup", type=common.POSITIVE_INT, default=5)
    p.add_argument("--e2e_steps", type=common.POSITIVE_INT, default=25,
                   help="with the warm-up at most the folder's batches (4,000 JPEGs: 31 of 128)")
    p.add_argument("--ours_only", action="store_true",
                   help="no code of the authors: our measurements only (gpu_run's CPU form)")
    p.add_argument("--num_workers", type=common.COUNT, default=10,
                   help="loader workers of both sides end to end (both scripts' default)")
    p.add_argument("--jpeg_cache", default="runs/jpeg_folders")
    p.add_argument("--jpeg_images", type=common.POSITIVE_INT, default=4000)
    p.add_argument("--jpeg_size", type=common.ranged(int, 32), default=500)
    p.add_argument("--out", default=None, help="JSON lines appended here (default "
                   "docs/data/side_by_side.jsonl; with --smoke a temporary file)")
    return p


SMOKE = dict(batches=[2], warmup=1, steps=2, e2e_batch=2, e2e_warmup=1, e2e_steps=2,
             num_workers=1, jpeg_images=16)


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    if args.smoke:  # the smoke run's sizes, whatever the flags say
        vars(args).update(SMOKE)
    out = args.out or (tempfile.mkstemp(prefix="side_by_side_", suffix=".jsonl")[1] if args.smoke
                       else str(ROOT / "docs" / "data" / "side_by_side.jsonl"))
    provenance.check_log_writable(out, what="--out")
    authors = None if args.ours_only else authors_dino.load(args.authors_code)
    started = provenance.start()
    command = "python " + " ".join(sys.argv if argv is None else ["side_by_side.py", *argv])
    with socket.socket() as sock:   # a process group of one, as torchrun's with one GPU
        sock.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(sock.getsockname()[1]))
    device = common.init_distributed(args.device)  # also TF32 and cuDNN autotuning, as training
    # their own: fp16 (--use_fp16) on a GPU; on a CPU their torch.cuda.amp turns itself off
    theirs = "fp16" if device.type == "cuda" else "fp32"
    ours = common.choose_precision(device)[0]
    precisions = {"authors": [theirs] + [ours] * (ours != theirs and ours == "bf16"),
                  "ours": [ours] + [theirs] * (ours != theirs)}
    spec = SPECS["smoke" if args.smoke else "paper"]
    name = device_name(device)
    peaks = {p: peak_flops(device, p) for p in ("bf16", "fp16")}
    print(f"side_by_side: {name}, torch {torch.__version__}; {spec['arch']}/"
          f"{spec['patch_size']}, K = {spec['out_dim']}, 2 x {spec['global_size']} + "
          f"{spec['local_crops']} x {spec['local_size']} px; dense peaks used for MFU: "
          + ", ".join(f"{p} {peak / 1e12:g} TFLOP/s" if peak else f"{p} unknown (no MFU)"
                      for p, peak in peaks.items()), flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        plan = step_plan(args, precisions)
        measurements = itertools.chain(   # the levers last: compiling is the longest to start
            step_alone(authors, spec, args, device, [p for p in plan if not p[2]], tmp),
            end_to_end(authors, spec, args, device, precisions, tmp) if "e2e" in args.parts
            else [],
            step_alone(authors, spec, args, device, [p for p in plan if p[2]], tmp))
        for record in measurements:
            write_line(out, record, started, name, command)
            failed += "error" in record
            print(line_text(record), flush=True)
    print(f"{failed} measurement(s) failed; JSON lines appended to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
