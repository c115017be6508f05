"""The one prepared run for a GPU machine: the device decode's check, the GPU check, a loader's
CPU cost per JPEG, and the authors' DINO beside ours, within 8 minutes on one GPU; every figure
and log left in files to commit (docs/FIRST_GPU_RUN.md: the exact call on a lent machine).

    mkdir -p .authors_dino && cp DINO/{main_dino,utils,vision_transformer}.py .authors_dino/
    python extras/perf/gpu_run.py                   # writes docs/data/ and runs/gpu_run/<time>/
    python extras/perf/gpu_run.py --docs $OUT/data  # a lent machine: its $OUT comes back
    python extras/perf/gpu_run.py --device cpu      # the plumbing on a CPU (no authors' code)

`.authors_dino/` (ignored by git, so carried to a lent machine by hand) holds the authors'
facebookresearch/dino files. In order, each with what is left of --budget (default 7.5 min):
  1. extras/perf/decode_check.py: nvJPEG on its own stream while a backward is queued (20 s).
  2. extras/perf/gpu_check.py (every part, the JPEG parts included): 2.3 min measured on one H200
     for the 11 parts before the JPEG ones (docs/data/gpu_check_h200.txt); the two JPEG parts and
     making the 4,000 JPEGs (about 6 s on 16 cores) add about 1 min: 3.5 min.
  3. extras/perf/jpeg_folder.py --cost 96: a core's CPU milliseconds per JPEG per crop path (10 s).
  4. extras/perf/side_by_side.py at 128 images per GPU: 4 steps alone (25 steps each) about 45 s,
     end to end 3 x 30 steps (4,000 JPEGs: 31 batches) about 1 min, the batched step split into
     decode wait, crop issue and crop compute; then the levers, the cheap one first: fused AdamW
     10 s, torch.compile's first steps 1 to 2 min (not measured): 3-4 min.
The estimate is 7-8 min; a step that overruns is ended (its lines so far are kept) and the next
gets what is left. Writes into --docs as each step ends: gpu_run_<gpu>_<date>.txt (everything
printed, under a header of command, times, commit and machine), decode_check.jsonl,
gpu_check.jsonl (one line per part), loader_cost.jsonl and side_by_side.jsonl, each line with its
provenance, and the step's logs (gpu_run_logs/<step>/, no checkpoints); then prints what to commit.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "extras" / "experiments")]
import authors_dino  # noqa: E402
import common  # noqa: E402
import provenance  # noqa: E402


def get_args_parser():
    p = argparse.ArgumentParser("gpu_run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--authors_code", default=".authors_dino",
                   help="folder of the authors' main_dino.py, utils.py, vision_transformer.py")
    p.add_argument("--out", default="runs/gpu_run",
                   help="every log and checkpoint, in a new folder <UTC time> inside it (keep it "
                        "off a lent machine's $OUT: the checkpoints are large)")
    p.add_argument("--docs", default="docs/data", help="where the files to commit are written")
    p.add_argument("--budget", default=None, type=common.POSITIVE_INT,
                   help="seconds for the whole run, each step getting what is left; default 450 "
                        "on a GPU (8 minutes with the 30 s a step past it has to end), 1,200 in "
                        "the CPU form")
    p.add_argument("--jpeg_cache", default="runs/jpeg_folders")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the plumbing on a CPU (gpu_check's CPU form, side_by_side's smoke)")
    return p


def steps(args):
    """(name, command) of each step, in order."""
    python = [sys.executable]
    cpu = args.device == "cpu"
    decode = [*python, "extras/perf/decode_check.py", "--device", args.device, "--jpeg_cache",
              args.jpeg_cache, "--out", str(Path(args.docs) / "decode_check.jsonl"),
              *(["--images", "8", "--size", "96", "--rounds", "2", "--width", "64"] if cpu
                else [])]
    check = [*python, "extras/perf/gpu_check.py", "--out", str(Path(args.out) / "gpu_check"),
             "--jpeg_cache", args.jpeg_cache, "--device", args.device]
    cost = [*python, "extras/perf/jpeg_folder.py", "--cache", args.jpeg_cache,
            "--log", str(Path(args.docs) / "loader_cost.jsonl"),
            *(["--images", "32", "--size", "96", "--cost", "8"] if cpu else ["--cost", "96"])]
    side = [*python, "extras/perf/side_by_side.py", "--authors_code", args.authors_code,
            "--device", args.device, "--jpeg_cache", args.jpeg_cache,
            "--out", str(Path(args.docs) / "side_by_side.jsonl"), "--batches", "128",
            # on a CPU compiling takes minutes (side_by_side.py): fused AdamW only
            *(["--smoke", "--levers", "fused_adamw"] if cpu else []),
            *(["--ours_only"] if cpu and authors_code_missing(args) else [])]
    return [("decode_check", decode), ("gpu_check", check), ("loader_cost", cost),
            ("side_by_side", side)]


def authors_code_missing(args):
    return [n for n in authors_dino.FILES if not (Path(args.authors_code) / n).is_file()]


def keep_logs(source, target):
    """A step's logs (not its checkpoints) copied where the files to commit go, as it ends."""
    for path in Path(source).rglob("*") if Path(source).is_dir() else []:
        if path.is_file() and path.suffix in (".log", ".txt", ".jsonl"):
            copy = Path(target) / path.relative_to(source)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)


def run(command, seconds, log):
    """`command`'s output, echoed and appended to `log`; after `seconds` its process group (loader
    workers, the check's parts) gets SIGTERM (gpu_check then ends its part), 30 s later SIGKILL.
    Returns (exit status, whether it was ended)."""
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)

    def pass_on(signum, _frame):
        """gpu_run stopped by a kill or Ctrl-C: the step's process group is ended with it."""
        os.killpg(child.pid, signal.SIGTERM)
        raise SystemExit(f"gpu_run stopped by signal {signum}; the step running was ended")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, pass_on)

    def echo():
        for line in child.stdout:
            print(line, end="", flush=True)
            log.write(line)
    reader = threading.Thread(target=echo)
    reader.start()
    ended = False
    try:
        child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        ended = True
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    reader.join()
    return child.returncode, ended


def machine():
    """The GPU, its driver, the cores and the versions, in one line (nvidia-smi when there)."""
    import timm
    import torch
    import torchvision
    gpu = "no GPU"
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        smi = shutil.which("nvidia-smi")
        query = ["--query-gpu=memory.total,driver_version", "--format=csv,noheader"]
        details = subprocess.run([smi, *query], capture_output=True, text=True).stdout if smi \
            else ""
        gpu += f" ({details.splitlines()[0].strip()})" if details.strip() else ""
    return (f"{gpu}, {os.cpu_count()} CPU cores ({provenance.cpu_model()}); Python "
            f"{platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"torchvision {torchvision.__version__}, timm {timm.__version__}"), gpu


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    missing = authors_code_missing(args)
    if missing and args.device == "cuda":
        common.die(f"--authors_code {args.authors_code}: no {', '.join(missing)}; copy the "
                   "authors' facebookresearch/dino files there first (the folder is ignored by "
                   "git)")
    for name in ("authors_code", "out", "docs", "jpeg_cache"):  # the steps run from the root
        setattr(args, name, str(Path(getattr(args, name)).resolve()))
    docs = Path(args.docs)
    args.out = str(Path(args.out) / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    out = Path(args.out)
    describe, gpu = machine()
    if args.device == "cuda" and gpu == "no GPU":
        common.die("no GPU is visible; --device cpu runs the plumbing on a CPU")
    docs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    started = provenance.start()
    words = sys.argv[1:] if argv is None else argv
    command = "python " + " ".join(["extras/perf/gpu_run.py", *words])
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.split(" (")[0].lower()).strip("_")
    text = docs / f"gpu_run_{slug}_{started['started_utc'][:10]}.txt"
    changed = ", ".join(started["uncommitted"]) or "none"
    header = (f"# {command}\n# started {started['started_utc']} UTC; commit "
              f"{started['commit'][:7]}, uncommitted: {changed}\n# machine: {describe}\n")
    print(header, end="", flush=True)
    deadline = time.time() + (args.budget or (450 if args.device == "cuda" else 1200))
    status = {}
    with common.open_for_writing(text, "a") as log:
        log.write(header)
        for name, cmd in steps(args):
            left = deadline - time.time()
            if left < 20:
                status[name] = "not run: the budget was spent"
                log.write(f"# {name}: {status[name]}\n")
                continue
            log.write(f"\n# ---- {name}: {' '.join(cmd[1:])} (at most {left:.0f} s)\n")
            log.flush()
            start = time.time()
            code, ended = run(cmd, left, log)
            status[name] = (f"exit status {code} in {time.time() - start:.0f} s"
                            + (" (ended: over the budget)" if ended else ""))
            log.write(f"# {name}: {status[name]}\n")
            log.flush()
            if name == "gpu_check":
                record_check(out, docs, started, command, gpu)
                keep_logs(out / "gpu_check", docs / "gpu_run_logs" / "gpu_check")
        log.write(f"# ended {provenance.utc_now()} UTC\n")
    written = [str(docs / name) for name in (text.name, "decode_check.jsonl", "gpu_check.jsonl",
                                             "loader_cost.jsonl", "side_by_side.jsonl",
                                             "gpu_run_logs") if (docs / name).exists()]
    print(f"\ngpu_run: {'; '.join(f'{k} {v}' for k, v in status.items())}\nto commit: "
          + " ".join(written))
    return 0 if all(v.startswith("exit status 0 ") for v in status.values()) else 1


def record_check(out, docs, started, command, gpu):
    """gpu_check's parts (its summary.jsonl) as lines of docs/data/gpu_check.jsonl, with their
    provenance (the other steps write their own lines)."""
    summary = out / "gpu_check" / "summary.jsonl"
    if not summary.exists():
        return
    with common.open_for_writing(docs / "gpu_check.jsonl", "a") as f:
        for line in summary.read_text().splitlines():
            f.write(json.dumps({**json.loads(line), "device": gpu, "command": command,
                                **provenance.stamp(started)}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
