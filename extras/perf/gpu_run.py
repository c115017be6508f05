"""The one prepared run for a GPU machine: the GPU check, a loader's CPU cost per JPEG, and the
authors' DINO beside ours, in under 10 minutes on one H200; every figure left in files to commit.

    mkdir -p .authors_dino && cp DINO/{main_dino,utils,vision_transformer}.py .authors_dino/
    python extras/perf/gpu_run.py                   # writes docs/data/ and runs/gpu_run/<time>/
    python extras/perf/gpu_run.py --docs $OUT/data  # a lent machine: its $OUT comes back

`.authors_dino/` (ignored by git) holds the authors' facebookresearch/dino files. In order, each
with what is left of --budget (default 9 min):
  1. extras/perf/gpu_check.py (every part, the JPEG parts included): 2.3 min measured on one H200
     for the 11 parts before the JPEG ones (docs/data/gpu_check_h200.txt); the two JPEG parts (80
     steps each, 10 workers, loader-bound at 300-500 img/s if a core decodes and crops an image
     in 20-35 ms) and making the 4,000 JPEGs (about 6 s on 16 cores) add about 1 min: 3.5 min.
  2. extras/perf/jpeg_folder.py --cost 96: a core's CPU milliseconds per JPEG for each crop path
     (10 s).
  3. extras/perf/side_by_side.py: 8 steps alone (25 steps each, 70-200 ms, and a build) about
     1.5 min, end to end 3 x 50 steps about 1 min, fused AdamW 10 s, torch.compile's first steps 1
     to 2 min (not measured): 3.5-4.5 min.
The estimate is 7.5-8.5 min; a step that overruns is ended (its lines so far are kept) and the next
gets what is left. Writes into --docs: gpu_run_<gpu>_<date>.txt (everything printed, under a
header of command, times, commit and machine), gpu_check.jsonl (one line per part),
loader_cost.jsonl and side_by_side.jsonl (the other steps' lines), each line with its provenance;
then prints what to commit.
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
    p.add_argument("--budget", default=540, type=common.POSITIVE_INT,
                   help="seconds for the whole run (a lent machine's command may take 600, and "
                        "a step past the budget has 30 s to end); each step gets what is left")
    p.add_argument("--jpeg_cache", default="runs/jpeg_folders")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the plumbing on a CPU (gpu_check's CPU form, side_by_side's smoke)")
    return p


def steps(args):
    """(name, command) of each step, in order."""
    python = [sys.executable]
    cpu = args.device == "cpu"
    check = [*python, "extras/perf/gpu_check.py", "--out", str(Path(args.out) / "gpu_check"),
             "--jpeg_cache", args.jpeg_cache, "--device", args.device]
    cost = [*python, "extras/perf/jpeg_folder.py", "--cache", args.jpeg_cache,
            "--log", str(Path(args.docs) / "loader_cost.jsonl"),
            *(["--images", "32", "--size", "96", "--cost", "8"] if cpu else ["--cost", "96"])]
    side = [*python, "extras/perf/side_by_side.py", "--authors_code", args.authors_code,
            "--device", args.device, "--jpeg_cache", args.jpeg_cache,
            "--out", str(Path(args.docs) / "side_by_side.jsonl"),
            # on a CPU compiling takes minutes (side_by_side.py): fused AdamW only
            *(["--smoke", "--levers", "fused_adamw"] if cpu else [])]
    return [("gpu_check", check), ("loader_cost", cost), ("side_by_side", side)]


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
    missing = [n for n in authors_dino.FILES if not (Path(args.authors_code) / n).is_file()]
    if missing:
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
    deadline = time.time() + args.budget
    status = {}
    with open(text, "a") as log:
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
        log.write(f"# ended {provenance.utc_now()} UTC\n")
    written = [str(docs / name) for name in (text.name, "gpu_check.jsonl", "loader_cost.jsonl",
                                             "side_by_side.jsonl") if (docs / name).exists()]
    print(f"\ngpu_run: {'; '.join(f'{k} {v}' for k, v in status.items())}\nto commit: "
          + " ".join(written))
    return 0 if all(v.startswith("exit status 0 ") for v in status.values()) else 1


def record_check(out, docs, started, command, gpu):
    """gpu_check's parts (its summary.jsonl) as lines of docs/data/gpu_check.jsonl, with their
    provenance (the other steps write their own lines)."""
    summary = out / "gpu_check" / "summary.jsonl"
    if not summary.exists():
        return
    with open(docs / "gpu_check.jsonl", "a") as f:
        for line in summary.read_text().splitlines():
            f.write(json.dumps({**json.loads(line), "device": gpu, "command": command,
                                **provenance.stamp(started)}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
