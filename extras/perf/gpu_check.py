"""The first GPU run in one command: every training script at paper size, the GPU-only paths, a
summary.

    python extras/perf/gpu_check.py               # 1+ GPUs: 2.3 min on one H200 (before the
                                                  # JPEG parts), no download
    python extras/perf/gpu_check.py --device cpu  # the reduced form (tiny models, gloo) that
                                                  # tests/test_gpu_check.py runs

Each part (docs/FIRST_GPU_RUN.md lists them and what each line should show) runs in its own
processes, forked from this one (torch is imported once) with torchrun's environment, so every
script runs inside a process group (NCCL; one rank on one GPU); a part is skipped when a part it
needs failed. Every part's flags are parsed by its script's own parser before anything runs; rank
r's output is in --out/<part>.rank<r>.log, whose first line is the command that repeats the part by
hand; --out/summary.jsonl holds each part's line and its step figures (`step_figures`). The JPEG
parts read a folder of ImageNet-like JPEGs that jpeg_folder.py makes at the start (once per
--jpeg_cache).
"""
import argparse
import atexit
import contextlib
import importlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import device_crops  # noqa: E402
# the host-sync counter and the parts, in this file's folder (on sys.path when it runs as a script)
from sync_counter import CUDA_SYNC, SyncCounter  # noqa: E402,F401
from gpu_parts import ARCH, FORMS, Part, check_commands, plan  # noqa: E402,F401
import jpeg_folder  # noqa: E402


# ======== In a part's process: a clock on the loader of train_one_epoch ===========================
@dataclass
class Probe:
    """What a part's process measures: per step (data wait, compute) in seconds; syncs of steps
    [sync_from, sync_to); SIGTERM to itself when batch `preempt_at` is handed out (rank 0)."""
    sync_from: int = 0
    sync_to: int = 0
    preempt_at: int = -1
    steps: list = field(default_factory=list)
    syncs: list = field(default_factory=list)
    open: tuple = None
    counter: SyncCounter = None

    def stop_counting(self, keep=True):
        if self.counter:
            self.counter.__exit__(None, None, None)
            self.syncs += [{"counter": self.counter.count, "cuda": self.counter.cuda,
                            "sites": self.counter.sites,
                            "cuda_sites": self.counter.cuda_sites}] * keep
            self.counter = None

    def clock(self, iterator):
        self.open = None  # a batch fetched at an epoch's end and left
        self.stop_counting(keep=False)
        while True:
            asked = time.perf_counter()
            if self.open:  # the step before has ended: it asks for the next batch
                self.steps.append((self.open[0], asked - self.open[1]))
                self.open = self.stop_counting()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            got = time.perf_counter()
            n = len(self.steps)
            self.open = (got - asked, got)
            if n == self.preempt_at and common.is_main_process():
                self.preempt_at = -1
                # a real signal, handled by the script's own handler
                os.kill(os.getpid(), signal.SIGTERM)
            if self.sync_from <= n < self.sync_to and not self.counter:
                self.counter = SyncCounter().__enter__()
            yield batch


def clocked(loader, probe):
    """`loader` itself, iterated through `probe.clock` (a persistent loader is wrapped once)."""
    base = type(loader)
    if base.__name__ != "Clocked":
        loader.__class__ = type("Clocked", (base,),
                                {"__iter__": lambda self: probe.clock(base.__iter__(self))})
    return loader


def run_part(part, rank, port, out):
    """The body of one process of a part: torchrun's environment, output to its log, the script's
    own entry point (`common.run_script`) with `train_one_epoch`'s loader clocked; never returns."""
    os.setpgid(0, 0)  # the parent ends the whole group on a timeout
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the script sets its own, not the parent's
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(part.nproc),
                      GROUP_RANK="0", LOCAL_WORLD_SIZE=str(part.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **part.env)
    with common.open_for_writing(out / f"{part.name}.rank{rank}.log") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    probe = Probe(*part.sync_window, preempt_at=part.preempt_at)
    code = 1
    print(f"# {part.command()}", flush=True)
    try:
        module = importlib.import_module(part.script)
        if hasattr(module, "train_one_epoch"):
            train = module.train_one_epoch
            loaders = (torch.utils.data.DataLoader, device_crops.Prefetched)  # batched crops
            module.train_one_epoch = lambda *a, **k: train(*[clocked(x, probe) if isinstance(
                x, loaders) else x for x in a], **k)
        common.run_script(module.main, module.get_args_parser(), part.argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        probe.stop_counting()
        if rank == 0:
            report = {"steps": probe.steps, "syncs": probe.syncs}
            with common.open_for_writing(out / f"{part.name}.json") as f:
                f.write(json.dumps(report))
        atexit._run_exitfuncs()  # the script's exit handlers (loader workers), then the buffers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ======== Running the parts: forked processes, torchrun's environment, a timeout ==================
_running = []      # process-group ids of the part now running (ended on Ctrl-C)


def end(pids):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def launch(part, out, timeout):
    """Fork the part's processes and wait: at most `timeout` s, and once one has failed 30 s for the
    others (torchrun's grace). Returns (exit statuses by rank, seconds, whether it timed out)."""
    if part.start_from:
        (out / part.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(out / part.start_from / "checkpoint.pth", out / part.name / "checkpoint.pth")
    with socket.socket() as sock:  # a free port for the group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.time()
    pids = []
    status = {}  # pid -> exit status
    timed_out = False
    for rank in range(part.nproc):
        pid = os.fork()
        if pid == 0:
            run_part(part, rank, port, out)
        pids.append(pid)
    _running[:] = pids
    deadline = start + timeout
    while len(status) < len(pids):
        time.sleep(0.1)
        for pid in pids:
            done, raw = (0, 0) if pid in status else os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = os.waitstatus_to_exitcode(raw)
        if any(status.values()):
            deadline = min(deadline, time.time() + 30)
        if time.time() > deadline and len(status) < len(pids):
            timed_out = True
            rest = [p for p in pids if p not in status]
            end(rest)
            status.update((p, os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])) for p in rest)
    _running.clear()
    return [status[p] for p in pids], time.time() - start, timed_out


# ======== What each part should show ==============================================================
# docs/FIRST_GPU_RUN.md; tests/test_gpu_check.py keeps it true on CPUs
SYNCS_PER_STEP = dict.fromkeys(ARCH, 1)


def records(folder):
    path = folder / "log.txt"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def output(out, name, rank=0):
    path = out / f"{name}.rank{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def step_figures(steps, warmup, skipped, images_per_step):
    """What a part's measured steps show: `steps` is [(data wait, compute)] per step in seconds;
    the first `warmup` and those in the window `skipped` (the sync counter's) are left out. The
    median step says what the GPU computes; the mean wait and the images over the wall time of the
    measured steps say what a run gets, since a loader's workers deliver in bursts (a loader at
    half the GPU's speed can show a median wait of 0)."""
    kept = [(wait, wait + compute) for i, (wait, compute) in enumerate(steps)
            if i >= warmup and not skipped[0] <= i < skipped[1]]
    if not kept:
        return None
    waits = [wait for wait, _ in kept]
    wall = sum(step for _, step in kept)
    images = images_per_step * len(kept)
    return {"steps": len(kept), "median_step_s": statistics.median(s for _, s in kept),
            "median_wait_s": statistics.median(waits), "mean_wait_s": statistics.mean(waits),
            "wait_share": sum(waits) / wall, "images": images, "wall_s": wall,
            "images_per_s": images / wall}


def training(part, out, form, problems):
    """The line of a training part (precision, median step, data wait, images/s at the median step
    and over the measured steps, peak memory, loss, syncs) and its figures (`step_figures`)."""
    folder = out / part.name
    logged = records(folder)
    args = json.loads((folder / "args.json").read_text())
    if not logged or not all(math.isfinite(r["loss"]) for r in logged):
        problems.append("a missing or non-finite loss in log.txt")
    report = json.loads((out / f"{part.name}.json").read_text())
    batch = args["batch_size_per_gpu"] * part.nproc
    figures = step_figures(report["steps"], FORMS[form]["warmup"], part.sync_window, batch)
    if figures is None:
        problems.append("no step was measured")
    text = "no log"
    if logged and figures:
        step = figures["median_step_s"]
        text = (f"{args['precision']}{' (auto)' if args.get('precision_auto') else ''}, "
                f"{1e3 * step:.0f} ms/step median ({batch / step:.0f} img/s), data wait mean "
                f"{1e3 * figures['mean_wait_s']:.0f} ms ({figures['wait_share']:.0%} of the "
                f"time; median {1e3 * figures['median_wait_s']:.0f} ms), epoch "
                f"{figures['images_per_s']:.0f} img/s (waits included, {figures['steps']} "
                f"steps), {max(r['peak_memory_mb'] for r in logged):,.0f} MB, "
                f"loss {logged[-1]['loss']:.4g}")
    if report["syncs"]:
        counter = max(s["counter"] for s in report["syncs"])
        cuda = [s["cuda"] for s in report["syncs"] if s["cuda"] is not None]
        text += f", syncs/step {counter}" + (f" (CUDA {max(cuda)})" if cuda else "")
        allowed = SYNCS_PER_STEP[part.script]
        if counter > allowed or (cuda and max(cuda) > allowed + (args["precision"] == "fp16")):
            sites = {k: v for s in report["syncs"] for k, v in s["sites"].items()}
            cuda_sites = {k: v for s in report["syncs"] for k, v in s.get("cuda_sites", {}).items()}
            problems.append(f"more than {allowed} host sync(s) per step (counted at {sites}; "
                            f"CUDA's at {cuda_sites})")
    return text, figures


def rms(tensors):
    total = sum(t.double().pow(2).sum().item() for t in tensors)
    return math.sqrt(total / max(sum(t.numel() for t in tensors), 1))


def compare_runs(a, b, method):
    """How far apart two runs of `method` ended: the RMS difference of student and teacher over how
    far the student moved (the RMS of student - teacher), and of the loss's centres over their own
    RMS."""
    def floats(state):
        return [state[k] for k in sorted(state)
                if torch.is_tensor(state[k]) and state[k].is_floating_point()]
    moved = rms([s - t for s, t in zip(floats(a["student"]), floats(a["teacher"]))])
    gap = {}
    for key in ("student", "teacher", f"{method}_loss"):
        difference = rms([x - y for x, y in zip(floats(a[key]), floats(b[key]))])
        gap[key] = difference / (moved if key in ("student", "teacher") else rms(floats(a[key])))
    return gap


def checkpoint(out, name):
    return torch.load(out / name / "checkpoint.pth", map_location="cpu", weights_only=True)


# a training part compared with another by their epoch images/s: (part, the other, what it is)
COMPARED = {"glsd_batched": ("glsd", "the PIL crops'"),
            "dino_jpeg": ("dino", "the procedural images'"),
            "dino_jpeg_batched": ("dino_jpeg", "the PIL crops'")}


def evaluate(part, result, out, form, figures):
    """(passed, the summary line's text) of a part that ran; `figures` collects the training
    parts' step figures by part."""
    codes, seconds, timed_out = result
    if timed_out or any(codes):
        failed_rank = next((r for r, c in enumerate(codes) if c), 0)
        last = next((line for line in reversed(output(out, part.name, failed_rank).splitlines())
                     if line.strip()), "")
        reason = f"timed out after {seconds:.0f} s" if timed_out else f"exit status {codes}"
        return False, f"{reason}: {last[-300:]}"
    problems = []
    text = ""
    log = output(out, part.name)
    if part.name in ARCH or part.name in COMPARED:
        text, figures[part.name] = training(part, out, form, problems)
        other, what = COMPARED.get(part.name, (None, ""))
        if figures[part.name] and figures.get(other):
            ratio = figures[part.name]["images_per_s"] / figures[other]["images_per_s"]
            text += f" ({ratio:.2f}x {what} epoch images/s)"
    elif part.name == "dino_preempted":
        ckpt = checkpoint(out, part.name)
        text = (f"stopped by SIGTERM during step {part.preempt_at}, checkpoint at epoch "
                f"{ckpt['epoch']}, step {ckpt['step']}")
        expected = (0, part.preempt_at + 1)
        if (ckpt["epoch"], ckpt["step"]) != expected or "received SIGTERM" not in log:
            problems.append(f"expected a checkpoint at epoch 0, step {part.preempt_at + 1} and "
                            "'received SIGTERM'")
    elif part.name == "dino_resumed":
        resumed = records(out / part.name)[-1]["loss"]
        whole = records(out / "dino")[-1]["loss"]
        text = (f"second epoch's loss {resumed:.6g}, uninterrupted {whole:.6g} (relative "
                f"difference {abs(resumed / whole - 1):.1e})")
        if "at epoch 0, step" not in log or not abs(resumed / whole - 1) <= 0.02:
            problems.append("not resumed mid-epoch, or the loss is more than 2% off")
    elif part.name == "dino_fp16":
        ckpt = checkpoint(out, part.name)
        scale = ckpt["scaler"]["scale"]
        loss = records(out / part.name)[-1]["loss"]
        text = (f"grad scaler scale {scale:g} ({round(math.log2(65536 / scale))} overflow(s) in "
                f"{FORMS[form]['steps']} steps), loss {loss:.4g}")
        # fp16 already: no line
        trained = json.loads((out / "dino" / "args.json").read_text())["precision"]
        if (not math.isfinite(loss)
                or trained != "fp16" and "precision: the checkpoint was trained in" not in log):
            problems.append("a non-finite loss, or no line about the grad scaler the checkpoint "
                            "lacked")
    elif part.name == "eval_knn":
        knn_lines = [line for line in log.splitlines() if "-NN classifier result" in line]
        text = (knn_lines or ["no k-NN result"])[-1]
        problems += [text] * (text == "no k-NN result")
    elif part.name == "eval_linear":
        logged = records(out / "eval_linear")
        text = (f"{len(logged)} epochs, best top-1 {logged[-1]['best_top1']:.1f}%" if logged
                else "no log")
    elif part.name.endswith("_two_processes"):
        one = part.name.replace("two_processes", "one_process")
        gap = compare_runs(checkpoint(out, one), checkpoint(out, part.name), part.script)
        losses = [records(out / name)[-1]["loss"] for name in (one, part.name)]
        text = (f"apart by {', '.join(f'{k} {v:.1e}' for k, v in gap.items())} of the distance "
                f"moved; loss {losses[0]:.6g} (one) / {losses[1]:.6g} (two)")
        if not max(gap.values()) <= 0.01:
            problems.append("one process and two ended more than 1% of the distance moved apart")
    return not problems, "; ".join([text, *problems]) + f" [{seconds:.0f} s]"


# ======== main ====================================================================================
def count_gpus():
    """torch.cuda.device_count() asked in a child: this process must not start CUDA before
    forking."""
    pid = os.fork()
    if pid == 0:
        with contextlib.suppress(BaseException):
            os._exit(min(torch.cuda.device_count(), 99))
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def get_args_parser():
    p = argparse.ArgumentParser("gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cuda: the GPU form (paper size, NCCL); cpu: the reduced form (tiny "
                        "models, gloo); auto: cuda when a GPU is visible")
    p.add_argument("--out", default="runs/gpu_check",
                   help="a new or empty folder: every part's output and log")
    p.add_argument("--parts", nargs="+", help="run only these parts (with the parts they need)")
    p.add_argument("--timeout", default=300, type=common.POSITIVE_INT,
                   help="seconds a part may take")
    p.add_argument("--jpeg_cache", default="runs/jpeg_folders",
                   help="where the JPEG parts' image folder is made once and reused "
                        "(extras/perf/jpeg_folder.py)")
    return p


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    gpus = 0 if args.device == "cpu" else count_gpus()
    if args.device == "cuda" and not gpus:
        common.die("--device cuda: no GPU is visible")
    form = "gpu" if gpus else "cpu"
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()):
        common.die(f"--out {out} is not empty: remove it or choose another folder")
    parts = plan(form, gpus, out, args.jpeg_cache)
    if args.parts:
        unknown = sorted(set(args.parts) - {p.name for p in parts})
        if unknown:
            common.die(f"--parts {' '.join(unknown)}: no such part here; choose among "
                       f"{' '.join(p.name for p in parts)}")
        wanted = [q for q in parts if q.name in args.parts]
        parts = [p for p in parts if p.name in args.parts or any(p.name in q.needs for q in wanted)]
    check_commands(parts)
    common.make_folder(out, "--out")  # after every refusal: a refused check leaves no folder
    print(f"gpu_check: the {form} form, {f'{gpus} GPU(s)' if gpus else 'CPU'}, torch "
          f"{torch.__version__}, {len(parts)} parts; logs in {out}", flush=True)
    results = {}
    start = time.time()
    if any(p.name.startswith("dino_jpeg") for p in parts):
        jpeg = FORMS[form]["jpeg"]
        folder = jpeg_folder.make(args.jpeg_cache, jpeg["images"], size=jpeg["size"])
        print(f"JPEG folder {folder}: {json.dumps(jpeg_folder.describe(folder))}, ready in "
              f"{time.time() - start:.0f} s", flush=True)
    # kill, timeout: end the running part as Ctrl-C does
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for part in parts:
            missing = [n for n in part.needs
                       if n not in results or results[n][2] or any(results[n][0])]
            if missing:
                print(f"{part.name}: skipped ({', '.join(missing)} failed)", flush=True)
                continue
            # (every print above flushed: nothing to fork twice)
            results[part.name] = launch(part, out, args.timeout)
            print(f"{part.name}: exit status {results[part.name][0]} in "
                  f"{results[part.name][1]:.0f} s", flush=True)
    except KeyboardInterrupt:
        end(_running)
        raise SystemExit("gpu_check stopped (Ctrl-C or SIGTERM): the part running was ended; its "
                         f"logs are in {out}") from None
    figures = {}
    failed = []
    summary = []  # summary.jsonl: each part's line and figures, for gpu_run.py and the tests
    print(f"\n{'part':23} {'exit':5} {'result':7} details")
    for part in parts:
        if part.name not in results:
            ok = False
            text = "skipped: a part it needs failed"
            codes = "-"
        else:
            try:
                ok, text = evaluate(part, results[part.name], out, form, figures)
            except (OSError, KeyError, ValueError, IndexError) as e:
                # a file the part should have written is missing or malformed
                ok = False
                text = f"its output is incomplete: {type(e).__name__}: {e}"
            codes = ",".join(map(str, results[part.name][0]))
        failed += [] if ok else [part.name]
        print(f"{part.name:23} {codes:5} {'ok' if ok else 'FAILED':7} {text}")
        summary.append({"part": part.name, "ok": ok, "exit": codes, "details": text,
                        "command": part.command(), "figures": figures.get(part.name)})
    with common.open_for_writing(out / "summary.jsonl") as f:
        f.write("".join(json.dumps(line) + "\n" for line in summary))
    print(f"\n{len(parts) - len(failed)} of {len(parts)} parts passed in "
          f"{(time.time() - start) / 60:.1f} min"
          + (f"; failed: {' '.join(failed)} (docs/FIRST_GPU_RUN.md says what to do)"
             if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
