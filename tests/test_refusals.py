"""Bad input is refused in one line: the last line of stderr starts with `error:` (or is
argparse's `argument ...`), the exit status is not 0, no traceback is printed, and nothing is
written that a later run would trust. The sections follow the tables of docs/ERRORS.md, in their
order; a test of a refusal also checks its other side where the two share a row (the same command
with --skip_bad_images or --allow_changed_args). Runs are in process (`run_here`, or a script's
main()) on tiny data (CPU), except where the behaviour is the process's (torchrun, loader
workers, the line on stderr)."""
import errno
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (ROOT, ENV, TORCHRUN, TINY, EVAL, TINY_SMALL_HEAD, DRLOC_TINY, tiny,
                      DINO_TINY, FOLDER_ARGS, on_folder, run, run_here, start, finish, parse,
                      train_tiny, stop_at_check, hold_lock, last_line, one_line_error,
                      image_folder, make_folder, break_images, save_features, load)
import checks
import common
import dino
import drloc
import esvit
import eval_knn
import eval_linear
import glsd
import selfpatch
sys.path.append(str(ROOT / "extras" / "tools"))
import eval_correspondence  # noqa: E402
import teacher_outputs  # noqa: E402
import visualize  # noqa: E402


# ================================================================================================
# Table 1 of docs/ERRORS.md: resumed runs, checkpoints, images, crops and numeric arguments
# ================================================================================================

def test_resume_with_changed_arguments_refuses_naming_each_difference(dino_uninterrupted, tmp_path):
    refused, out = tmp_path / "refused", tmp_path / "out"
    for folder in (refused, out):
        folder.mkdir()
        shutil.copy(dino_uninterrupted / "checkpoint.pth", folder / "checkpoint.pth")
    # a real process: dino.py's one-line error reaches stderr, with exit status 1 (it runs while the
    # in-process runs below go on in another copy of the run)
    proc = start("dino.py", *DINO_TINY, "--lr", "0.001", "--local_crops_number", "4",
                 "--output_dir", str(refused))
    # extending --epochs is allowed, and so is a change of where the run happens
    r = run_here("dino.py", *tiny(epochs="3", num_workers="1"), "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--epochs changed from 2 to 3" in r.stdout and load(out / "checkpoint.pth")["epoch"] == 3
    assert '"epochs": 3' in (out / "args.json").read_text()
    r = run_here("dino.py", *tiny(epochs="2"), "--output_dir", str(out))
    assert r.returncode == 1 and "already trained 3 epochs, more than --epochs 2" in last_line(r)
    r = finish(proc)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = last_line(r)
    assert "trained with other arguments" in line and "--allow_changed_args" in line
    assert "--lr 0.0005 (now 0.001)" in line and "--local_crops_number 2 (now 4)" in line
    assert not (refused / "args.json").exists()          # written only once every check passed


def test_default_output_dir_is_per_method_and_another_methods_checkpoint_is_named(
        dino_uninterrupted, tmp_path):
    import dino
    import drloc
    import esvit
    assert dino.get_args_parser().parse_args([]).output_dir == "runs/dino"
    assert esvit.get_args_parser().parse_args([]).output_dir == "runs/esvit"
    assert drloc.get_args_parser().parse_args([]).output_dir == "runs/drloc"
    shutil.copy(dino_uninterrupted / "checkpoint.pth", tmp_path / "checkpoint.pth")
    # a real process: status 1, the line on stderr
    r = run("esvit.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'checkpoint.pth'} was written by dino.py, not esvit.py" in last_line(r)


@pytest.mark.parametrize("case,expected", [
    ("missing", "does not exist"),
    ("empty", "no images in"),
    ("arch", "invalid choice: 'vit_huge'"),
    ("other_arch_checkpoint", "--arch vit_pico (now vit_tiny)"),
    ("other_arch_checkpoint_allowed", "does not match the checkpoint"),
])
def test_user_mistakes_give_one_line_errors(dino_uninterrupted, tmp_path, case, expected):
    args = [*FOLDER_ARGS, "--output_dir", str(tmp_path / "out")]
    if case == "missing":
        args += ["--data_path", str(tmp_path / "nowhere")]
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        args += ["--data_path", str(tmp_path / "empty")]
    elif case == "arch":
        args = ["--arch", "vit_huge", *args]
    else:   # the run's checkpoint, resumed with another --arch
        (tmp_path / "out").mkdir()
        shutil.copy(dino_uninterrupted / "checkpoint.pth", tmp_path / "out" / "checkpoint.pth")
        args = [*DINO_TINY, "--output_dir", str(tmp_path / "out"), "--arch", "vit_tiny"]
        args += ["--allow_changed_args"] if case.endswith("allowed") else []
    r = run_here("dino.py", *args)
    assert r.returncode == (2 if case == "arch" else 1)       # argparse's status, die()'s
    assert "Traceback" not in r.stderr
    assert expected in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("damage", ["empty", "truncated", "image", "folder"])
def test_empty_or_truncated_checkpoint_is_named(dino_uninterrupted, tmp_path, damage):
    data = (dino_uninterrupted / "checkpoint.pth").read_bytes()
    # torch's own error would advise `weights_only=False`: wrong advice for a picture
    if damage == "image":
        Image.new("RGB", (8, 8)).save(tmp_path / "checkpoint.pth", format="PNG")
    elif damage == "folder":
        (tmp_path / "checkpoint.pth").mkdir()
    else:
        (tmp_path / "checkpoint.pth").write_bytes(b"" if damage == "empty"
                                                  else data[: len(data) // 2])
    r = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = last_line(r)
    named = "" if damage == "folder" else "checkpoint "  # a folder: refused with the folder's files
    assert line.startswith(f"error: {named}{tmp_path / 'checkpoint.pth'}")
    assert {"empty": "is empty (0 bytes", "truncated": "truncated",
            "image": "is not a PyTorch file", "folder": "is not a regular file"}[damage] in line
    assert "weights_only" not in line and ("(truncated?)" in line) == (damage == "truncated")
    assert line.rstrip().split(":")[-1].strip()            # a reason, never a blank one


EVAL_FOLDER = ["--random_init", "--arch", "vit_pico", "--dataset", "folder", "--resize", "32",
               "--crop", "32", "--batch_size_per_gpu", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def eval_folder(tmp_path_factory):
    """train/: 17 readable images; val/: the same 17 and one truncated JPEG."""
    root = tmp_path_factory.mktemp("eval_data")
    make_folder(root / "train", bad=False)
    make_folder(root / "val", bad=True)
    return root


def test_eval_linear_drops_unreadable_images_and_refuses_a_probe_of_other_weights(eval_folder,
                                                                                  tmp_path):
    args = [*EVAL_FOLDER, "--data_path", str(eval_folder), "--num_workers", "0",
            "--skip_bad_images", "--max_steps_per_epoch", "1", "--output_dir", str(tmp_path)]
    r = run_here("eval_linear.py", *args, "--epochs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "log.txt").read_text().splitlines()[-1])
    assert (record["val_images"], record["val_skipped_images"]) == (17, 1)
    # the same folder, other weights (another random initialisation): the old probe is not reported
    r = run_here("eval_linear.py", *args, "--epochs", "2", "--seed", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "holds a linear probe trained on other weights" in last_line(r)
    r = run_here("eval_linear.py", *args, "--epochs", "2")           # the same weights: resumed
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout


@pytest.mark.parametrize("workers", ["0", "2"])
def test_truncated_image_is_named_or_skipped(tmp_path, workers):
    """With loader workers, both runs are real processes (at once): the error and the warning come
    from a worker."""
    make_folder(tmp_path / "data")
    base = [*FOLDER_ARGS, "--data_path", str(tmp_path / "data"), "--num_workers", workers]
    if workers == "0":
        r = run_here("dino.py", *base, "--output_dir", str(tmp_path / "out1"))
        skipped = run_here("dino.py", *base, "--skip_bad_images", "--output_dir",
                           str(tmp_path / "out2"))
    else:
        stopped = start("dino.py", *base, "--output_dir", str(tmp_path / "out1"))
        skipped = run("dino.py", *base, "--skip_bad_images", "--output_dir", str(tmp_path / "out2"))
        r = finish(stopped)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert (last.startswith("error: cannot read image") and "truncated.jpg" in last
            and "--skip_bad_images" in last)
    r = skipped
    assert r.returncode == 0, r.stderr[-3000:]
    assert "truncated.jpg" in r.stderr
    assert '"skipped_images": 1' in (tmp_path / "out2" / "log.txt").read_text()


def test_eval_unreadable_image_is_one_line(eval_folder, tmp_path):
    """Both evaluation scripts as real processes (at once) with a loader worker: the worker's error
    reaches stderr as one line, with exit status 1."""
    procs = {script: start(script, *EVAL_FOLDER, "--data_path", str(eval_folder),
                           "--num_workers", "1", *extra)
             for script, extra in (("eval_knn.py", ["--nb_knn", "5"]),
                                   ("eval_linear.py",
                                    ["--epochs", "1", "--output_dir", str(tmp_path)]))}
    for script, proc in procs.items():
        r = finish(proc)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (script, r.stderr[-3000:])
        line = last_line(r)
        assert (line.startswith("error: cannot read image") and "truncated.jpg" in line
                and "--skip_bad_images" in line), (script, line)


def test_eval_knn_drops_unreadable_images_with_their_labels(eval_folder):
    r = run_here("eval_knn.py", *EVAL_FOLDER, "--data_path", str(eval_folder), "--num_workers", "0",
                 "--nb_knn", "5", "--skip_bad_images")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 unreadable images" in r.stdout and "truncated.jpg" in r.stderr
    # not 18: no neighbour stands in for it
    assert "k-NN over 17 train and 17 test images" in r.stdout


def test_crop_size_rule_is_checked_at_start_up_by_every_self_supervised_script(tmp_path):
    import dino
    import esvit
    import selfpatch
    for module, arch in ((dino, "swin_pico"), (esvit, "swin_pico"), (selfpatch, "vit_small")):
        bad = module.get_args_parser().parse_args(["--arch", arch, "--local_crop_size", "40"])
        with pytest.raises(SystemExit, match="--local_crop_size 40 is not a multiple"):
            checks.check_start_args(bad)
    r = run_here("dino.py", *tiny(global_crop_size="36"), "--output_dir", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert ("--global_crop_size 36 is not a multiple of the vit_pico token stride (16 px)"
            in last_line(r))
    assert not (tmp_path / "args.json").exists()


@pytest.mark.parametrize("script", ["eval_knn.py", "eval_linear.py"])
def test_eval_crop_that_is_not_a_multiple_of_the_patch_is_one_line(script, tmp_path):
    extra = ["--output_dir", str(tmp_path)] if script == "eval_linear.py" else []
    r = run_here(script, "--random_init", "--arch", "vit_pico", "--dataset", "synthetic",
                 "--resize", "36", "--crop", "36", "--device", "cpu", *extra)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert ("--crop 36 is not a multiple of the vit_pico patch size (16 px); use e.g. 32"
            in last_line(r))


@pytest.mark.parametrize("script,flag,value", [
    ("dino", "--epochs", "0"), ("dino", "--out_dim", "1"), ("selfpatch", "--patch_out_dim", "1"),
    ("dino", "--momentum_teacher", "2"), ("dino", "--lr", "-1"), ("dino", "--lr", "inf"),
    ("glsd", "--teacher_temp", "inf"), ("dino", "--local_crops_number", "-2"),
    ("dino", "--global_crops_scale", "0"), ("dino", "--teacher_temp", "0"),
    ("esvit", "--batch_size_per_gpu", "0"), ("glsd", "--warmup_epochs", "-1"),
    ("selfpatch", "--k_num", "0"), ("drloc", "--smoothing", "1.5"),
    ("drloc", "--input_size", "nan"), ("eval_knn", "--temperature", "0"),
    ("eval_knn", "--nb_knn", "0"), ("eval_linear", "--n_last_blocks", "0"),
    ("eval_linear", "--epochs", "-3"),
])
def test_numeric_arguments_out_of_range_are_refused_at_parse_time(capsys, script, flag, value):
    import importlib
    parser = importlib.import_module(script).get_args_parser()
    values = [value, value] if flag.endswith("crops_scale") else [value]
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([flag, *values])
    assert exit_info.value.code != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in last and ("out of range" in last or "expected" in last)


def test_more_neighbours_than_train_images_is_refused(tmp_path):
    r = run_here("eval_knn.py", "--random_init", "--arch", "vit_pico", "--dataset", "synthetic",
                 "--synthetic_images", "16", "--synthetic_image_size", "32", "--resize", "32",
                 "--crop", "32", "--num_workers", "0", "--device", "cpu", "--nb_knn", "10", "200")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--nb_knn 200 is more than the 16 train images" in last_line(r)


def test_selfpatch_teacher_backbone_alone_is_a_one_line_mismatch(tmp_path):
    """SelfPatch's backbone has no CLS token and no final norm: its image token needs the
    aggregation module of checkpoint.pth."""
    import common
    import eval_knn
    backbone = common.build_backbone("vit_pico", class_token=False, final_norm=False)
    torch.save(backbone.state_dict(), tmp_path / "teacher_backbone.pth")
    with pytest.raises(SystemExit,
                       match=r"does not match the checkpoint.*missing: \[cls_token, norm.weight"):
        eval_knn.load_backbone(str(tmp_path / "teacher_backbone.pth"), arch="vit_pico")


# ================================================================================================
# Table 2 of docs/ERRORS.md: folders, datasets and evaluation splits
# ================================================================================================

def test_a_folder_in_use_by_a_live_run_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        r = run_here("dino.py", *TINY, "--output_dir", str(out))
        one_line_error(r, f"--output_dir {out} is in use by another run (pid {holder.pid} on host "
                          f"{socket.gethostname()};")
        # nothing written, lock kept
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()


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
    # torchrun's own, no worker's
    assert r.stderr.count("Traceback") == 1 and "ChildFailedError" in r.stderr


def test_output_dir_that_is_a_file_stops_a_training_run_in_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    one_line_error(run_here("dino.py", *TINY, "--output_dir", str(tmp_path / "taken")),
                   "is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "a file"


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
        checks.claim_output_dir(target, "dino.py")
    assert case != "empty" or not list(tmp_path.iterdir())


def test_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_old_checkpoint(tmp_path,
                                                                                      monkeypatch):
    path = tmp_path / "checkpoint.pth"
    common.save_checkpoint({"epoch": 1}, path)
    # ENOSPC on write
    monkeypatch.setattr(common, "open_for_writing", lambda *a, **k: open("/dev/full", "wb"))
    with pytest.raises(SystemExit, match=f"cannot write {path}: No space left on device \\(the "
                                         f"previous checkpoint.pth is kept\\)"):
        common.save_checkpoint({"epoch": 2, "weights": torch.zeros(100_000)}, path)
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_resume_on_another_dataset_is_refused_or_restarts_its_epoch(tmp_path, monkeypatch):
    big, small = image_folder(tmp_path / "big", ["a", "b"],
                              per_class=16), image_folder(tmp_path / "small", ["a", "b"])
    out = tmp_path / "out"
    args = [*TINY, "--dataset", "folder", "--max_steps_per_epoch", "0", "--output_dir", str(out)]
    with monkeypatch.context() as patch:
        # stops after step 2 of 4, as a preempted run
        stop_at_check(patch, 2)
        first = run_here("dino.py", *args, "--data_path", str(big))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"], ckpt["dataset"]["images"]) == (0, 2, 32)
    one_line_error(run_here("dino.py", *args, "--data_path", str(small)),
                   "was trained on another dataset (32 images, now 8)")
    r = run_here("dino.py", *args, "--data_path", str(small), "--allow_changed_args")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("resuming on another dataset (32 images, now 8; --allow_changed_args): epoch 0 starts "
            "again" in r.stdout)
    record = json.loads((out / "log.txt").read_text().splitlines()[-1])
    # it trained (1 step of 8 images)
    assert record["epoch"] == 0 and np.isfinite(record["loss"])
    assert torch.load(out / "checkpoint.pth", weights_only=True)["dataset"]["images"] == 8


def test_same_size_other_files_is_another_dataset_and_old_checkpoints_still_resume(tmp_path):
    one, two = image_folder(tmp_path / "one", ["a", "b"]), image_folder(tmp_path / "two", ["a",
                                                                                           "c"])
    base = Namespace(dataset="folder", holdout=0, skip_bad_images=False)
    record_one = common.dataset_record(common.build_dataset(Namespace(**vars(base),
                                                                      data_path=str(one))))
    record_two = common.dataset_record(common.build_dataset(Namespace(**vars(base),
                                                                      data_path=str(two))))
    # the same data elsewhere: the same record
    moved = shutil.copytree(one, tmp_path / "moved")
    record_moved = common.dataset_record(common.build_dataset(Namespace(**vars(base),
                                                                        data_path=str(moved))))
    assert record_one["images"] == record_two["images"] == 8
    assert record_one["fingerprint"] != record_two["fingerprint"] and record_one == record_moved
    dataset = common.build_dataset(Namespace(**vars(base), data_path=str(two)))
    args = Namespace(output_dir=str(tmp_path), allow_changed_args=False)
    with pytest.raises(SystemExit, match="8 images as now, but other files or labels"):
        checks.check_resumed_dataset({"epoch": 1, "step": 3, "dataset": record_one}, dataset, args)
    old = {"epoch": 1, "step": 3}
    checks.check_resumed_dataset(old, dataset, args)       # no record: as before
    assert common.resume_position(old, tmp_path) == (1, 3)


def test_symlink_loop_in_an_image_folder_is_refused_naming_the_link(tmp_path):
    image_folder(tmp_path / "data", ["a", "b"])
    (tmp_path / "data" / "a" / "up").symlink_to("..")
    with pytest.raises(SystemExit, match=f"{tmp_path / 'data' / 'a' / 'up'} leads to "
                                         f"{tmp_path / 'data'}, a folder already read"):
        checks.check_data_path(Namespace(dataset="folder", data_path=str(tmp_path / "data")))


def test_val_classes_are_numbered_by_name_as_in_train(tmp_path):
    image_folder(tmp_path / "train", ["a", "b", "c"])
    (tmp_path / "val").mkdir()
    shutil.copytree(tmp_path / "train" / "c", tmp_path / "val" / "c")     # val/ holds class c only
    args = Namespace(dataset="folder", data_path=str(tmp_path), holdout=0, skip_bad_images=False)
    train, val = common.build_eval_splits(args)
    # not 0: c is train's class 2
    assert [label for _, label in val.samples] == [2] * 4 and val.targets == [2] * 4
    assert val.classes == train.classes and val[0][1] == 2
    (tmp_path / "val" / "z").mkdir()
    shutil.copy(tmp_path / "train" / "a" / "0.png", tmp_path / "val" / "z" / "0.png")
    with pytest.raises(SystemExit, match="classes that the train split does not have: z"):
        common.build_eval_splits(args)


def test_an_evaluation_on_a_train_split_of_one_class_is_refused(tmp_path):
    """An unlabelled layout (train/images/*.png) trains a self-supervised method, but every
    classifier scores 100% on it: evaluating it is refused, not published as a perfect score."""
    image_folder(tmp_path / "train", ["images"])
    shutil.copytree(tmp_path / "train", tmp_path / "val")
    args = Namespace(dataset="folder", data_path=str(tmp_path), holdout=0, skip_bad_images=False)
    assert len(common.build_dataset(args)) == 4                     # training reads it
    with pytest.raises(SystemExit,
                       match="the train split has one class \\(images\\): any classifier "
                             "scores 100%"):
        common.build_eval_splits(args)


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
    one_line_error(r,
                   f"--output_dir {training} holds a run of dino.py: give eval_linear.py its own")
    assert '"dino.py"' in (training / "args.json").read_text()
    assert not (training / "log.txt").exists()
    fresh = tmp_path / "probe"
    r = run_here("eval_linear.py", "--pretrained_weights", str(tmp_path / "missing.pth"), *data,
                 "--output_dir", str(fresh))
    one_line_error(r, "is not a file")
    assert not fresh.exists()


@pytest.mark.parametrize("script", ["dino.py", "esvit.py", "glsd.py", "selfpatch.py", "drloc.py"])
def test_training_refuses_a_linear_probes_folder(tmp_path, script):
    """The other way round: a training script overwrote the probe's args.json and appended to its
    log.txt. args.json records the script that wrote the folder."""
    probe = tmp_path / "linear"
    probe.mkdir()
    args_json = '{"script": "eval_linear.py", "n_last_blocks": 4}'
    for name, content in ("linear_checkpoint.pth", "probe"), ("args.json", args_json), ("log.txt",
                                                                                        "{}\n"):
        (probe / name).write_text(content)
    r = run_here(script, "--output_dir", str(probe), "--dataset", "synthetic")
    one_line_error(r, f"--output_dir {probe} holds a run of eval_linear.py: give {script} its own")
    assert sorted(os.listdir(probe)) == [".lock", "args.json", "linear_checkpoint.pth", "log.txt"]
    assert (probe / "args.json").read_text() == args_json
    assert (probe / "log.txt").read_text() == "{}\n"


@pytest.mark.parametrize("script", ["dino.py", "esvit.py", "glsd.py", "selfpatch.py", "drloc.py"])
@pytest.mark.parametrize("flags,expected", [
    (["--arch", "swin_pico3", "--patch_size", "8"],
     "swin_pico3 would ignore --patch_size (a ViT flag"),
    (["--arch", "vit_pico", "--fit_window", "true"],
     "vit_pico would ignore --window_size and --fit_window"),
    (["--arch", "vit_pico", "--window_size", "4"],
     "vit_pico would ignore --window_size and --fit_window")],
    ids=["swin_patch_size", "vit_fit_window", "vit_window_size"])
def test_a_backbone_flag_that_the_arch_ignores_is_refused(tmp_path, script, flags, expected):
    """Before: trained without it, yet args.json recorded it as if it had been used."""
    if script == "selfpatch.py" and flags[1].startswith("swin"):
        # its own check comes first
        expected = "SelfPatch is implemented for ViT backbones only"
    r = run_here(script, *flags, "--output_dir", str(tmp_path / "run"), "--dataset", "synthetic")
    one_line_error(r, expected)
    run = tmp_path / "run"  # nothing written but the folder's lock (never deleted)
    assert not run.exists() or os.listdir(run) == [".lock"]


@pytest.mark.parametrize("flags,expected", [
    (["--arch", "swin_pico3"], "SelfPatch is implemented for ViT backbones only"),
    (["--global_crop_size", "32", "--local_crop_size", "16", "--patch_size", "8"],
     "--k_num 4 needs 1 to 3 positives on a 2x2")],
    ids=["swin", "local_grid_too_small"])
def test_selfpatch_refuses_its_backbone_and_k_num_before_any_work(tmp_path, flags, expected):
    """Before: refused after the data (here: missing) was read, a --k_num in the first step,
    leaving an args.json."""
    r = run_here("selfpatch.py", *flags, "--output_dir", str(tmp_path / "run"), "--data_path",
                 str(tmp_path / "none"))
    one_line_error(r, expected)
    run = tmp_path / "run"  # nothing written but the folder's lock (never deleted)
    assert not run.exists() or os.listdir(run) == [".lock"]


def test_an_error_after_the_claim_releases_the_lock_and_removes_the_new_folder(tmp_path):
    out = tmp_path / "new"
    r = run_here("dino.py", *TINY, "--global_crops_scale", "0.9", "0.1", "--output_dir", str(out))
    one_line_error(r, "--global_crops_scale 0.9 0.1 is reversed")
    assert not out.exists()                          # created for the run, empty, removed


@pytest.mark.parametrize("num_labels,classes,ok", [(1, ["a", "b"], False), (3, ["a", "b"], False),
                                                   (2, ["a", "b"], True)])
def test_eval_linear_num_labels_must_match_the_classes(num_labels, classes, ok):
    import eval_linear
    dataset, args = Namespace(classes=classes), Namespace(num_labels=num_labels, dataset="folder")
    if ok:
        assert eval_linear.count_labels(dataset, args) == 2
    else:
        with pytest.raises(SystemExit,
                           match=f"--num_labels {num_labels} does not match the 2 classes"):
            eval_linear.count_labels(dataset, args)
    with pytest.raises(SystemExit, match="--num_labels 3 is too few: the train split has label 3"):
        eval_linear.count_labels(Namespace(labels=[0, 3, 1]), Namespace(num_labels=3,
                                                                        dataset="svhn"))


def test_reversed_crop_scales_are_refused_at_start_up():
    import dino
    for flag in ("--global_crops_scale", "--local_crops_scale"):
        args = dino.get_args_parser().parse_args([flag, "0.5", "0.2"])
        with pytest.raises(SystemExit, match=f"{flag} 0.5 0.2 is reversed"):
            checks.check_start_args(args)
    no_local_crops = ["--local_crops_number", "0", "--local_crops_scale", "0.5", "0.2"]
    checks.check_start_args(dino.get_args_parser().parse_args(no_local_crops))


def test_dump_features_naming_a_file_is_refused_before_extracting(tmp_path):
    (tmp_path / "feats").write_text("a file")
    r = run_here("eval_knn.py", *EVAL, "--dataset", "synthetic", "--synthetic_images", "16",
                 "--synthetic_image_size", "32", "--dump_features", str(tmp_path / "feats"))
    one_line_error(r, f"--dump_features {tmp_path / 'feats'} is a file, not a folder")
    # refused before any image was read
    assert "data:" not in r.stdout


def test_eval_knn_dump_features_on_a_full_disk_is_one_line_and_leaves_no_part(tmp_path,
                                                                              monkeypatch):
    """A part would be refused by the next --dump_features (never overwritten) and --load_features
    (incomplete)."""
    opened = []

    writer = common.open_for_writing

    def open_until_the_disk_is_full(path, mode="w"):
        opened.append(path)
        # ENOSPC from the third file on
        return open("/dev/full", mode) if len(opened) > 2 else writer(path, mode)
    monkeypatch.setattr(common, "open_for_writing", open_until_the_disk_is_full)
    tensors = (torch.eye(2), torch.tensor([0, 1]), torch.eye(2), torch.tensor([0, 1]))
    with pytest.raises(SystemExit,
                       match=f"cannot write {tmp_path / 'testfeat.pth'}: No space left on device"):
        eval_knn.dump_features(tmp_path, tensors)
    assert len(opened) == 3 and not list(tmp_path.iterdir())
    monkeypatch.undo()
    # the same command again: allowed, and it writes all four
    eval_knn.check_dump_folder(tmp_path)
    eval_knn.dump_features(tmp_path, tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(eval_knn.FEATURE_FILES)


def test_save_pictures_naming_a_file_is_one_line(tmp_path):
    """A real process: extras/tools/eval_correspondence.py's one-line error on stderr, exit status 1."""
    (tmp_path / "pics").write_text("a file")
    r = run("extras/tools/eval_correspondence.py", "--random_init", "--arch", "vit_pico", "--dataset",
            "synthetic", "--synthetic_image_size", "32", "--crop_size", "32", "--device", "cpu",
            "--num_workers", "0", "--save_pictures", str(tmp_path / "pics"))
    one_line_error(r, f"--save_pictures {tmp_path / 'pics'} is a file, not a folder")
    assert r.returncode == 1


def test_eval_crop_larger_than_resize_is_refused():
    with pytest.raises(SystemExit, match="--crop 32 is larger than --resize 16"):
        common.eval_transform(16, 32)


# ================================================================================================
# Table 3 of docs/ERRORS.md: the output folder's files
# ================================================================================================

@pytest.mark.parametrize("name", [".lock", "args.json", "log.txt"])
def test_a_link_planted_in_the_output_folder_is_refused_and_its_target_untouched(tmp_path, name):
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(precious)
    with pytest.raises(SystemExit, match=f"{out / name}.*symbolic link"):
        train_tiny(out)
    assert precious.read_text() == "keep me" and (out / name).is_symlink()


def test_a_file_of_the_output_folder_that_cannot_be_written_is_one_line(tmp_path):
    out = tmp_path / "out"
    (out / "args.json").mkdir(parents=True)  # (as root, a read-only file would still be written)
    with pytest.raises(SystemExit, match=r"^error: .*args.json is not a regular file"):
        common.run_script(dino.main, dino.get_args_parser(), [*TINY_SMALL_HEAD, "--output_dir",
                                                              str(out)])


def test_a_failed_checkpoint_write_on_a_read_only_folder_is_its_own_line(tmp_path, monkeypatch):
    """The writer's clean-up of its temporary file fails too on a read-only file system: the
    line says why the checkpoint was not written, not why the clean-up failed."""
    def read_only(self, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(self))
    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(common.os, "replace", read_only)
    with pytest.raises(SystemExit, match=r"cannot write .*checkpoint.pth: Read-only file system"):
        common.save_checkpoint({"a": 1}, tmp_path / "checkpoint.pth")


# ================================================================================================
# Table 4 of docs/ERRORS.md: a result is true or it is an error
# ================================================================================================

SYNTHETIC_EVAL = [*EVAL, "--dataset", "synthetic", "--synthetic_images", "16",
                  "--synthetic_image_size", "32"]


def error_line(result):
    """die()'s line, last on stderr, with no traceback above it."""
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_a_mid_epoch_checkpoint_past_the_lowered_epochs_is_refused(tmp_path):
    args = parse(dino, ["--epochs", "1", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit,
                       match="has already trained 1 epochs and 2 steps, more than --epochs 1"):
        checks.check_resumed_args({"epoch": 1, "step": 2, "args": vars(args), "method": "dino"},
                                  args, "dino")


def test_resuming_with_another_number_of_processes_is_refused(tmp_path, monkeypatch, capsys):
    flags = [*TINY, "--output_dir", str(tmp_path)]
    dino.main(parse(dino, flags))
    monkeypatch.setattr(common, "get_world_size", lambda: 2)
    capsys.readouterr()
    with pytest.raises(SystemExit,
                       match="trained with other arguments: 1 process \\(now 2: another total "
                             "batch"):
        dino.main(parse(dino, [*flags, "--epochs", "2"]))
    assert "data:" not in capsys.readouterr().out


def test_eval_linear_refuses_to_resume_another_setup(tmp_path, monkeypatch):
    out = tmp_path / "probe"
    probe = [*SYNTHETIC_EVAL, "--precomputed_features", "true", "--output_dir", str(out)]
    eval_linear.main(parse(eval_linear, [*probe, "--epochs", "1"]))
    log = (out / "log.txt").read_text()
    for change, expected in ((["--lr", "0.01"], "--lr 0.001 \\(now 0.01\\)"),
                             (["--resize", "48"], "--resize 32 \\(now 48\\)"),
                             (["--synthetic_seed", "1"], "--synthetic_seed 0 \\(now 1\\)"),
                             (["--batch_size_per_gpu", "2"], "--batch_size_per_gpu 4 \\(now 2\\)")):
        with pytest.raises(SystemExit, match=f"{out / 'linear_checkpoint.pth'} holds a probe "
                                             f"trained with other arguments: {expected}"):
            eval_linear.main(parse(eval_linear, [*probe, "--epochs", "2", *change]))
    with monkeypatch.context() as patched:
        patched.setattr(common, "get_world_size", lambda: 2)
        with pytest.raises(SystemExit, match="1 process \\(now 2: another total batch"):
            eval_linear.main(parse(eval_linear, [*probe, "--epochs", "2"]))
    # nothing written by the refused runs
    assert (out / "log.txt").read_text() == log
    eval_linear.main(parse(eval_linear, [*probe, "--epochs", "2", "--val_freq", "5",
                                         "--num_workers", "1"]))
    with pytest.raises(SystemExit, match="has already trained 2 epochs, more than --epochs 1"):
        eval_linear.main(parse(eval_linear, [*probe, "--epochs", "1"]))


def test_eval_linear_refuses_to_resume_on_other_data(tmp_path):
    one, two = (image_folder(tmp_path / "one", ["a", "b"]),
                image_folder(tmp_path / "two", ["a", "b"], seed=1))
    for split in ("train", "val"):
        image_folder(one / split, ["a", "b"])
    image_folder(two / "train", ["a", "b"])
    image_folder(two / "val", ["a", "b"], per_class=3)
    probe = [*EVAL, "--dataset", "folder", "--precomputed_features", "true", "--output_dir",
             str(tmp_path / "probe")]
    eval_linear.main(parse(eval_linear, [*probe, "--data_path", str(one), "--epochs", "1"]))
    with pytest.raises(SystemExit,
                       match="was trained on another validation split \\(8 images, now 6\\)"):
        eval_linear.main(parse(eval_linear, [*probe, "--data_path", str(two), "--epochs", "2"]))


@pytest.mark.parametrize("script", [dino, esvit, glsd, selfpatch])
def test_a_warmup_longer_than_the_run_is_refused_before_the_data(script, tmp_path, capsys):
    # 10: the default
    argv = [*TINY, "--epochs", "1", "--warmup_epochs", "10", "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit,
                       match="--warmup_epochs 10.0 is longer than --epochs 1; lower it"):
        script.main(parse(script, argv))
    assert "data:" not in capsys.readouterr().out


def test_local_crops_larger_than_global_crops_are_refused():
    args = parse(dino, ["--global_crop_size", "32", "--local_crop_size", "48", "--arch",
                        "vit_pico"])
    with pytest.raises(SystemExit,
                       match="--local_crop_size 48 is larger than --global_crop_size 32"):
        checks.check_start_args(args)


def test_batched_crops_train_on_images_of_two_sizes(tmp_path):
    """--batched_crops used to refuse a folder of mixed sizes; each image is now cropped on its own
    (with loader workers too)."""
    data = image_folder(tmp_path / "data", ["a"], per_class=8)
    image_folder(tmp_path / "data" / "b", ["c"], per_class=8, size=48)  # class b: 48 px images
    argv = [*TINY, "--dataset", "folder", "--data_path", str(data), "--batched_crops", "true",
            "--num_workers", "2", "--output_dir", str(tmp_path / "out")]
    dino.main(parse(dino, argv))
    assert (tmp_path / "out" / "checkpoint.pth").exists()


@pytest.mark.parametrize("module, flags, flag", [(esvit, TINY, "--init_from"), (drloc, DRLOC_TINY,
                                                                                "--pretrained")])
def test_a_missing_weights_path_is_refused_before_any_work(tmp_path, capsys, module, flags, flag):
    missing = tmp_path / "missing.pth"
    with pytest.raises(SystemExit, match=f"{flag} {missing} is not a file"):
        common.run_script(module.main, module.get_args_parser(),
                          argv=[*flags, flag, str(missing), "--output_dir", str(tmp_path / "out")])
    out = tmp_path / "out"  # nothing written but the folder's lock (which is never deleted)
    assert (not out.exists() or os.listdir(out) == [".lock"]) and "data:" not in capsys.readouterr().out


def test_weights_that_are_not_a_networks_are_one_line(tmp_path, patch8_checkpoint):
    with pytest.raises(SystemExit,
                       match="--checkpoint_key epoch picks an int in .*, not a network's weights"):
        eval_knn.load_backbone(str(patch8_checkpoint), "epoch", crop=32)
    features = tmp_path / "trainfeat.pth"
    # eval_knn.py --dump_features's output
    torch.save(torch.zeros(4, 8), features)
    with pytest.raises(SystemExit, match=f"--pretrained_weights {features} holds a Tensor, not a "
                                         f"network's weights"):
        eval_knn.load_backbone(str(features), arch="vit_pico", crop=32)
    with pytest.raises(SystemExit,
                       match=f"--pretrained {features} holds a Tensor, not a network's weights"):
        drloc.load_pretrained(common.build_backbone("vit_pico", img_size=32), str(features))


def drloc_folder(root):
    image_folder(root / "train", ["a", "b"], per_class=8, size=64)
    image_folder(root / "val", ["a", "b"], per_class=2, size=64)
    return root


def test_drloc_validation_leaves_unreadable_images_out_and_counts_them(tmp_path):
    data = drloc_folder(tmp_path / "data")
    (data / "val" / "a" / "0.png").write_bytes(b"not an image")
    flags = [*DRLOC_TINY, "--dataset", "folder", "--data_path", str(data), "--skip_bad_images",
             "--mixup", "0", "--cutmix", "0"]
    drloc.main(parse(drloc, [*flags, "--output_dir", str(tmp_path / "out")]))
    record = json.loads((tmp_path / "out" / "log.txt").read_text().splitlines()[-1])
    assert record["val_images"] == 3 and record["val_skipped_images"] == 1
    break_images(data / "val")
    with pytest.raises(SystemExit, match="none of the 4 validation images could be read"):
        drloc.main(parse(drloc, [*flags, "--output_dir", str(tmp_path / "out2")]))


def test_eval_linear_with_no_readable_validation_image_is_an_error(tmp_path, capsys):
    data = image_folder(tmp_path / "data" / "train", ["a", "b"]).parent
    image_folder(data / "val", ["a", "b"], per_class=2)
    (data / "val" / "a" / "0.png").write_bytes(b"not an image")
    probe = [*EVAL, "--dataset", "folder", "--data_path", str(data), "--skip_bad_images",
             "--epochs", "1", "--precomputed_features", "true"]
    eval_linear.main(parse(eval_linear, [*probe, "--output_dir", str(tmp_path / "one")]))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("on 3 validation images (1 unreadable, left out)")
    break_images(data / "val")
    with pytest.raises(SystemExit, match="none of the 4 validation images could be read"):
        eval_linear.main(parse(eval_linear, [*probe, "--output_dir", str(tmp_path / "none")]))
    assert not (tmp_path / "none" / "linear_checkpoint.pth").exists()


def test_eval_knn_with_no_readable_test_image_is_an_error(tmp_path):
    data = image_folder(tmp_path / "train", ["a", "b"]).parent
    break_images(image_folder(data / "val", ["a", "b"], per_class=2))
    args = parse(eval_knn, [*EVAL, "--dataset", "folder", "--data_path", str(data),
                            "--skip_bad_images", "--nb_knn", "2"])
    with pytest.raises(SystemExit, match="none of the 4 test images could be read"):
        eval_knn.main(args)


def test_eval_knn_refuses_more_neighbours_than_train_images_before_extracting_features(capsys):
    with pytest.raises(SystemExit, match="--nb_knn 100 is more than the 16 train images"):
        eval_knn.main(parse(eval_knn, [*SYNTHETIC_EVAL, "--nb_knn", "20", "100"]))
    assert "features" not in capsys.readouterr().err


def test_diverged_weights_give_no_accuracy(tmp_path):
    """Weights with a NaN (a diverged run's), or finite ones whose activations overflow, gave a k-NN
    and a probe figure (10%: the NaN features voted anyhow). Now each is one line, and no probe is
    written."""
    state = common.build_backbone("vit_pico", img_size=32).state_dict()
    nan, huge = tmp_path / "nan.pth", tmp_path / "huge.pth"
    torch.save({**state, "blocks.0.mlp.fc1.bias": torch.full_like(state["blocks.0.mlp.fc1.bias"],
                                                                  float("nan"))}, nan)
    # finite: overflows
    torch.save({**state, "norm.weight": torch.full_like(state["norm.weight"], 3e38)}, huge)
    data = [*SYNTHETIC_EVAL[1:], "--pretrained_weights"]
    for module, flags in (eval_knn, ["--nb_knn", "2"]), (eval_linear, ["--output_dir",
                                                                       str(tmp_path / "probe")]):
        with pytest.raises(SystemExit, match=r"nan.pth \[teacher\] holds non-finite weights "
                                             r"\(blocks.0.mlp.fc1.bias\)"):
            module.main(parse(module, [*data, str(nan), *flags]))
    with pytest.raises(SystemExit,
                       match="non-finite features for 16 of 16 images: its activations overflow"):
        eval_knn.main(parse(eval_knn, [*data, str(huge), "--nb_knn", "2"]))
    with pytest.raises(SystemExit,
                       match="the probe's train loss is nan at epoch 0 \\(this epoch is not "
                             "saved\\)"):
        eval_linear.main(parse(eval_linear, [*data, str(huge), "--epochs", "1", "--output_dir",
                                             str(tmp_path / "p")]))
    assert not list(tmp_path.rglob("linear_checkpoint.pth"))


def test_eval_knn_load_features_that_are_empty_or_do_not_fit_are_one_line(tmp_path):
    for name in eval_knn.FEATURE_FILES:
        (tmp_path / name).write_bytes(b"")
    args = parse(eval_knn, ["--load_features", str(tmp_path), "--nb_knn", "1"])
    with pytest.raises(SystemExit, match=f"--load_features {tmp_path / 'trainfeat.pth'} is empty "
                                         "\\(0 bytes\\); write the features again with "
                                         "--dump_features"):
        eval_knn.main(args)
    # torch would advise weights_only=False
    Image.new("RGB", (8, 8)).save(tmp_path / "trainfeat.pth", format="PNG")
    not_pytorch = "trainfeat.pth is not a PyTorch file \\(it starts b'\\\\x89P'\\)"
    with pytest.raises(SystemExit, match=not_pytorch) as error:
        eval_knn.main(args)
    assert "weights_only" not in str(error.value)
    for name, value in zip(eval_knn.FEATURE_FILES,
                           (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long),
                            torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))):
        torch.save(value, tmp_path / name)
    with pytest.raises(SystemExit, match="do not fit together: train features \\[4, 8\\], "
                                         "labels \\[4\\]; test features \\[2, 6\\], "
                                         "labels \\[2\\]"):
        eval_knn.main(args)
    # another tool's: unnormalised, float64, int32
    train = torch.tensor([[3.0, 0.0], [0.0, 0.5], [-2.0, 0.1]])
    for name, value in zip(eval_knn.FEATURE_FILES, (train.double(), torch.tensor([0, 1, 2],
                                                                                 dtype=torch.int32),
                                                    torch.tensor([[0.2, 0.9]]), torch.tensor([1]))):
        torch.save(value, tmp_path / name)
    # cosine, not dot product: [3, 0] is not the nearest
    assert eval_knn.main(args) == {1: (100.0, None)}
    torch.save(torch.tensor([[float("nan"), 1.0]]), tmp_path / "testfeat.pth")
    with pytest.raises(SystemExit,
                       match="holds non-finite features \\(NaN or inf\\): there is no k-NN result"):
        eval_knn.main(args)


@pytest.mark.parametrize("flags, named", [
    (["--pretrained_weights", "other.pth", "--arch", "swin_pico3"],
     "--pretrained_weights, --arch would be ignored; drop them"),
    (["--data_path", "elsewhere"], "--data_path would be ignored; drop it"),
    (["--random_init"], "--random_init would be ignored"),
    (["--crop", "32"], "--crop would be ignored"),
    (["--dump_features", "again"], "--dump_features would be ignored")])
def test_eval_knn_load_features_refuses_the_model_and_data_flags_it_would_ignore(tmp_path, flags,
                                                                                 named):
    """Saved features are all --load_features evaluates: another checkpoint or dataset beside them
    is not used."""
    for name, value in zip(eval_knn.FEATURE_FILES, (torch.eye(2), torch.tensor([0, 1]),
                                                    torch.eye(2), torch.tensor([0, 1]))):
        torch.save(value, tmp_path / name)
    argv = ["--load_features", str(tmp_path), "--nb_knn", "1"]
    # k-NN flags apply
    assert eval_knn.main(parse(eval_knn, [*argv, "--temperature", "0.1"])) == {1: (100.0, None)}
    with pytest.raises(SystemExit,
                       match=f"--load_features {tmp_path} evaluates saved features: {named}"):
        eval_knn.main(parse(eval_knn, [*argv, *flags]))
    assert not (Path.cwd() / "again").exists()


def test_eval_correspondence_without_any_scored_pair_is_an_error():
    with pytest.raises(SystemExit, match="no pair has a token whose match is known"):
        metrics = len(eval_correspondence.CORRESPONDENCE_METRICS)
        eval_correspondence.correspondence_means(torch.zeros(metrics + 1))


@pytest.mark.parametrize("script, argv", [
    ("eval_correspondence", "--batch_size_per_gpu 0"), ("eval_correspondence", "--crop_size 0"),
    ("eval_correspondence", "--max_images -1"), ("eval_correspondence", "--num_pictures -1"),
    ("eval_correspondence", "--crops_scale 0 1.5"), ("visualize", "attention --picture_size 0"),
    ("visualize", "attention --image_size 0"), ("visualize", "attention --threshold 2"),
    ("bench", "--threads 0"), ("bench", "--steps 0"), ("head_precision", "--batch 0")])
def test_extras_out_of_range_arguments_are_refused_at_parse_time(capsys, script, argv):
    with pytest.raises(SystemExit):
        importlib.import_module(script).get_args_parser().parse_args(argv.split())
    flag = next(word for word in argv.split() if word.startswith("--"))
    assert f"argument {flag}: " in capsys.readouterr().err


def test_extras_refuse_a_crop_that_the_patch_does_not_tile(tmp_path, patch8_checkpoint):
    data = ["--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "32"]
    with pytest.raises(SystemExit,
                       match="--crop 36 is not a multiple of the vit_pico patch size \\(8 px\\)"):
        teacher_outputs.main(parse(teacher_outputs, ["--pretrained_weights", str(patch8_checkpoint),
                                                     *data, "--crop", "36", "--resize", "40"]))
    with pytest.raises(SystemExit,
                       match="--image_size 36 is not a multiple of the vit_pico patch size "
                             "\\(8 px\\)"):
        visualize.main(parse(visualize, ["attention", "--pretrained_weights",
                                         str(patch8_checkpoint), *data, "--image_size", "36",
                                         "--output", str(tmp_path / "a.png")]))


@pytest.mark.parametrize("flags, said", [
    # was torch's traceback
    (["--global_crops_scale", "0.8", "0.2"], "--global_crops_scale 0.8 0.2 is reversed"),
    (["--local_crops_scale", "0.5", "0.1"], "--local_crops_scale 0.5 0.1 is reversed"),
    (["--local_crop_size", "48"], "--local_crop_size 48 is larger than --global_crop_size 32")])
def test_visualize_refuses_the_crop_flags_a_training_run_refuses(tmp_path, flags, said):
    """crops and matchings draw what a training run would: flags the run refuses are refused,
    before any data."""
    crops = ["crops", "--data_path", str(tmp_path / "missing"), "--global_crop_size", "32",
             "--local_crop_size", "16"]
    matchings = ["matchings", "--random_init", "--arch", "vit_pico", "--patch_size", "8",
                 "--dataset", "synthetic", "--synthetic_image_size", "32", "--global_crop_size",
                 "32", "--local_crop_size", "16"]
    for argv in (crops, matchings):
        with pytest.raises(SystemExit, match=said):
            visualize.main(parse(visualize, [*argv, *flags, "--output", str(tmp_path / "p.png")]))
    assert not (tmp_path / "p.png").exists()


def test_visualize_output_naming_a_folder_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit,
                       match=f"--output {tmp_path} is a folder; name the PNG file to write"):
        visualize.main(parse(visualize, ["attention", "--random_init", "--arch", "vit_pico",
                                         "--dataset", "synthetic", "--image_size", "32", "--output",
                                         str(tmp_path)]))
    assert "model:" not in capsys.readouterr().out


def test_visualize_an_unreadable_image_is_not_replaced_by_its_neighbour(tmp_path):
    data = image_folder(tmp_path / "data" / "val", ["a", "b"], per_class=2).parent
    (data / "val" / "a" / "1.png").write_bytes(b"not an image")
    with pytest.raises(SystemExit,
                       match="image --index 1 of the test split: cannot read image .*1.png"):
        visualize.main(parse(visualize, ["attention", "--random_init", "--arch", "vit_pico",
                                         "--dataset", "folder", "--data_path", str(data),
                                         "--skip_bad_images", "--index", "1", "--image_size", "32",
                                         "--output", str(tmp_path / "a.png")]))
    assert not (tmp_path / "a.png").exists()


def test_flipped_bytes_in_a_tensor_of_checkpoint_pth_are_refused(tmp_path):
    out = tmp_path / "run"
    assert run_here("dino.py", *TINY, "--output_dir", str(out)).returncode == 0
    path = out / "checkpoint.pth"
    data = bytearray(path.read_bytes())
    # inside the first tensor's bytes (past its file header)
    weights = data.find(b"data/0") + 200
    data[weights] ^= 0x10
    data[weights + 1] ^= 0x01
    path.write_bytes(bytes(data))
    line = error_line(run_here("dino.py", *TINY, "--epochs", "2", "--output_dir", str(out)))
    assert (line.startswith("error: checkpoint ")
            and "is damaged: the checksum of its entry" in line), line


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_pickle_that_would_run_code_is_refused_without_torchs_advice(tmp_path):
    torch.save({"teacher": RunsCode()}, tmp_path / "w.pth")
    with pytest.raises(SystemExit) as stop:
        common.load_checkpoint(tmp_path / "w.pth")
    line = str(stop.value.code)
    assert "holds builtins.print beyond tensors and plain values: refused unread" in line, line
    assert "truncated" not in line and "weights_only" not in line, line


@pytest.mark.parametrize("script", ["dino.py", "eval_knn.py"])
def test_a_data_path_without_train_but_with_val_is_refused(tmp_path, script):
    image_folder(tmp_path / "training", ["a", "b"])
    image_folder(tmp_path / "val", ["a", "b"])
    flags = ([*TINY, "--output_dir", str(tmp_path / "out")] if script == "dino.py"
             else [*EVAL, "--nb_knn", "2"])
    result = run_here(script, *on_folder(flags, tmp_path))
    line = error_line(result)
    assert f"--data_path {tmp_path} has no train/ folder but has val/" in line, line


def test_a_grace_period_that_is_no_number_of_seconds_is_one_line(monkeypatch):
    code = "import common; common.install_preemption_handler()"  # (nothing happens at import)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, env={**ENV, "PREEMPTION_GRACE_SECONDS": "abc"})
    assert error_line(result) == ("error: PREEMPTION_GRACE_SECONDS: expected a number, got 'abc' "
                                  "(seconds, 300 by default)")
    for value in ("0", "-1", "inf", "nan"):
        monkeypatch.setenv("PREEMPTION_GRACE_SECONDS", value)
        with pytest.raises(SystemExit, match=f"PREEMPTION_GRACE_SECONDS: {value} is out of range"):
            common.install_preemption_handler()
    monkeypatch.setenv("PREEMPTION_GRACE_SECONDS", "2.5")
    with monkeypatch.context() as signals:  # the handler installed, then the test's restored
        for sig in common.PREEMPTION_SIGNALS:
            signals.setattr(common.signal, "signal", lambda *a: None)
        common.install_preemption_handler()
    assert common.preemption.grace_seconds == 2.5


def test_init_from_a_step_past_this_runs_epoch_is_refused(tmp_path, monkeypatch):
    view = tmp_path / "view"
    two_steps = [*TINY, "--max_steps_per_epoch", "2", "--synthetic_images", "24"]
    with monkeypatch.context() as patched:
        stop_at_check(patched, 1)                  # preempted after step 1 of 2
        result = run_here("esvit.py", *two_steps, "--use_region_loss", "false", "--output_dir",
                          str(view))
    assert result.returncode == 0 and torch.load(view / "checkpoint.pth",
                                                 weights_only=True)["step"] == 1
    result = run_here("esvit.py", *TINY, "--epochs", "2", "--output_dir", str(tmp_path / "full"),
                      "--init_from", str(view / "checkpoint.pth"))     # 1 step per epoch
    assert ("stopped after step 1 of epoch 0, but this run's epochs have 1 steps"
            in error_line(result))


@pytest.mark.parametrize("flag, value, expected", [
    # numpy's seed: a traceback
    ("--seed", "4294967296", "is too large: expected at most 2147483647"),
    # logits / 0: NaN
    ("--teacher_temp", "1e-50", "is out of float32's range, where it would be 0"),
    ("--lr", "1e39", "is out of float32's range, where it would be inf")])
def test_numbers_past_what_the_libraries_hold_are_refused_by_argparse(capsys, flag, value,
                                                                      expected):
    import dino
    with pytest.raises(SystemExit) as stop:
        dino.get_args_parser().parse_args([flag, value])
    assert stop.value.code == 2
    assert f"argument {flag}: {value} {expected}" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["dino.py", "eval_linear.py"])
def test_an_enormous_epochs_is_refused_not_out_of_memory(tmp_path, script):
    """The schedules hold a value per step: 2**31 - 1 epochs of 6 steps were 1.3e10 values a
    schedule (103 GB), reported as out of memory. --epochs is at most 10,000 (DINO's longest:
    800)."""
    r = run_here(script, "--epochs", "2147483647", "--output_dir", str(tmp_path))
    assert ("argument --epochs: 2147483647 is out of range: expected a value in [1, 10000]"
            in r.stderr)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_node_that_cannot_see_the_checkpoint_stops_the_job(tmp_path):
    """Two "nodes" on localhost, each its own working folder: a relative --output_dir is not
    shared, so node 1 finds no checkpoint.pth where node 0 resumes (it used to start at epoch 0 and
    hang)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    assert run_here("dino.py", *TINY, "--output_dir", str(nodes[0] / "out")).returncode == 0
    port, jobs = free_port(), []
    for rank, node in enumerate(nodes):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                    str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                    "--master_port", str(port)]
        cmd = [*launcher, str(ROOT / "dino.py"), *TINY, "--epochs", "2", "--allow_changed_args",
               "--output_dir", "out"]
        jobs.append(subprocess.Popen(cmd, cwd=node, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=ENV, start_new_session=True))
    errors = []
    try:
        for job in jobs:
            errors.append(job.communicate(timeout=60)[1])
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
    assert all(job.returncode != 0 for job in jobs), errors[1][-2000:]
    expected = (f"error: process 1 (host {socket.gethostname()}) cannot read the "
                f"out/checkpoint.pth that process 0 resumes from (epoch 1, step 0; it finds no "
                f"file)")
    for err in errors:
        assert expected in err
        assert "Traceback (most recent call last):\n  File \"" + str(ROOT) not in err


def test_weights_wrapped_in_a_model_entry_suggest_the_checkpoint_key(tmp_path):
    weights = common.build_backbone("vit_pico", patch_size=16, img_size=32).state_dict()
    torch.save({"model": weights, "epoch": 3}, tmp_path / "w.pth")
    flags = [*[f for f in EVAL if f != "--random_init"], "--dataset", "synthetic",
             "--synthetic_images", "16", "--synthetic_image_size", "32", "--nb_knn", "2",
             "--pretrained_weights", str(tmp_path / "w.pth")]
    assert error_line(run_here("eval_knn.py", *flags)) == (
        f"error: --pretrained_weights {tmp_path / 'w.pth'} holds the weights of model: "
        "choose one with --checkpoint_key model")
    result = run_here("eval_knn.py", *flags, "--checkpoint_key", "model")
    assert result.returncode == 0, result.stderr[-2000:]


def test_gpu_check_with_an_unknown_part_leaves_no_folder(tmp_path):
    sys.path.append(str(ROOT / "extras" / "perf"))
    import gpu_check
    with pytest.raises(SystemExit, match="--parts nosuch: no such part here"):
        gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "check"), "--parts", "nosuch"])
    assert not (tmp_path / "check").exists()


def test_saved_labels_that_are_no_class_index_are_refused(tmp_path):
    import eval_knn
    for train_labels in (torch.tensor([0, -1, 2]), torch.tensor([0.0, 1.5, 2.0])):
        args = save_features(tmp_path, train_labels, torch.tensor([1]))
        with pytest.raises(SystemExit, match="holds labels that are no class index"):
            eval_knn.main(args)
