"""Speed and memory of every method's training step, timed in the method's own code; and the
README quick start's step with PIL crops in loader workers against batched crops without workers.

    python extras/perf/bench.py                               # CPU preset (vit_pico), every method
    python extras/perf/bench.py --preset paper --device cuda  # ViT-S/16, 2 x 224 + 8 x 96, batch 64
    python extras/perf/bench.py --preset paper --device cuda --arch swin_tiny
    python extras/perf/bench.py --methods dino glsd_geometric --precisions fp32 bf16 --steps 3
    python extras/perf/bench.py --recipe quickstart           # PIL crops + workers vs batched crops

What is timed. A row (a method, with some flags of its own, in one precision) runs the method file's
own `main()` on the arguments its own parser gives (`get_args_parser().parse_args([...])`), for one
epoch of --warmup + --steps steps (`--max_steps_per_epoch`) over `--dataset synthetic` images of the
global crop size, in a temporary --output_dir. A step is therefore exactly a training step: the
loader (--num_workers, --batched_crops), the method's own `train_one_epoch` (schedules, teacher and
student forward, loss, backward, clipping, frozen last layer, optimizer, EMA, the per-step `.item()`
of every loss, which also waits for the GPU), and on CUDA the authors' settings (TF32,
cudnn.benchmark) that `common.init_distributed` applies in `main()` as in training. The loader that
`main()` hands to `train_one_epoch` is wrapped by a clock (the method module's `train_one_epoch` is
wrapped while the row runs): a step lasts from one batch handed out to the next, its data wait is
how long the next batch took to arrive. The first --warmup steps are not counted.

Columns: median ms per step (min-max) and the median data wait in it; images/s = batch / median
step; peak memory above what the process held before `main()` (CUDA:
`torch.cuda.max_memory_allocated`; CPU: the peak resident set, VmHWM, reset before the row; loader
workers not included); the precision that ran (`--precision auto` resolved by
`common.resolve_precision`); the epoch's mean loss; the median step over DINO's in the same
precision.

--recipe quickstart: the README quick start's DINO training (vit_pico/4, batch 128, 2 x 32 + 4 x 16
px crops of Fashion-MNIST, `--precision auto`), run by `dino.main()` in two ways: PIL crops built in
N loader workers (each N of --recipe_workers) and `--batched_crops true` with no worker. The
configurations take turns, --recipe_rounds rounds of --recipe_steps counted steps each (a round is
one `dino.main()` run from the same weights; its first step, with a cold loader, is not counted), so
that the load of a shared machine hits all alike. img/s = batch / median step (data wait included);
CPU s/step = the CPU time a step costs this process and its loader workers (robust to other load,
which wall time is not). --recipe_flags appends flags to every configuration (later flags win), e.g.
--recipe_flags "--dataset synthetic" where Fashion-MNIST is not installed.

Dropped when the bench moved from tests/ to extras/ and was rewritten to time the methods' own code
(it used to re-implement each method's step): FLOP counts and MFU, the split of a step into
backbone, heads + loss, update and the method's own work, `--profile`, and the data-pipeline
comparison with a plain PIL/torchvision pipeline (the figures in docs/PERFORMANCE.md that name them
were measured with that earlier version).
"""
import argparse
import contextlib
import ctypes
import gc
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import dino  # noqa: E402
import drloc  # noqa: E402
import esvit  # noqa: E402
import glsd  # noqa: E402
import selfpatch  # noqa: E402

# row name -> (method module, flags of that module)
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
    "cpu": dict(arch="vit_pico", patch_size=8, global_crop_size=64, local_crop_size=32,
                local_crops_number=4, batch_size=16, out_dim=1024, patch_out_dim=256,
                head_hidden_dim=256, head_bottleneck_dim=64, num_workers=0),
    "paper": dict(arch="vit_small", patch_size=16, global_crop_size=224, local_crop_size=96,
                  local_crops_number=8, batch_size=64, out_dim=65536, patch_out_dim=4096,
                  head_hidden_dim=2048, head_bottleneck_dim=256, num_workers=8),
}

# The README quick start's training flags (epochs, steps, workers and crops come from the bench).
QUICKSTART = ("--arch vit_pico --patch_size 4 --dataset fashion_mnist --global_crop_size 32 "
              "--local_crop_size 16 --local_crops_number 4 --out_dim 4096 --head_hidden_dim 512 "
              "--head_bottleneck_dim 128 --norm_last_layer false --batch_size_per_gpu 128 "
              "--lr 0.004 --weight_decay 0.04 --weight_decay_end 0.04 --freeze_last_layer 0 "
              "--momentum_teacher 0.99 --drop_path_rate 0 --warmup_epochs 0.5 "
              "--precision auto").split()


def get_args_parser():
    p = argparse.ArgumentParser("bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="defaults of the model and crop flags: cpu (vit_pico, 2 x 64 + 4 x 32 px, "
                        "batch 16, small heads, no loader worker) or paper (ViT-S/16, 2 x 224 + "
                        "8 x 96 px, batch 64, the papers' heads, 8 loader workers); "
                        "flags override it")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                   help="rows to run")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                   choices=["fp32", "bf16", "fp16", "auto"],
                   help="--precision of the rows (auto: what training picks here, as the header "
                        "says; bf16 on a CPU without native bf16 is emulated, many times slower: "
                        "--precisions fp32 skips it)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=common.POSITIVE_INT, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=common.COUNT, default=0)
    g = p.add_argument_group("model, crops and data of the rows (default: from --preset)")
    g.add_argument("--arch", choices=list(common.ARCHS))
    g.add_argument("--patch_size", type=common.POSITIVE_INT, help="ViT patch size")
    g.add_argument("--window_size", type=common.POSITIVE_INT, default=7, help="Swin window size")
    g.add_argument("--global_crop_size", type=common.POSITIVE_INT,
                   help="pixels (DRLoc's --input_size too)")
    g.add_argument("--local_crop_size", type=common.POSITIVE_INT, help="pixels")
    g.add_argument("--local_crops_number", type=common.COUNT)
    g.add_argument("--batch_size", type=common.POSITIVE_INT, help="images per step")
    g.add_argument("--out_dim", type=common.POSITIVE_INT, help="K of every DINO head")
    g.add_argument("--patch_out_dim", type=common.POSITIVE_INT,
                   help="K_p of SelfPatch's patch head")
    g.add_argument("--head_hidden_dim", type=common.POSITIVE_INT)
    g.add_argument("--head_bottleneck_dim", type=common.POSITIVE_INT)
    g.add_argument("--num_workers", type=common.COUNT, help="loader workers")
    g.add_argument("--batched_crops", default="false", choices=["true", "false"],
                   help="--batched_crops of the self-distillation methods (DRLoc has none)")
    g.add_argument("--warmup", type=common.POSITIVE_INT, default=2,
                   help="steps not counted first (at least 1)")
    g.add_argument("--steps", type=common.POSITIVE_INT, default=5, help="counted steps")
    g = p.add_argument_group("the quick start side by side (instead of the rows)")
    g.add_argument("--recipe", choices=["quickstart"],
                   help="time the README quick start, PIL crops vs batched crops")
    g.add_argument("--recipe_workers", nargs="+", type=common.COUNT, default=[2],
                   help="loader workers of the PIL configurations (one configuration each)")
    g.add_argument("--recipe_rounds", type=common.POSITIVE_INT, default=3,
                   help="interleaved rounds per configuration")
    g.add_argument("--recipe_steps", type=common.POSITIVE_INT, default=8,
                   help="counted steps per round")
    g.add_argument("--recipe_flags", default="",
                   help="flags appended to every configuration's dino.py flags")
    return p


def parse_args(argv=None):
    parser = get_args_parser()
    parser.set_defaults(**PRESETS[parser.parse_known_args(argv)[0].preset])
    args = parser.parse_args(argv)
    args.methods = list(dict.fromkeys(args.methods))
    return args


# ================================================================================================
# Measuring: a clock around the loader of train_one_epoch, CPU time, memory
# ================================================================================================
def cpu_seconds(pids):
    """CPU time (user + system) so far of this process and of the processes `pids` (Linux /proc)."""
    total = time.process_time()
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class Clock:
    """Stands in for the loader that train_one_epoch iterates: notes when each batch is asked for
    and when it is handed out (wall time), and the CPU time of this process and its loader workers
    then."""

    def __init__(self, loader):
        self.loader = loader
        self.asked = []   # wall time of each request for a batch
        self.got = []     # wall time of each batch handed out
        self.cpu = []     # CPU seconds of this process and its workers then
        self.record = {}  # what train_one_epoch returned

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):                     # .dataset, .sampler, ... of the real loader
        return getattr(self.__dict__["loader"], name)

    def __iter__(self):
        iterator = iter(self.loader)
        while True:
            self.asked.append(time.perf_counter())
            try:
                batch = next(iterator)
            except StopIteration:
                batch = None
            self.got.append(time.perf_counter())
            self.cpu.append(cpu_seconds([w.pid for w in getattr(iterator, "_workers", [])]))
            if batch is None:
                return
            yield batch

    def steps(self, skip):
        """[(step s, data wait s, CPU s)] of every step after the first `skip`: step i lasts from
        batch i handed out to batch i + 1 handed out (or the loader's end)."""
        return [(self.got[i + 1] - self.got[i], self.got[i + 1] - self.asked[i + 1],
                 self.cpu[i + 1] - self.cpu[i])
                for i in range(skip, len(self.got) - 1)]


@contextlib.contextmanager
def clocked(module, clocks):
    """While the block runs, `module.train_one_epoch` (which the module's main() calls) gets its
    loader wrapped in a Clock, appended to `clocks` with the epoch's record."""
    original = module.train_one_epoch

    def train_one_epoch(*args, **kwargs):
        def wrap(a):
            loaders = (torch.utils.data.DataLoader, dino.device_crops.Prefetched)  # batched crops
            return Clock(a) if isinstance(a, loaders) else a
        args, kwargs = [wrap(a) for a in args], {k: wrap(v) for k, v in kwargs.items()}
        clock = next(a for a in [*args, *kwargs.values()] if isinstance(a, Clock))
        clocks.append(clock)
        clock.record = original(*args, **kwargs)
        return clock.record
    module.train_one_epoch = train_one_epoch
    try:
        yield
    finally:
        module.train_one_epoch = original


def proc_status_bytes(field):
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes; None without /proc."""
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024
    return None


def start_memory(device):
    """Free what is freed (glibc's heap, the CUDA cache), reset the peak; returns the bytes in
    use."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")     # resets VmHWM (Linux >= 4.0)
    return proc_status_bytes("VmRSS")


def peak_memory(device, before):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - before
    peak = proc_status_bytes("VmHWM")
    return None if peak is None or before is None else peak - before


def run_main(module, argv, device):
    """module.main() on its own parser's arguments, its output captured: (args, [Clock], peak
    memory bytes or None, None), or (args, [], None, the error line) when main() refuses."""
    args = module.get_args_parser().parse_args(argv)
    clocks = []
    output = io.StringIO()
    before = start_memory(device)
    try:
        with clocked(module, clocks), contextlib.redirect_stdout(output):
            with contextlib.redirect_stderr(output):
                module.main(args)
    except SystemExit as e:
        if not isinstance(e.code, str):  # a preemption exit or a plain exit: not a refusal
            raise
        return args, [], None, e.code.strip().splitlines()[-1]
    return args, clocks, peak_memory(device, before), None


# ================================================================================================
# The rows: every method, built and trained by its own main()
# ================================================================================================
def row_flags(name, precision, args, output_dir):
    """The method's flags for a row: the bench's backbone, crops, heads and data, one short
    epoch."""
    module, own = METHODS[name]
    steps = args.warmup + args.steps
    # the other family's flag would be refused
    vit = common.ARCHS[args.arch]["family"] == "vit"
    flags = ["--arch", args.arch,
             *(["--patch_size", str(args.patch_size)] if vit
               else ["--window_size", str(args.window_size)]),
             "--batch_size_per_gpu", str(args.batch_size), "--dataset", "synthetic",
             # the last step waits for a real batch
             "--synthetic_images", str((steps + 1) * args.batch_size),
             "--synthetic_image_size", str(args.global_crop_size),
             "--num_workers", str(args.num_workers),
             "--precision", precision, "--device", str(args.device), "--seed", str(args.seed),
             "--output_dir", output_dir, "--epochs", "1", "--max_steps_per_epoch", str(steps),
             "--warmup_epochs", "0", "--saveckp_freq", "0"]
    if module is drloc:
        flags += ["--input_size", str(args.global_crop_size), "--lambda_schedule", "constant"]
    else:   # a typical step: the last layer trained, the teacher temperature at its final value
        flags += ["--global_crop_size", str(args.global_crop_size),
                  "--local_crop_size", str(args.local_crop_size),
                  "--local_crops_number", str(args.local_crops_number),
                  "--out_dim", str(args.out_dim), "--head_hidden_dim", str(args.head_hidden_dim),
                  "--head_bottleneck_dim", str(args.head_bottleneck_dim),
                  "--freeze_last_layer", "0", "--warmup_teacher_temp_epochs", "0",
                  "--batched_crops", args.batched_crops]
    if module is selfpatch:
        flags += ["--patch_out_dim", str(args.patch_out_dim)]
    return flags + own


def measure_row(name, precision, args, device, output_dir):
    """One row: the method's main() for one epoch, its counted steps summarised; a string if
    refused."""
    module = METHODS[name][0]
    flags = row_flags(name, precision, args, output_dir)
    a, clocks, memory, error = run_main(module, flags, device)
    if error:
        return error
    steps = clocks[0].steps(args.warmup)
    if len(steps) < args.steps:
        return f"only {len(steps) + args.warmup} steps ran, fewer than --warmup + --steps"
    times, waits = [s[0] for s in steps], [s[1] for s in steps]
    median = statistics.median(times)
    return dict(method=name, precision=a.precision, requested=precision, median=median,
                min=min(times), max=max(times), wait=statistics.median(waits),
                images_per_s=a.batch_size_per_gpu / median,
                memory=memory, loss=clocks[0].record.get("loss"))


def hardware(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    return platform.processor() or platform.machine()


def auto_precision(device):
    """The line `common.resolve_precision` logs for --precision auto on this device."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        precision, _auto = common.resolve_precision("auto", device)
    return output.getvalue().strip() or f"precision: {precision}"


def print_header(device, argv):
    print(f"# bench.py: {hardware(device)}, {device}, {torch.get_num_threads()} torch thread(s), "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"--precision auto here: {auto_precision(device).removeprefix('precision: ')}")
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: python extras/perf/bench.py {command}".rstrip())


def print_rows(rows, args):
    dino_time = {r["precision"]: r["median"] for r in rows if r["method"] == "dino"}
    print("\n| method | precision | ms/step median (min–max) | data wait ms | img/s | peak MB | "
          "loss | vs DINO |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        precision = r["precision"] + (" (auto)" if r["requested"] == "auto" else "")
        memory = "—" if r["memory"] is None else f"{r['memory'] / 2 ** 20:.0f}"
        versus = (f"{r['median'] / dino_time[r['precision']]:.2f}x"
                  if r["precision"] in dino_time else "—")
        loss = "—" if r["loss"] is None else f"{r['loss']:.4f}"
        print(f"| {r['method']} | {precision} | {1e3 * r['median']:.0f} "
              f"({1e3 * r['min']:.0f}–{1e3 * r['max']:.0f}) | {1e3 * r['wait']:.0f} | "
              f"{r['images_per_s']:.1f} | {memory} | {loss} | {versus} |")
    vit = common.ARCHS[args.arch]["family"] == "vit"
    print(f"\n{args.arch} ({f'patch {args.patch_size}' if vit else f'window {args.window_size}'}), "
          f"2 x {args.global_crop_size} + {args.local_crops_number} x {args.local_crop_size} px "
          f"crops (DRLoc: one {args.global_crop_size} px view), batch {args.batch_size}, heads "
          f"{args.head_hidden_dim}/{args.head_bottleneck_dim}/K={args.out_dim} (SelfPatch "
          f"K_p={args.patch_out_dim}), {args.num_workers} loader worker(s), batched crops "
          f"{args.batched_crops}; {args.warmup} warm-up + {args.steps} counted steps of each "
          "method's own train_one_epoch. A step: from one batch handed out to the next (data wait "
          "included); peak MB: above the memory in use before main(); loss: the epoch's mean.")


def bench_rows(args, device, argv):
    print_header(device, argv)
    rows = []
    with tempfile.TemporaryDirectory() as output_dir:
        for precision in args.precisions:
            for name in args.methods:
                row = measure_row(name, precision, args, device,
                                  str(Path(output_dir) / f"{name}_{precision}"))
                if isinstance(row, str):        # e.g. SelfPatch on a Swin, or fp16 on a CPU
                    print(f"{name} --precision {precision}: skipped ({row})", flush=True)
                else:
                    rows.append(row)
                    print(f"{name} {row['precision']}: {1e3 * row['median']:.0f} ms/step",
                          flush=True)
    print_rows(rows, args)
    return rows


# ================================================================================================
# The README quick start: PIL crops in loader workers against batched crops without a worker
# ================================================================================================
def recipe_configs(args):
    configs = {f"PIL crops, {n} loader worker{'s' if n != 1 else ''}": ["--num_workers", str(n)]
               for n in args.recipe_workers}
    configs["batched crops, no loader worker"] = ["--batched_crops", "true", "--num_workers", "0"]
    return configs


def bench_recipe(args, device, argv):
    print_header(device, argv)
    configs = recipe_configs(args)
    skip = 1  # a round's first step waits for a cold loader
    runs = {name: dict(steps=[], losses=[], precision=None) for name in configs}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as output_dir:
        for round_ in range(args.recipe_rounds):
            for i, (name, flags) in enumerate(configs.items()):
                argv_ = [*QUICKSTART, *flags, "--device", str(args.device),
                         "--seed", str(args.seed),
                         "--epochs", "1", "--max_steps_per_epoch", str(args.recipe_steps + skip),
                         "--saveckp_freq", "0", "--output_dir",
                         str(Path(output_dir) / f"{round_}_{i}"), *args.recipe_flags.split()]
                a, clocks, _, error = run_main(dino, argv_, device)
                if error:
                    sys.exit(f"error: {name}: dino.py refused: {error}")
                runs[name]["steps"] += clocks[0].steps(skip)
                runs[name]["losses"].append(clocks[0].record.get("loss"))
                runs[name]["precision"] = a.precision
                runs[name]["batch"] = a.batch_size_per_gpu
                median = statistics.median(s[0] for s in clocks[0].steps(skip))
                print(f"round {round_ + 1}/{args.recipe_rounds}, {name}: {median:.3f} s/step",
                      flush=True)
    results = {}
    for name, run in runs.items():
        times, waits, cpu = ([s[k] for s in run["steps"]] for k in range(3))
        median = statistics.median(times)
        results[name] = dict(median=median, min=min(times), max=max(times),
                             wait=statistics.median(waits), cpu=statistics.median(cpu),
                             images_per_s=run["batch"] / median,
                             precision=run["precision"], loss=run["losses"][-1], steps=len(times))
    print_recipe(results, args, load_before)
    return results


def print_recipe(results, args, load_before):
    first = next(iter(results.values()))
    print("\nThe README quick start (dino.py, vit_pico/4, batch 128, 2 x 32 + 4 x 16 px, "
          f"--precision auto{', ' + args.recipe_flags if args.recipe_flags else ''}): "
          f"{args.recipe_rounds} interleaved round(s) of {args.recipe_steps} counted steps per "
          f"configuration, {torch.get_num_threads()} torch thread(s); load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs\n")
    print("| configuration | precision | s/step median (min–max) | data wait s | img/s | "
          "vs the first | CPU s/step | vs the first | loss (last round) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['precision']} | {r['median']:.3f} "
              f"({r['min']:.3f}–{r['max']:.3f}) | "
              f"{r['wait']:.3f} | {r['images_per_s']:.0f} | "
              f"{r['images_per_s'] / first['images_per_s']:.2f}x | {r['cpu']:.3f} | "
              f"{first['cpu'] / r['cpu']:.2f}x | {r['loss']:.4f} |")
    batched = results["batched crops, no loader worker"]
    best = max((n for n in results if n.startswith("PIL")),
               key=lambda n: results[n]["images_per_s"])
    print("\nbatched crops, no loader worker: "
          f"{batched['images_per_s'] / results[best]['images_per_s']:.2f}x the images/s of the "
          f"fastest PIL configuration ({best}) and {results[best]['cpu'] / batched['cpu']:.2f}x "
          "fewer CPU seconds per step. img/s = batch / median step (data wait included); CPU "
          "s/step: this process and its loader workers; vs the first: against the first row (CPU: "
          "its CPU s/step over this row's).")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # on CUDA: the authors' settings, as training applies them
    device = common.init_distributed(args.device)
    args.device = str(device)
    wall = time.perf_counter()
    if args.recipe:
        out = {"recipe": bench_recipe(args, device, argv)}
    else:
        out = {"rows": bench_rows(args, device, argv)}
    print(f"\nwall time {time.perf_counter() - wall:.0f} s")
    return out


if __name__ == "__main__":
    main()
