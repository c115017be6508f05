"""Safety checks of the training and evaluation scripts, each called from one line marked
`# checks`: a fork may delete this file and those lines, and every script still trains, resumes
and evaluates, without the refusals (docs/ERRORS.md lists them): one run per --output_dir,
start-up and resume checks, the non-finite stop, a mistake or Ctrl-C in one line.
"""
import contextlib
import errno
import fcntl
import functools
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import common
from common import die, log

# ======== 1. One run per --output_dir ============================================================
_claim = None  # this process's --output_dir: {"dir", "checkpoint", "fd"}


def claim_output_dir(output_dir, script, checkpoint="checkpoint.pth"):
    """Collective: --output_dir becomes this run's own. Rank 0 holds a `flock` on its `.lock`
    (never deleted; the kernel frees it however the process ends); a folder whose args.json
    names another script is refused."""
    global _claim
    release_output_dir()  # main() run again in this process: the previous run is over
    _claim = {"dir": str(output_dir), "checkpoint": checkpoint, "fd": None}
    problem = None
    if common.is_main_process():
        try:
            common.make_folder(output_dir, "--output_dir")
            for name in (".lock", "args.json", "log.txt", checkpoint):  # a FIFO would block
                common.refuse_irregular(Path(output_dir) / name)
            _claim["fd"] = take_lock(Path(output_dir) / ".lock")
            owner = None  # the script that args.json names, if any
            with contextlib.suppress(OSError, ValueError, AttributeError):
                owner = json.loads((Path(output_dir) / "args.json").read_text()).get("script")
            if owner not in (None, script):
                die(f"--output_dir {output_dir} holds a run of {owner}: give {script} its own")
        except SystemExit as e:
            problem = str(e.code)
    problem = common.all_gather_objects(problem)[0]
    if problem:
        raise SystemExit(problem)


def release_output_dir():
    """Unlock --output_dir (a main() called in a process that goes on; `.lock` itself stays)."""
    global _claim
    if _claim and _claim["fd"] is not None:
        os.close(_claim["fd"])
    _claim = None


def take_lock(lock):
    """A file descriptor that holds the lock on `lock`, which names its holder."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        link = " (a symbolic link)" if e.errno == errno.ELOOP else ""
        die(f"cannot write {lock}: {e.strerror}{link}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace") or "a run starting now"
        os.close(fd)
        die(f"--output_dir {lock.parent} is in use by another run ({holder}; lock {lock})")
    except OSError as e:  # e.g. Lustre mounted without flock
        log(f"warning: no file locks in {lock.parent} ({e.strerror}): nothing stops a second run")
        return fd
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode(), 0)
    return fd


# ======== 2. Start-up and resume checks ==========================================================
# Arguments a resumed run may change: where and how it runs, not what it learns (and --epochs).
RUN_ONLY_ARGS = {"output_dir", "device", "num_workers", "data_path", "skip_bad_images",
                 "saveckp_freq", "save_every_iters", "precision", "precision_auto",
                 "batched_crops", "allow_changed_args", "epochs"}


def check_start_args(args, stride=None):
    """Refused before any data or model work: a warm-up longer than the run, crop flags (sizes in
    tokens of --arch's stride, or of `stride` px)."""
    if args.warmup_epochs > args.epochs:
        die(f"--warmup_epochs {args.warmup_epochs} is longer than --epochs {args.epochs}; lower it")
    check_scale_range("--global_crops_scale", args.global_crops_scale)
    sizes = {"--global_crop_size": args.global_crop_size}
    if args.local_crops_number:
        check_scale_range("--local_crops_scale", args.local_crops_scale)
        sizes["--local_crop_size"] = args.local_crop_size
    stride = stride or common.token_stride(args.arch, args.patch_size)
    for flag, size in sizes.items():
        if size % stride:
            die(f"{flag} {size} is not a multiple of the {args.arch} token stride ({stride} px); "
                f"use e.g. {max(stride, size // stride * stride)}")
    if sizes.get("--local_crop_size", 0) > args.global_crop_size:
        die(f"--local_crop_size {args.local_crop_size} is larger than --global_crop_size "
            f"{args.global_crop_size}: the local crops are the small views")


def check_data_path(args):
    """Refuse a folder reached twice (ImageFolder follows links: `class/up -> ..` never ends)."""
    if args.dataset != "folder" or not args.data_path or not os.path.isdir(args.data_path):
        return  # `common.build_dataset` names what is missing
    seen = {}
    for folder, _dirs, _files in os.walk(args.data_path, followlinks=True):
        key = (os.stat(folder).st_dev, os.stat(folder).st_ino)
        if key in seen:
            die(f"{folder} leads to {seen[key]}, a folder already read: remove the link")
        seen[key] = folder


def check_arch_flags(args):
    """A flag that --arch ignores would be in args.json as if it had been used."""
    vit = common.ARCHS[args.arch]["family"] == "vit"
    if vit and (getattr(args, "window_size", 7) != 7 or getattr(args, "fit_window", False)):
        die(f"{args.arch} would ignore --window_size and --fit_window (Swin flags): drop them")
    if not vit and args.patch_size != 16:
        die(f"{args.arch} would ignore --patch_size (a ViT flag; --arch sets Swin's): drop it")


def check_scale_range(flag, scale):
    """An area range (min, max) of RandomResizedCrop: reversed, torch fails in the first batch."""
    if scale[0] > scale[1]:
        die(f"{flag} {scale[0]} {scale[1]} is reversed: give the smallest area first")


def check_resumed_args(ckpt, args, method, run_only=()):
    """Refuse a flag that --arch ignores, a looped image folder, a checkpoint of another method,
    or one trained with arguments that change what is trained (but `RUN_ONLY_ARGS`, `run_only`)."""
    check_arch_flags(args)
    check_data_path(args)
    if ckpt is None:
        return
    path = Path(args.output_dir) / "checkpoint.pth"
    writer = ckpt.get("method")
    if not isinstance(ckpt.get("args", {}), dict):  # a Namespace: the authors' main_dino.py & co
        die(f"{path} was written by the authors' code, not {method}.py: it cannot be resumed; "
            f"evaluate it with --pretrained_weights of eval_knn.py or eval_linear.py")
    if writer != method:
        die(f"{path} was written by {f'{writer}.py' if writer else 'an unknown program'}, not "
            f"{method}.py: give {method}.py its own --output_dir")
    old = ckpt.get("args", {})
    changed = common.changed_args(old, args, RUN_ONLY_ARGS | set(run_only))
    if changed and not args.allow_changed_args:
        die(f"{path} was trained with other arguments: {', '.join(changed)}; run with the "
            f"checkpoint's values, another --output_dir, or --allow_changed_args")
    if changed:
        log(f"warning: resuming with changed arguments (--allow_changed_args): "
            f"{', '.join(changed)}")
    done = ckpt.get("epoch", 0)
    step = ckpt.get("step", 0)
    if done + bool(step) > args.epochs:
        steps = f" and {step} steps" if step else ""
        die(f"{path} has already trained {done} epochs{steps}, more than --epochs {args.epochs}")
    if old.get("epochs", args.epochs) != args.epochs:
        log(f"--epochs changed from {old['epochs']} to {args.epochs}: the schedules follow it")


def check_resumed_dataset(ckpt, dataset, args):
    """Refuse another dataset; with --allow_changed_args its epoch restarts (step set to 0)."""
    if ckpt is None or ckpt.get("dataset") in (None, common.dataset_record(dataset)):
        return
    old = ckpt["dataset"]["images"]
    change = (f"{old} images, now {len(dataset)}" if old != len(dataset)
              else f"{old} images as now, but other files or labels")
    if not args.allow_changed_args:
        die(f"{Path(args.output_dir) / 'checkpoint.pth'} was trained on another dataset "
            f"({change})")
    log(f"warning: resuming on another dataset ({change}; --allow_changed_args): epoch "
        f"{ckpt['epoch']} starts again at its first batch")
    ckpt["step"] = 0


# ======== 3. The non-finite stop =================================================================
def check_finite(stats, epoch, args, student, teacher, optimizer, criterion):
    """Collective: on a loss that is not finite (in any process) rank 0 writes the step's state
    to checkpoint_nonfinite.pth, and every process stops with advice."""
    if math.isfinite(stats["loss"]):
        return
    path = Path(args.output_dir) / "checkpoint_nonfinite.pth"
    if common.is_main_process():
        state = {"student": common.unwrap(student), "teacher": teacher, "optimizer": optimizer,
                 "loss": criterion}
        common.save_checkpoint({**{k: v.state_dict() for k, v in state.items() if v is not None},
                                "epoch": epoch, "args": vars(args)}, path)
    if common.is_dist():  # the others wait for the file: one exiting first stops rank 0 mid-write
        dist.barrier()
    common.close_progress_bars()  # the error, not the bar, is the last line
    log(f"error: the loss is {stats['loss']} at epoch {epoch}; debug checkpoint written to {path}."
        f"\nLikely causes: mixed-precision overflow, a too high learning rate, or exploding "
        f"gradients. Try --precision fp32, a lower --lr, or a lower --clip_grad.")
    sys.exit(1)


# ======== 4. Exits in one line ===================================================================
def one_line_exits(main):
    """`main` with a user's mistake, Ctrl-C and an unreadable image in one line, also for torchrun.
    Other errors keep torch's message (out of memory, a dead worker, a lost peer) and `record`."""
    @functools.wraps(main)
    @record
    def run(args):
        try:
            return main(args)
        except KeyboardInterrupt:
            where = last_checkpoint()
            resume = "; run the same command again to resume" if ": " in where else ""
            common.close_progress_bars()
            print(report(f"interrupted (Ctrl-C){where}{resume}"), file=sys.stderr, flush=True)
            raise SystemExit(130) from None  # 128 + SIGINT, the shell's code for Ctrl-C
        except SystemExit as e:
            if isinstance(e.code, str):  # die(): a user error
                report(e.code)
            raise
        except common.BadImageError as e:  # a worker's: its traceback's last line is the error's
            common.close_progress_bars(end_line=True)  # the error starts a line
            line = str(e).strip().splitlines()[-1].split("BadImageError: ")[-1]
            raise SystemExit(report(f"error: {line}")) from None
        finally:
            release_output_dir()
    return run


def report(message):
    """`message`, also written to torchrun's error file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with contextlib.suppress(OSError, SystemExit), common.open_for_writing(path) as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
    return message


def last_checkpoint():
    """Where an interrupted run's checkpoint is ('' for a script without one)."""
    if _claim is None or not _claim["checkpoint"]:
        return ""
    path = Path(_claim["dir"]) / _claim["checkpoint"]
    if not path.exists():
        return f" before the first checkpoint ({path}) was written"
    return f": the last checkpoint is {path}"
