"""A result is true or it is an error (the second probe of the fault table, docs/ERRORS.md): every
resumable script (the linear probe included) records and checks what it trains, every script
checks its paths, ranges and sizes before it builds data or models, every "done" line names only
files written in that run, and a metric over zero items is an error, not 0% or NaN. Runs are in
process on tiny data, except where the behaviour is about processes (a killed loader worker)."""
import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import tqdm
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "extras" / "tools"), str(ROOT / "extras" / "perf")]
import common  # noqa: E402
import dino  # noqa: E402
import drloc  # noqa: E402
import esvit  # noqa: E402
import eval_correspondence  # noqa: E402
import eval_knn  # noqa: E402
import eval_linear  # noqa: E402
import glsd  # noqa: E402
import selfpatch  # noqa: E402
import teacher_outputs  # noqa: E402
import visualize  # noqa: E402
from test_faults import EVAL, TINY, image_folder, one_line_error, run  # noqa: E402
from test_reliability import descendants  # noqa: E402

SSL_FLAGS = {"dino": TINY, "esvit": TINY, "glsd": TINY,
             "selfpatch": [*TINY, "--patch_size", "8", "--local_crop_size", "24", "--patch_out_dim", "32"]}
DRLOC_TINY = ["--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "64", "--arch",
              "swin_pico", "--input_size", "64", "--batch_size_per_gpu", "8", "--max_steps_per_epoch", "1",
              "--num_workers", "0", "--warmup_epochs", "0", "--epochs", "1", "--device", "cpu", "--precision", "fp32"]
SYNTHETIC_EVAL = [*EVAL, "--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "32"]


def parse(module, argv):
    return module.get_args_parser().parse_args(argv)


def break_images(folder):
    """Overwrite every image under `folder` with bytes no decoder reads."""
    for path in Path(folder).rglob("*.png"):
        path.write_bytes(b"not an image")


@pytest.fixture(scope="module")
def patch8_checkpoint(tmp_path_factory):
    """A one-step DINO run of a vit_pico with 8 px patches: its checkpoint.pth."""
    out = tmp_path_factory.mktemp("patch8")
    dino.main(parse(dino, [*TINY, "--patch_size", "8", "--output_dir", str(out)]))
    return out / "checkpoint.pth"


# ------------------------------------------------------------------------------------------------
# Case 2: the "done" line names files written by that run
# ------------------------------------------------------------------------------------------------
def preempted_after_first_epoch(monkeypatch, output_dir):
    """A preemption signal arrives once the first epoch's checkpoint is written."""
    monkeypatch.setattr(common, "preemption_requested", lambda device: (output_dir / "checkpoint.pth").exists())


@pytest.mark.parametrize("method", ["dino", "esvit", "glsd", "selfpatch", "drloc"])
def test_lowering_epochs_to_those_trained_writes_what_the_done_line_names(tmp_path, monkeypatch, capsys, method):
    module = importlib.import_module(method)
    flags = [*(DRLOC_TINY if method == "drloc" else SSL_FLAGS[method]), "--output_dir", str(tmp_path)]
    with monkeypatch.context() as patched:
        preempted_after_first_epoch(patched, tmp_path)
        with pytest.raises(SystemExit) as stop:
            module.main(parse(module, [*flags, "--epochs", "3"]))
    assert stop.value.code == 0 and torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 1
    backbone_file, network = ("backbone.pth", "model") if method == "drloc" else ("teacher_backbone.pth", "teacher")
    assert not (tmp_path / backbone_file).exists()
    started = time.time_ns()
    capsys.readouterr()
    module.main(parse(module, [*flags, "--epochs", "1"]))     # the epoch already trained: nothing left to train
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith(f"nothing left to train: {tmp_path / 'checkpoint.pth'} has trained all 1 epochs")
               for line in lines), lines[-3:]
    named = Path(lines[-1].split(": ")[-1])
    assert lines[-1].startswith("done;") and named.parent == tmp_path and named.stat().st_mtime_ns >= started
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    backbone = torch.load(tmp_path / backbone_file, weights_only=True)
    assert ckpt["epoch"] == 1 and backbone.keys() == {k[9:] for k in ckpt[network] if k.startswith("backbone.")}
    assert all(torch.equal(v, ckpt[network][f"backbone.{k}"]) for k, v in backbone.items())


def test_a_mid_epoch_checkpoint_past_the_lowered_epochs_is_refused(tmp_path):
    args = parse(dino, ["--epochs", "1", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="has already trained 1 epochs and 2 steps, more than --epochs 1"):
        common.check_resumed_args({"epoch": 1, "step": 2, "args": vars(args), "method": "dino"}, args,
                                  "dino")


# ------------------------------------------------------------------------------------------------
# Case 3: a linear probe is resumed only with what it was trained with
# ------------------------------------------------------------------------------------------------
def test_eval_linear_refuses_to_resume_another_setup(tmp_path, monkeypatch):
    out = tmp_path / "probe"
    probe = [*SYNTHETIC_EVAL, "--precomputed_features", "true", "--output_dir", str(out)]
    eval_linear.main(parse(eval_linear, [*probe, "--epochs", "1"]))
    log = (out / "log.txt").read_text()
    for change, expected in ((["--lr", "0.01"], "--lr 0.001 \\(now 0.01\\)"),
                             (["--resize", "48"], "--resize 32 \\(now 48\\)"),
                             (["--synthetic_seed", "1"], "--synthetic_seed 0 \\(now 1\\)"),
                             (["--batch_size_per_gpu", "2"], "--batch_size_per_gpu 4 \\(now 2\\)")):
        with pytest.raises(SystemExit, match=f"{out / 'linear_checkpoint.pth'} holds a probe trained with other "
                                             f"arguments: {expected}"):
            eval_linear.main(parse(eval_linear, [*probe, "--epochs", "2", *change]))
    with monkeypatch.context() as patched:
        patched.setattr(common, "get_world_size", lambda: 2)
        with pytest.raises(SystemExit, match="1 process \\(now 2: another total batch"):
            eval_linear.main(parse(eval_linear, [*probe, "--epochs", "2"]))
    assert (out / "log.txt").read_text() == log                        # nothing written by the refused runs
    eval_linear.main(parse(eval_linear, [*probe, "--epochs", "2", "--val_freq", "5", "--num_workers", "1"]))
    with pytest.raises(SystemExit, match="has already trained 2 epochs, more than --epochs 1"):
        eval_linear.main(parse(eval_linear, [*probe, "--epochs", "1"]))


def test_eval_linear_refuses_to_resume_on_other_data(tmp_path):
    one, two = image_folder(tmp_path / "one", ["a", "b"]), image_folder(tmp_path / "two", ["a", "b"], seed=1)
    for split in ("train", "val"):
        image_folder(one / split, ["a", "b"])
    image_folder(two / "train", ["a", "b"])
    image_folder(two / "val", ["a", "b"], per_class=3)
    probe = [*EVAL, "--dataset", "folder", "--precomputed_features", "true", "--output_dir", str(tmp_path / "probe")]
    eval_linear.main(parse(eval_linear, [*probe, "--data_path", str(one), "--epochs", "1"]))
    with pytest.raises(SystemExit, match="was trained on another validation split \\(8 images, now 6\\)"):
        eval_linear.main(parse(eval_linear, [*probe, "--data_path", str(two), "--epochs", "2"]))


# ------------------------------------------------------------------------------------------------
# Cases 4, 5, 10: unreadable evaluation images are left out and counted; none readable is an error
# ------------------------------------------------------------------------------------------------
def drloc_folder(root):
    image_folder(root / "train", ["a", "b"], per_class=8, size=64)
    image_folder(root / "val", ["a", "b"], per_class=2, size=64)
    return root


def test_drloc_validation_leaves_unreadable_images_out_and_counts_them(tmp_path):
    data = drloc_folder(tmp_path / "data")
    (data / "val" / "a" / "0.png").write_bytes(b"not an image")
    flags = [*DRLOC_TINY, "--dataset", "folder", "--data_path", str(data), "--skip_bad_images", "--mixup", "0",
             "--cutmix", "0"]
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
    probe = [*EVAL, "--dataset", "folder", "--data_path", str(data), "--skip_bad_images", "--epochs", "1",
             "--precomputed_features", "true"]
    eval_linear.main(parse(eval_linear, [*probe, "--output_dir", str(tmp_path / "one")]))
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("on 3 validation images (1 unreadable, left out)")
    break_images(data / "val")
    with pytest.raises(SystemExit, match="none of the 4 validation images could be read"):
        eval_linear.main(parse(eval_linear, [*probe, "--output_dir", str(tmp_path / "none")]))
    assert not (tmp_path / "none" / "linear_checkpoint.pth").exists()


def test_eval_knn_with_no_readable_test_image_is_an_error(tmp_path):
    data = image_folder(tmp_path / "train", ["a", "b"]).parent
    break_images(image_folder(data / "val", ["a", "b"], per_class=2))
    args = parse(eval_knn, [*EVAL, "--dataset", "folder", "--data_path", str(data), "--skip_bad_images", "--nb_knn", "2"])
    with pytest.raises(SystemExit, match="none of the 4 test images could be read"):
        eval_knn.main(args)


def test_eval_knn_refuses_more_neighbours_than_train_images_before_extracting_features(capsys):
    with pytest.raises(SystemExit, match="--nb_knn 100 is more than the 16 train images"):
        eval_knn.main(parse(eval_knn, [*SYNTHETIC_EVAL, "--nb_knn", "20", "100"]))
    assert "features" not in capsys.readouterr().err


def test_evaluating_a_holdout_leaves_unreadable_images_out_instead_of_substituting(tmp_path, capsys):
    """With --holdout the evaluation splits are subsets of one image folder: an unreadable image
    is still left out, not replaced by its neighbour with the neighbour's label."""
    data = image_folder(tmp_path / "data", ["a", "b"], per_class=6)
    (data / "b" / "5.png").write_bytes(b"not an image")
    args = parse(eval_knn, [*EVAL, "--dataset", "folder", "--data_path", str(data), "--skip_bad_images",
                            "--holdout", "4", "--nb_knn", "2"])
    eval_knn.main(args)
    assert "k-NN over 8 train and 3 test images" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Case 6: the total batch (processes x batch per process) of a resumed run
# ------------------------------------------------------------------------------------------------
def test_resuming_with_another_number_of_processes_is_refused(tmp_path, monkeypatch, capsys):
    flags = [*TINY, "--output_dir", str(tmp_path)]
    dino.main(parse(dino, flags))
    monkeypatch.setattr(common, "get_world_size", lambda: 2)
    capsys.readouterr()
    with pytest.raises(SystemExit, match="trained with other arguments: 1 process \\(now 2: another total batch"):
        dino.main(parse(dino, [*flags, "--epochs", "2"]))
    assert "data:" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Cases 7, 9, 11: sizes and paths checked before any data or model is built
# ------------------------------------------------------------------------------------------------
def test_local_crops_larger_than_global_crops_are_refused():
    args = parse(dino, ["--global_crop_size", "32", "--local_crop_size", "48", "--arch", "vit_pico"])
    with pytest.raises(SystemExit, match="--local_crop_size 48 is larger than --global_crop_size 32"):
        common.check_start_args(args)


@pytest.mark.parametrize("script", [dino, esvit, glsd, selfpatch])
def test_a_warmup_longer_than_the_run_is_refused_before_the_data(script, tmp_path, capsys):
    argv = [*TINY, "--epochs", "1", "--warmup_epochs", "10", "--output_dir", str(tmp_path)]    # 10: the default
    with pytest.raises(SystemExit, match="--warmup_epochs 10.0 is longer than --epochs 1; lower it"):
        script.main(parse(script, argv))
    assert "data:" not in capsys.readouterr().out


def test_batched_crops_train_on_images_of_two_sizes(tmp_path):
    """--batched_crops used to refuse a folder of mixed sizes; each image is now cropped on its own
    (with loader workers too)."""
    data = image_folder(tmp_path / "data", ["a"], per_class=8)
    image_folder(tmp_path / "data" / "b", ["c"], per_class=8, size=48)  # class b: 48 px images
    argv = [*TINY, "--dataset", "folder", "--data_path", str(data), "--batched_crops", "true",
            "--num_workers", "2", "--output_dir", str(tmp_path / "out")]
    dino.main(parse(dino, argv))
    assert (tmp_path / "out" / "checkpoint.pth").exists()


@pytest.mark.parametrize("module, flags, flag", [(esvit, TINY, "--init_from"), (drloc, DRLOC_TINY, "--pretrained")])
def test_a_missing_weights_path_is_refused_before_any_work(tmp_path, capsys, module, flags, flag):
    missing = tmp_path / "missing.pth"
    with pytest.raises(SystemExit, match=f"{flag} {missing} is not a file"):
        common.run_script(module.main, module.get_args_parser(),
                          argv=[*flags, flag, str(missing), "--output_dir", str(tmp_path / "out")])
    out = tmp_path / "out"  # nothing written but the folder's lock (which is never deleted)
    assert (not out.exists() or os.listdir(out) == [".lock"]) and "data:" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Case 8: a loader worker killed by the kernel
# ------------------------------------------------------------------------------------------------
def test_a_killed_loader_worker_is_one_line_and_the_run_resumes(tmp_path):
    flags = [*TINY, "--max_steps_per_epoch", "0", "--output_dir", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "dino.py", *flags, "--epochs", "50", "--num_workers", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (tmp_path / "checkpoint.pth").exists() and time.time() < deadline:     # after the first epoch
        time.sleep(0.2)
    workers = descendants(proc.pid)
    assert workers, "no loader worker"
    for worker in workers:
        os.kill(worker, signal.SIGKILL)                   # as the kernel's out-of-memory killer does
    out, err = proc.communicate(timeout=120)
    last = one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), "a data loader worker (pid")
    assert "(most likely the kernel's out-of-memory killer; its own error, if any, is above)" in last
    assert "run the same command with fewer --num_workers (now 1) to resume" in last
    assert f"the last checkpoint is {tmp_path / 'checkpoint.pth'}" in last
    epoch = torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"]
    again = run("dino.py", *flags, "--epochs", str(epoch + 1), "--num_workers", "0")
    assert again.returncode == 0 and f"resumed from {tmp_path / 'checkpoint.pth'} at epoch {epoch}" in again.stdout


def test_a_dead_workers_error_starts_its_own_line_after_a_bar_cut_short(monkeypatch, capsys):
    """torch's SIGCHLD handler raises wherever the main process is: inside a progress bar's closing
    it leaves the bar drawn without its newline (seen once in CI: `...0/6 [00:00<?, ?it/s]error: a
    data loader worker ...`). The error must still start a line."""
    bar = tqdm.tqdm(range(6), desc="epoch 1")              # drawn at 0%, no newline
    bar.disable = True                                      # closed, as a close cut short leaves it
    tqdm.tqdm._instances.discard(bar)

    def main(args):
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
    previous = signal.getsignal(signal.SIGCHLD)
    monkeypatch.setattr(common, "dead_loader_worker", lambda wait: "(pid 4242) was killed by SIGKILL")
    try:
        with pytest.raises(SystemExit, match=r"^error: a data loader worker \(pid 4242\)"):
            common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])
    finally:
        signal.signal(signal.SIGCHLD, previous)
    err = capsys.readouterr().err
    assert "0/6" in err and err.endswith("\n"), repr(err)


class FakeWorker:
    """A loader worker process as `multiprocessing` reports it (`exitcode`: -9 after SIGKILL)."""

    def __init__(self, exitcode):
        self.pid = 4242
        self.exitcode = exitcode


def test_a_worker_killed_while_handing_over_a_batch_is_the_same_one_line(monkeypatch):
    """Killed while it hands a batch over, a worker leaves the main process a broken connection
    (ConnectionResetError, seen on a loaded machine) instead of torch's RuntimeError: the exit is
    told by the workers' exit codes (no text of torch's, no private torch function); without a
    dead worker the error is not a loader's and keeps its traceback."""
    workers = []

    def main(args):
        common._loader_workers[:] = workers  # as the loader notes them
        raise ConnectionResetError(104, "Connection reset by peer")
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        workers[:] = [FakeWorker(None), FakeWorker(-9)]
        with pytest.raises(SystemExit, match=r"^error: a data loader worker \(pid 4242\) was killed by "
                                             r"SIGKILL \(most likely the kernel's out-of-memory killer"):
            common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])
        workers[:] = [FakeWorker(None)]
        with pytest.raises(ConnectionResetError):
            common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])
    finally:
        signal.signal(signal.SIGCHLD, previous)


@pytest.mark.parametrize("error, reason", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                            "capacity of 79.19 GiB"),
     "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"),
    (MemoryError("Unable to allocate 74.5 GiB for an array with shape (100000, 100000, 1)"),
     "Unable to allocate 74.5 GiB for an array with shape (100000, 100000, 1)"),
    (MemoryError(), "MemoryError")])
def test_out_of_memory_is_one_line_naming_the_batch(error, reason):
    """A batch, crop or image too large for the GPU (torch.OutOfMemoryError) or the CPU's memory
    (MemoryError, e.g. numpy drawing a synthetic image) stops with one line: what could not be
    allocated and which flags to lower, not a traceback from inside torch."""
    def main(args):
        raise error
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size_per_gpu", type=int, default=64)
    with pytest.raises(SystemExit) as stop:
        common.run_script(common.one_line_exits(main), parser, argv=[])
    assert stop.value.code == (f"error: out of memory ({reason}); lower --batch_size_per_gpu (now 64) "
                               f"or the crop and image sizes")


def test_an_error_that_is_not_memory_keeps_its_traceback():
    """Only an allocation failure becomes the memory line: another RuntimeError from torch is raised
    as it is (its text is never read)."""
    def main(args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])


# ------------------------------------------------------------------------------------------------
# Case 12: weights that are not a network's
# ------------------------------------------------------------------------------------------------
def test_weights_that_are_not_a_networks_are_one_line(tmp_path, patch8_checkpoint):
    with pytest.raises(SystemExit, match="--checkpoint_key epoch picks an int in .*, not a network's weights"):
        eval_knn.load_backbone(str(patch8_checkpoint), "epoch", crop=32)
    features = tmp_path / "trainfeat.pth"
    torch.save(torch.zeros(4, 8), features)                       # eval_knn.py --dump_features's output
    with pytest.raises(SystemExit, match=f"--pretrained_weights {features} holds a Tensor, not a network's weights"):
        eval_knn.load_backbone(str(features), arch="vit_pico", crop=32)
    with pytest.raises(SystemExit, match=f"--pretrained {features} holds a Tensor, not a network's weights"):
        drloc.load_pretrained(common.build_backbone("vit_pico", img_size=32), str(features))


def test_diverged_weights_give_no_accuracy(tmp_path):
    """Weights with a NaN (a diverged run's), or finite ones whose activations overflow, gave a k-NN and a
    probe figure (10%: the NaN features voted anyhow). Now each is one line, and no probe is written."""
    state = common.build_backbone("vit_pico", img_size=32).state_dict()
    nan, huge = tmp_path / "nan.pth", tmp_path / "huge.pth"
    torch.save({**state, "blocks.0.mlp.fc1.bias": torch.full_like(state["blocks.0.mlp.fc1.bias"], float("nan"))}, nan)
    torch.save({**state, "norm.weight": torch.full_like(state["norm.weight"], 3e38)}, huge)    # finite: overflows
    data = [*SYNTHETIC_EVAL[1:], "--pretrained_weights"]
    for module, flags in (eval_knn, ["--nb_knn", "2"]), (eval_linear, ["--output_dir", str(tmp_path / "probe")]):
        with pytest.raises(SystemExit, match=r"nan.pth \[teacher\] holds non-finite weights \(blocks.0.mlp.fc1.bias\)"):
            module.main(parse(module, [*data, str(nan), *flags]))
    with pytest.raises(SystemExit, match="non-finite features for 16 of 16 images: its activations overflow"):
        eval_knn.main(parse(eval_knn, [*data, str(huge), "--nb_knn", "2"]))
    with pytest.raises(SystemExit, match="the probe's train loss is nan at epoch 0 \\(this epoch is not saved\\)"):
        eval_linear.main(parse(eval_linear, [*data, str(huge), "--epochs", "1", "--output_dir", str(tmp_path / "p")]))
    assert not list(tmp_path.rglob("linear_checkpoint.pth"))


# ------------------------------------------------------------------------------------------------
# Case 13: bad input to the extras and to eval_knn.py --load_features
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, argv", [
    ("eval_correspondence", "--batch_size_per_gpu 0"), ("eval_correspondence", "--crop_size 0"),
    ("eval_correspondence", "--max_images -1"), ("eval_correspondence", "--num_pictures -1"),
    ("eval_correspondence", "--crops_scale 0 1.5"), ("visualize", "attention --picture_size 0"),
    ("visualize", "attention --image_size 0"), ("visualize", "attention --threshold 2"), ("bench", "--threads 0"),
    ("bench", "--steps 0"), ("head_precision", "--batch 0")])
def test_extras_out_of_range_arguments_are_refused_at_parse_time(capsys, script, argv):
    with pytest.raises(SystemExit):
        importlib.import_module(script).get_args_parser().parse_args(argv.split())
    flag = next(word for word in argv.split() if word.startswith("--"))
    assert f"argument {flag}: " in capsys.readouterr().err


def test_eval_correspondence_without_any_scored_pair_is_an_error():
    with pytest.raises(SystemExit, match="no pair has a token whose match is known"):
        eval_correspondence.correspondence_means(torch.zeros(len(eval_correspondence.CORRESPONDENCE_METRICS) + 1))


def test_extras_refuse_a_crop_that_the_patch_does_not_tile(tmp_path, patch8_checkpoint):
    data = ["--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "32"]
    with pytest.raises(SystemExit, match="--crop 36 is not a multiple of the vit_pico patch size \\(8 px\\)"):
        teacher_outputs.main(parse(teacher_outputs, ["--pretrained_weights", str(patch8_checkpoint), *data,
                                                     "--crop", "36", "--resize", "40"]))
    with pytest.raises(SystemExit, match="--image_size 36 is not a multiple of the vit_pico patch size \\(8 px\\)"):
        visualize.main(parse(visualize, ["attention", "--pretrained_weights", str(patch8_checkpoint), *data,
                                         "--image_size", "36", "--output", str(tmp_path / "a.png")]))


def test_visualize_output_naming_a_folder_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit, match=f"--output {tmp_path} is a folder; name the PNG file to write"):
        visualize.main(parse(visualize, ["attention", "--random_init", "--arch", "vit_pico", "--dataset", "synthetic",
                                         "--image_size", "32", "--output", str(tmp_path)]))
    assert "model:" not in capsys.readouterr().out


def test_visualize_an_unreadable_image_is_not_replaced_by_its_neighbour(tmp_path):
    data = image_folder(tmp_path / "data" / "val", ["a", "b"], per_class=2).parent
    (data / "val" / "a" / "1.png").write_bytes(b"not an image")
    with pytest.raises(SystemExit, match="image --index 1 of the test split: cannot read image .*1.png"):
        visualize.main(parse(visualize, ["attention", "--random_init", "--arch", "vit_pico", "--dataset", "folder",
                                         "--data_path", str(data), "--skip_bad_images", "--index", "1",
                                         "--image_size", "32", "--output", str(tmp_path / "a.png")]))
    assert not (tmp_path / "a.png").exists()


def test_extras_leave_an_unreadable_image_out_instead_of_counting_its_neighbour_twice(tmp_path, patch8_checkpoint,
                                                                                      capsys):
    data = image_folder(tmp_path / "data" / "val", ["a", "b"], per_class=2).parent
    (data / "val" / "a" / "1.png").write_bytes(b"not an image")
    flags = ["--pretrained_weights", str(patch8_checkpoint), "--dataset", "folder", "--data_path", str(data),
             "--skip_bad_images"]
    teacher_outputs.main(parse(teacher_outputs, [*flags, "--crop", "32", "--resize", "32"]))
    assert "3 images (1 unreadable, left out)" in capsys.readouterr().out
    results = eval_correspondence.main(parse(eval_correspondence, [*flags, "--crop_size", "32", "--protocols", "glsd",
                                                                   "--num_workers", "0", "--device", "cpu"]))
    assert results["glsd"]["pairs"] == 3


def test_eval_knn_load_features_that_are_empty_or_do_not_fit_are_one_line(tmp_path):
    for name in eval_knn.FEATURE_FILES:
        (tmp_path / name).write_bytes(b"")
    args = parse(eval_knn, ["--load_features", str(tmp_path), "--nb_knn", "1"])
    with pytest.raises(SystemExit, match=f"--load_features {tmp_path / 'trainfeat.pth'} is empty \\(0 bytes\\); write "
                                         "the features again with --dump_features"):
        eval_knn.main(args)
    Image.new("RGB", (8, 8)).save(tmp_path / "trainfeat.pth", format="PNG")   # torch would advise weights_only=False
    with pytest.raises(SystemExit, match="trainfeat.pth is not a PyTorch file \\(it starts b'\\\\x89P'\\)") as error:
        eval_knn.main(args)
    assert "weights_only" not in str(error.value)
    for name, value in zip(eval_knn.FEATURE_FILES, (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long),
                                                    torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))):
        torch.save(value, tmp_path / name)
    with pytest.raises(SystemExit, match="do not fit together: train features \\[4, 8\\], labels \\[4\\]; test "
                                         "features \\[2, 6\\], labels \\[2\\]"):
        eval_knn.main(args)
    train = torch.tensor([[3.0, 0.0], [0.0, 0.5], [-2.0, 0.1]])      # another tool's: unnormalised, float64, int32
    for name, value in zip(eval_knn.FEATURE_FILES, (train.double(), torch.tensor([0, 1, 2], dtype=torch.int32),
                                                    torch.tensor([[0.2, 0.9]]), torch.tensor([1]))):
        torch.save(value, tmp_path / name)
    assert eval_knn.main(args) == {1: (100.0, None)}      # cosine, not dot product: [3, 0] is not the nearest
    torch.save(torch.tensor([[float("nan"), 1.0]]), tmp_path / "testfeat.pth")
    with pytest.raises(SystemExit, match="holds non-finite features \\(NaN or inf\\): there is no k-NN result"):
        eval_knn.main(args)


@pytest.mark.parametrize("flags, named", [
    (["--pretrained_weights", "other.pth", "--arch", "swin_pico3"], "--pretrained_weights, --arch would be ignored; "
                                                                    "drop them"),
    (["--data_path", "elsewhere"], "--data_path would be ignored; drop it"),
    (["--random_init"], "--random_init would be ignored"), (["--crop", "32"], "--crop would be ignored"),
    (["--dump_features", "again"], "--dump_features would be ignored")])
def test_eval_knn_load_features_refuses_the_model_and_data_flags_it_would_ignore(tmp_path, flags, named):
    """Saved features are all --load_features evaluates: another checkpoint or dataset beside them is not used."""
    for name, value in zip(eval_knn.FEATURE_FILES, (torch.eye(2), torch.tensor([0, 1]), torch.eye(2),
                                                    torch.tensor([0, 1]))):
        torch.save(value, tmp_path / name)
    argv = ["--load_features", str(tmp_path), "--nb_knn", "1"]
    assert eval_knn.main(parse(eval_knn, [*argv, "--temperature", "0.1"])) == {1: (100.0, None)}   # k-NN flags apply
    with pytest.raises(SystemExit, match=f"--load_features {tmp_path} evaluates saved features: {named}"):
        eval_knn.main(parse(eval_knn, [*argv, *flags]))
    assert not (Path.cwd() / "again").exists()


def test_eval_knn_dump_features_on_a_full_disk_is_one_line_and_leaves_no_part(tmp_path, monkeypatch):
    """A part would be refused by the next --dump_features (never overwritten) and --load_features (incomplete)."""
    opened = []

    writer = common.open_for_writing

    def open_until_the_disk_is_full(path, mode="w"):
        opened.append(path)
        return open("/dev/full", mode) if len(opened) > 2 else writer(path, mode)  # ENOSPC from the 3rd
    monkeypatch.setattr(common, "open_for_writing", open_until_the_disk_is_full)
    tensors = (torch.eye(2), torch.tensor([0, 1]), torch.eye(2), torch.tensor([0, 1]))
    with pytest.raises(SystemExit, match=f"cannot write {tmp_path / 'testfeat.pth'}: No space left on device"):
        eval_knn.dump_features(tmp_path, tensors)
    assert len(opened) == 3 and not list(tmp_path.iterdir())
    monkeypatch.undo()
    eval_knn.check_dump_folder(tmp_path)         # the same command again: allowed, and it writes all four
    eval_knn.dump_features(tmp_path, tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(eval_knn.FEATURE_FILES)


@pytest.mark.parametrize("flags, said", [
    (["--global_crops_scale", "0.8", "0.2"], "--global_crops_scale 0.8 0.2 is reversed"),     # was torch's traceback
    (["--local_crops_scale", "0.5", "0.1"], "--local_crops_scale 0.5 0.1 is reversed"),
    (["--local_crop_size", "48"], "--local_crop_size 48 is larger than --global_crop_size 32")])
def test_visualize_refuses_the_crop_flags_a_training_run_refuses(tmp_path, flags, said):
    """crops and matchings draw what a training run would: flags the run refuses are refused, before any data."""
    crops = ["crops", "--data_path", str(tmp_path / "missing"), "--global_crop_size", "32", "--local_crop_size", "16"]
    matchings = ["matchings", "--random_init", "--arch", "vit_pico", "--patch_size", "8", "--dataset", "synthetic",
                 "--synthetic_image_size", "32", "--global_crop_size", "32", "--local_crop_size", "16"]
    for argv in (crops, matchings):
        with pytest.raises(SystemExit, match=said):
            visualize.main(parse(visualize, [*argv, *flags, "--output", str(tmp_path / "p.png")]))
    assert not (tmp_path / "p.png").exists()
