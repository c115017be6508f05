"""Faults that a careful user or a cluster causes, and what they must never lead to: a silently
wrong result (labels numbered per split, a resumed run on other data, a symlink loop multiplying
the images), an overwritten run (two runs in one --output_dir, eval_linear.py in a training
folder), or a traceback instead of one line naming the problem. Runs on tiny data (CPU) are real
subprocesses where the behaviour is the process's (torchrun, Ctrl-C, the one-line error on stderr
with exit status 1); elsewhere the script's own entry point runs in this process (`run_here`, no
interpreter start-up); helpers are called in process."""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from test_reliability import run_here, stop_at_check  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--arch", "vit_pico", "--dataset", "synthetic", "--synthetic_images", "48", "--synthetic_image_size", "32",
        "--global_crop_size", "32", "--local_crop_size", "16", "--local_crops_number", "2", "--out_dim", "64",
        "--batch_size_per_gpu", "8", "--num_workers", "0", "--warmup_epochs", "1", "--device", "cpu",
        "--max_steps_per_epoch", "1", "--epochs", "1",
        "--precision", "fp32"]  # not auto: runs are compared to the digit, on every CPU
EVAL = ["--random_init", "--arch", "vit_pico", "--resize", "32", "--crop", "32", "--batch_size_per_gpu", "4",
        "--num_workers", "0", "--device", "cpu"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run(*cmd, timeout=300):
    cmd = [sys.executable, *cmd] if str(cmd[0]).endswith(".py") or cmd[0] == "-c" else list(cmd)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def one_line_error(result, expected):
    """The run failed, without a traceback, and its last line is the error naming the problem."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, last
    return last


def image_folder(root, classes, per_class=4, size=32, seed=0):
    """root/<class>/<i>.png; every class has its own grey level, so images are told apart by class."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            level = 40 + 160 * c / max(len(classes) - 1, 1)
            pixels = np.clip(level + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


# ------------------------------------------------------------------------------------------------
# 1. Class indices: the test split's labels follow the train split's class names
# ------------------------------------------------------------------------------------------------
def test_val_classes_are_numbered_by_name_as_in_train(tmp_path):
    image_folder(tmp_path / "train", ["a", "b", "c"])
    (tmp_path / "val").mkdir()
    shutil.copytree(tmp_path / "train" / "c", tmp_path / "val" / "c")     # val/ holds class c only
    args = Namespace(dataset="folder", data_path=str(tmp_path), holdout=0, skip_bad_images=False)
    train, val = common.build_eval_splits(args)
    assert [label for _, label in val.samples] == [2] * 4 and val.targets == [2] * 4   # not 0: c is train's class 2
    assert val.classes == train.classes and val[0][1] == 2
    (tmp_path / "val" / "z").mkdir()
    shutil.copy(tmp_path / "train" / "a" / "0.png", tmp_path / "val" / "z" / "0.png")
    with pytest.raises(SystemExit, match="classes that the train split does not have: z"):
        common.build_eval_splits(args)


def test_an_evaluation_on_a_train_split_of_one_class_is_refused(tmp_path):
    """An unlabelled layout (train/images/*.png) trains a self-supervised method, but every classifier
    scores 100% on it: evaluating it is refused, not published as a perfect score."""
    image_folder(tmp_path / "train", ["images"])
    shutil.copytree(tmp_path / "train", tmp_path / "val")
    args = Namespace(dataset="folder", data_path=str(tmp_path), holdout=0, skip_bad_images=False)
    assert len(common.build_dataset(args)) == 4                     # training reads it
    with pytest.raises(SystemExit, match="the train split has one class \\(images\\): any classifier scores 100%"):
        common.build_eval_splits(args)


def test_knn_on_a_val_split_with_fewer_classes_is_right(tmp_path):
    """val/ = copies of train/'s class-b images: their nearest train image is themselves (1-NN
    top-1 100%); numbered per split, val's b would be class 0 and score 0%."""
    image_folder(tmp_path / "train", ["a", "b"])
    (tmp_path / "val").mkdir()
    shutil.copytree(tmp_path / "train" / "b", tmp_path / "val" / "b")
    r = run_here("eval_knn.py", *EVAL, "--dataset", "folder", "--data_path", str(tmp_path), "--nb_knn", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1-NN classifier result: top-1 100.00%" in r.stdout


# ------------------------------------------------------------------------------------------------
# 2. One run per --output_dir
# ------------------------------------------------------------------------------------------------
def hold_lock(folder):
    """A live process that holds `folder`'s lock as a running training run does (flock), until killed."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


HOLD_LOCK = """
import fcntl, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode())
print("locked", flush=True)
time.sleep(600)
"""


def test_a_folder_in_use_by_a_live_run_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        r = run_here("dino.py", *TINY, "--output_dir", str(out))
        one_line_error(r, f"--output_dir {out} is in use by another run (pid {holder.pid} on host {socket.gethostname()};")
        assert sorted(p.name for p in out.iterdir()) == [".lock"]            # nothing written, lock kept
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_file_of_an_ended_run_is_no_lock_and_is_never_deleted(tmp_path):
    """The lock is the kernel's `flock`, not the file: a file left by a killed run (any content)
    is taken over, and the file stays (a deleted lock file could be locked twice)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("pid 4321 on host elsewhere")
    r = run_here("dino.py", *TINY, "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / ".lock").exists() and (out / "checkpoint.pth").exists()


def test_an_error_after_the_claim_releases_the_lock_and_removes_the_new_folder(tmp_path):
    out = tmp_path / "new"
    r = run_here("dino.py", *TINY, "--global_crops_scale", "0.9", "0.1", "--output_dir", str(out))
    one_line_error(r, "--global_crops_scale 0.9 0.1 is reversed")
    assert not out.exists()                          # created for the run, empty, removed


def test_the_lock_of_a_killed_run_is_taken_over_and_a_live_one_refused_in_process(tmp_path):
    """The lock is the kernel's (flock): held while its process lives, released however it dies
    (kill -9, a node failure on NFS: the server drops the dead client's locks), so no pid or host
    has to be checked; a lock this process already holds is its own (main() called twice)."""
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(SystemExit, match=f"in use by another run \\(pid {holder.pid} on host"):
            common.claim_output_dir(tmp_path, "dino.py")
    finally:
        holder.kill()
        holder.wait()
    common.claim_output_dir(tmp_path, "dino.py")             # the killed holder's lock is free
    common.claim_output_dir(tmp_path, "dino.py")             # again in the same process: its own
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on host")


def test_torchrun_ranks_refuse_together_and_torchrun_repeats_the_error(tmp_path):
    """Rank 0 alone takes the lock; every rank learns the outcome and stops (none waits forever in
    a collective). torchrun's closing report shows the error line as its root cause."""
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        r = run(*TORCHRUN, "dino.py", *TINY, "--output_dir", str(out), timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode != 0
    assert r.stderr.count("error: --output_dir") >= 2            # both ranks say it
    assert f"traceback : error: --output_dir {out} is in use" in r.stderr
    assert r.stderr.count("Traceback") == 1 and "ChildFailedError" in r.stderr     # torchrun's own, no worker's


# Runs a training script whose rank 0 finds the disk full when it writes a checkpoint.
FULL_DISK_ON_RANK_0 = """
import builtins, os, runpy, sys
sys.path.insert(0, os.getcwd())
import common
if os.environ.get("RANK", "0") == "0":
    writer = common.open_for_writing
    common.open_for_writing = lambda path, mode="w": (builtins.open("/dev/full", "wb")
                                                      if ".tmp" in str(path) else writer(path, mode))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_an_error_on_one_torchrun_rank_stops_the_others_in_one_line(tmp_path):
    """Rank 0 alone writes checkpoints; when it stops (here: a full disk), rank 1's next collective
    fails. Rank 1 says so in one line instead of gloo's traceback, and torchrun's report names
    rank 0's error as the root cause."""
    driver = tmp_path / "full_disk.py"
    driver.write_text(FULL_DISK_ON_RANK_0)
    r = run(*TORCHRUN, str(driver), "dino.py", *TINY, "--output_dir", str(tmp_path / "out"), timeout=120)
    assert r.returncode != 0
    rank0 = f"error: cannot write {tmp_path / 'out' / 'checkpoint.pth'}: No space left on device"
    assert rank0 in r.stderr and "error: process 1 stops because another process of this run has stopped" in r.stderr
    assert r.stderr.count("Traceback") == 1 and f"traceback : {rank0}" in r.stderr.split("Root Cause")[1]


@pytest.mark.parametrize("case", ["file", "too_long", "read_only", "empty"])
def test_unusable_output_dir_is_one_line(tmp_path, monkeypatch, case):
    if case == "empty":     # `--output_dir "$DIR"` with DIR unset: not the current folder
        target, expected = "", "--output_dir is empty; give a folder name"
        monkeypatch.chdir(tmp_path)
    elif case == "file":
        target = tmp_path / "taken"
        target.write_text("a file")
        expected = f"--output_dir {target} is a file, not a folder"
    elif case == "too_long":
        target, expected = tmp_path / ("x" * 300), "File name too long"
    else:   # root ignores permissions: the read-only disk is simulated where the lock is created
        target, expected = tmp_path / "ro", "Read-only file system"

        def read_only(path, flags, mode=0o777):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        monkeypatch.setattr(common.os, "open", read_only)
    with pytest.raises(SystemExit, match=expected):
        common.claim_output_dir(target, "dino.py")
    assert case != "empty" or not list(tmp_path.iterdir())


def test_output_dir_that_is_a_file_stops_a_training_run_in_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    one_line_error(run_here("dino.py", *TINY, "--output_dir", str(tmp_path / "taken")), "is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "a file"


# ------------------------------------------------------------------------------------------------
# 3. eval_linear.py writes nothing before its checks, and never into another script's run
# ------------------------------------------------------------------------------------------------
def test_eval_linear_refuses_a_training_folder_and_writes_nothing_on_failure(tmp_path):
    training = tmp_path / "dino_run"
    training.mkdir()
    (training / "checkpoint.pth").write_bytes(b"weights")
    (training / "args.json").write_text('{"script": "dino.py", "local_crops_number": 8}')
    data = ["--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "32"]
    r = run_here("eval_linear.py", *EVAL, *data, "--output_dir", str(training))
    one_line_error(r, f"--output_dir {training} holds a training run (checkpoint.pth)")
    (training / "checkpoint.pth").unlink()
    r = run_here("eval_linear.py", *EVAL, *data, "--output_dir", str(training))
    one_line_error(r, f"--output_dir {training} holds a run of dino.py: give eval_linear.py its own")
    assert '"dino.py"' in (training / "args.json").read_text() and not (training / "log.txt").exists()
    fresh = tmp_path / "probe"
    r = run_here("eval_linear.py", "--pretrained_weights", str(tmp_path / "missing.pth"), *data, "--output_dir",
                 str(fresh))
    one_line_error(r, "is not a file")
    assert not fresh.exists()


@pytest.mark.parametrize("script", ["dino.py", "esvit.py", "glsd.py", "selfpatch.py", "drloc.py"])
def test_training_refuses_a_linear_probes_folder(tmp_path, script):
    """The other way round: a training script overwrote the probe's args.json and appended to its
    log.txt. args.json records the script that wrote the folder."""
    probe = tmp_path / "linear"
    probe.mkdir()
    args_json = '{"script": "eval_linear.py", "n_last_blocks": 4}'
    for name, content in ("linear_checkpoint.pth", "probe"), ("args.json", args_json), ("log.txt", "{}\n"):
        (probe / name).write_text(content)
    r = run_here(script, "--output_dir", str(probe), "--dataset", "synthetic")
    one_line_error(r, f"--output_dir {probe} holds a run of eval_linear.py: give {script} its own")
    assert sorted(os.listdir(probe)) == [".lock", "args.json", "linear_checkpoint.pth", "log.txt"]
    assert (probe / "args.json").read_text() == args_json and (probe / "log.txt").read_text() == "{}\n"


@pytest.mark.parametrize("script", ["dino.py", "esvit.py", "glsd.py", "selfpatch.py", "drloc.py"])
@pytest.mark.parametrize("flags,expected", [
    (["--arch", "swin_pico3", "--patch_size", "8"], "swin_pico3 would ignore --patch_size (a ViT flag"),
    (["--arch", "vit_pico", "--fit_window", "true"], "vit_pico would ignore --window_size and --fit_window"),
    (["--arch", "vit_pico", "--window_size", "4"], "vit_pico would ignore --window_size and --fit_window")],
    ids=["swin_patch_size", "vit_fit_window", "vit_window_size"])
def test_a_backbone_flag_that_the_arch_ignores_is_refused(tmp_path, script, flags, expected):
    """Before: trained without it, yet args.json recorded it as if it had been used."""
    if script == "selfpatch.py" and flags[1].startswith("swin"):
        expected = "SelfPatch is implemented for ViT backbones only"        # its own check comes first
    r = run_here(script, *flags, "--output_dir", str(tmp_path / "run"), "--dataset", "synthetic")
    one_line_error(r, expected)
    run = tmp_path / "run"  # nothing written but the folder's lock (never deleted)
    assert not run.exists() or os.listdir(run) == [".lock"]


@pytest.mark.parametrize("flags,expected", [
    (["--arch", "swin_pico3"], "SelfPatch is implemented for ViT backbones only"),
    (["--global_crop_size", "32", "--local_crop_size", "16", "--patch_size", "8"], "--k_num 4 needs 1 to 3 positives on a 2x2")],
    ids=["swin", "local_grid_too_small"])
def test_selfpatch_refuses_its_backbone_and_k_num_before_any_work(tmp_path, flags, expected):
    """Before: refused after the data (here: missing) was read, a --k_num in the first step, leaving an args.json."""
    r = run_here("selfpatch.py", *flags, "--output_dir", str(tmp_path / "run"), "--data_path", str(tmp_path / "none"))
    one_line_error(r, expected)
    run = tmp_path / "run"  # nothing written but the folder's lock (never deleted)
    assert not run.exists() or os.listdir(run) == [".lock"]


@pytest.mark.parametrize("num_labels,classes,ok", [(1, ["a", "b"], False), (3, ["a", "b"], False), (2, ["a", "b"], True)])
def test_eval_linear_num_labels_must_match_the_classes(num_labels, classes, ok):
    import eval_linear
    dataset, args = Namespace(classes=classes), Namespace(num_labels=num_labels, dataset="folder")
    if ok:
        assert eval_linear.count_labels(dataset, args) == 2
    else:
        with pytest.raises(SystemExit, match=f"--num_labels {num_labels} does not match the 2 classes"):
            eval_linear.count_labels(dataset, args)
    with pytest.raises(SystemExit, match="--num_labels 3 is too few: the train split has label 3"):
        eval_linear.count_labels(Namespace(labels=[0, 3, 1]), Namespace(num_labels=3, dataset="svhn"))


# ------------------------------------------------------------------------------------------------
# 4. Resuming on another dataset
# ------------------------------------------------------------------------------------------------
def test_resume_on_another_dataset_is_refused_or_restarts_its_epoch(tmp_path, monkeypatch):
    big, small = image_folder(tmp_path / "big", ["a", "b"], per_class=16), image_folder(tmp_path / "small", ["a", "b"])
    out = tmp_path / "out"
    args = [*TINY, "--dataset", "folder", "--max_steps_per_epoch", "0", "--output_dir", str(out)]
    with monkeypatch.context() as patch:
        stop_at_check(patch, 2)                                  # stops after step 2 of 4, as a preempted run
        first = run_here("dino.py", *args, "--data_path", str(big))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"], ckpt["dataset"]["images"]) == (0, 2, 32)
    one_line_error(run_here("dino.py", *args, "--data_path", str(small)),
                   "was trained on another dataset (32 images, now 8)")
    r = run_here("dino.py", *args, "--data_path", str(small), "--allow_changed_args")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming on another dataset (32 images, now 8; --allow_changed_args): epoch 0 starts again" in r.stdout
    record = json.loads((out / "log.txt").read_text().splitlines()[-1])
    assert record["epoch"] == 0 and np.isfinite(record["loss"])                    # it trained (1 step of 8 images)
    assert torch.load(out / "checkpoint.pth", weights_only=True)["dataset"]["images"] == 8


def test_same_size_other_files_is_another_dataset_and_old_checkpoints_still_resume(tmp_path):
    one, two = image_folder(tmp_path / "one", ["a", "b"]), image_folder(tmp_path / "two", ["a", "c"])
    base = Namespace(dataset="folder", holdout=0, skip_bad_images=False)
    record_one = common.dataset_record(common.build_dataset(Namespace(**vars(base), data_path=str(one))))
    record_two = common.dataset_record(common.build_dataset(Namespace(**vars(base), data_path=str(two))))
    moved = shutil.copytree(one, tmp_path / "moved")             # the same data elsewhere: the same record
    record_moved = common.dataset_record(common.build_dataset(Namespace(**vars(base), data_path=str(moved))))
    assert record_one["images"] == record_two["images"] == 8
    assert record_one["fingerprint"] != record_two["fingerprint"] and record_one == record_moved
    dataset = common.build_dataset(Namespace(**vars(base), data_path=str(two)))
    args = Namespace(output_dir=str(tmp_path), allow_changed_args=False)
    with pytest.raises(SystemExit, match="8 images as now, but other files or labels"):
        common.check_resumed_dataset({"epoch": 1, "step": 3, "dataset": record_one}, dataset, args)
    old = {"epoch": 1, "step": 3}
    common.check_resumed_dataset(old, dataset, args)       # no record: as before
    assert common.resume_position(old, tmp_path) == (1, 3)


# ------------------------------------------------------------------------------------------------
# 5. A symbolic link loop in an image folder
# ------------------------------------------------------------------------------------------------
def test_symlink_loop_in_an_image_folder_is_refused_naming_the_link(tmp_path):
    image_folder(tmp_path / "data", ["a", "b"])
    (tmp_path / "data" / "a" / "up").symlink_to("..")
    with pytest.raises(SystemExit, match=f"{tmp_path / 'data' / 'a' / 'up'} leads to {tmp_path / 'data'}, a folder already read"):
        common.ImageFolderSafe(str(tmp_path / "data"))


# ------------------------------------------------------------------------------------------------
# Tracebacks turned into one line
# ------------------------------------------------------------------------------------------------
def test_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pth"
    common.save_checkpoint({"epoch": 1}, path)
    monkeypatch.setattr(common, "open_for_writing", lambda *a, **k: open("/dev/full", "wb"))  # ENOSPC
    with pytest.raises(SystemExit, match=f"cannot write {path}: No space left on device \\(the previous checkpoint.pth is kept\\)"):
        common.save_checkpoint({"epoch": 2, "weights": torch.zeros(100_000)}, path)
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_reversed_crop_scales_are_refused_at_start_up():
    import dino
    for flag in ("--global_crops_scale", "--local_crops_scale"):
        args = dino.get_args_parser().parse_args([flag, "0.5", "0.2"])
        with pytest.raises(SystemExit, match=f"{flag} 0.5 0.2 is reversed"):
            common.check_start_args(args)
    common.check_start_args(dino.get_args_parser().parse_args(["--local_crops_number", "0", "--local_crops_scale", "0.5", "0.2"]))


def test_eval_crop_larger_than_resize_is_refused():
    with pytest.raises(SystemExit, match="--crop 32 is larger than --resize 16"):
        common.eval_transform(16, 32)


def test_dump_features_naming_a_file_is_refused_before_extracting(tmp_path):
    (tmp_path / "feats").write_text("a file")
    r = run_here("eval_knn.py", *EVAL, "--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size",
                 "32", "--dump_features", str(tmp_path / "feats"))
    one_line_error(r, f"--dump_features {tmp_path / 'feats'} is a file, not a folder")
    assert "data:" not in r.stdout                                 # refused before any image was read


def test_save_pictures_naming_a_file_is_one_line(tmp_path):
    """A real process: extras/tools/eval_correspondence.py's one-line error on stderr, exit status 1."""
    (tmp_path / "pics").write_text("a file")
    r = run("extras/tools/eval_correspondence.py", "--random_init", "--arch", "vit_pico", "--dataset", "synthetic",
            "--synthetic_image_size", "32", "--crop_size", "32", "--device", "cpu", "--num_workers", "0",
            "--save_pictures", str(tmp_path / "pics"))
    one_line_error(r, f"--save_pictures {tmp_path / 'pics'} is a file, not a folder")
    assert r.returncode == 1


def test_ctrl_c_names_the_last_checkpoint_without_a_traceback(tmp_path):
    args = [*TINY, "--epochs", "50", "--max_steps_per_epoch", "0", "--output_dir", str(tmp_path)]
    # A shell without job control starts background commands with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: give the child the default disposition a terminal gives.
    proc = subprocess.Popen([sys.executable, "dino.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (tmp_path / "checkpoint.pth").exists() and time.time() < deadline:   # after the first epoch
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted (Ctrl-C): the last checkpoint is {tmp_path / 'checkpoint.pth'}"), last
    assert "run the same command again to resume" in last


def test_nonfinite_loss_error_is_the_last_line(tmp_path):
    r = run_here("dino.py", *TINY, "--max_steps_per_epoch", "2", "--lr", "1e30", "--clip_grad", "0", "--warmup_epochs",
                 "0", "--optimizer", "sgd", "--output_dir", str(tmp_path), merge=True)     # as 2>&1: bars and lines
    assert r.returncode == 1
    lines = [line for line in r.stdout.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-2].startswith("error: the loss is") and lines[-1].startswith("Likely causes:"), lines[-3:]
