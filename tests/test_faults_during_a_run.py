"""Faults during a training or evaluation run, which end it in one line or which it survives: an
error on one torchrun rank (the others stop in one line), a loader worker killed by the kernel,
out of memory (told by the exception's type; any other error keeps its traceback), a non-finite
loss, Ctrl-C, and an fp16 overflow (skipped by the grad scaler). Real processes where the
behaviour is the process's (torchrun, signals, loader workers); otherwise in this process."""
import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import tqdm

from conftest import (ROOT, ENV, TORCHRUN, TINY, tiny, run, run_here, descendants, one_line_error,
                      load)
import common


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
    r = run(*TORCHRUN, str(driver), "dino.py", *TINY, "--output_dir", str(tmp_path / "out"),
            timeout=120)
    assert r.returncode != 0
    rank0 = f"error: cannot write {tmp_path / 'out' / 'checkpoint.pth'}: No space left on device"
    others = "error: process 1 stops because another process of this run has stopped"
    assert rank0 in r.stderr and others in r.stderr
    assert (r.stderr.count("Traceback") == 1
            and f"traceback : {rank0}" in r.stderr.split("Root Cause")[1])


def test_a_killed_loader_worker_is_one_line_and_the_run_resumes(tmp_path):
    flags = [*TINY, "--max_steps_per_epoch", "0", "--output_dir", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "dino.py", *flags, "--epochs", "50", "--num_workers",
                             "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    # after the first epoch
    while not (tmp_path / "checkpoint.pth").exists() and time.time() < deadline:
        time.sleep(0.2)
    workers = descendants(proc.pid)
    assert workers, "no loader worker"
    for worker in workers:
        # as the kernel's out-of-memory killer does
        os.kill(worker, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    last = one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          "a data loader worker (pid")
    assert ("(most likely the kernel's out-of-memory killer; its own error, if any, is above)"
            in last)
    assert "run the same command with fewer --num_workers (now 1) to resume" in last
    assert f"the last checkpoint is {tmp_path / 'checkpoint.pth'}" in last
    epoch = torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"]
    again = run("dino.py", *flags, "--epochs", str(epoch + 1), "--num_workers", "0")
    assert (again.returncode == 0
            and f"resumed from {tmp_path / 'checkpoint.pth'} at epoch {epoch}" in again.stdout)


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
    monkeypatch.setattr(common, "dead_loader_worker",
                        lambda wait: "(pid 4242) was killed by SIGKILL")
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
        with pytest.raises(SystemExit,
                           match=r"^error: a data loader worker \(pid 4242\) was killed by "
                                 r"SIGKILL \(most likely the kernel's out-of-memory killer"):
            common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])
        workers[:] = [FakeWorker(None)]
        with pytest.raises(ConnectionResetError):
            common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_worker_killed_by_sigbus_names_a_full_dev_shm(monkeypatch):
    """SIGBUS is how a worker dies that writes its batch past the end of a full /dev/shm: the
    line names /dev/shm and its remedies, not the out-of-memory killer."""
    def main(args):
        common._loader_workers[:] = [FakeWorker(-signal.SIGBUS)]
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error.")
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        with pytest.raises(SystemExit) as stop:
            common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert str(stop.value.code).startswith(
        "error: a data loader worker (pid 4242) was killed by SIGBUS (most likely a full /dev/shm: "
        "run the container with a larger --shm-size or --ipc=host;")
    assert "out-of-memory" not in str(stop.value.code)


@pytest.mark.parametrize("batched, free_mib, warned", [(False, 64, True), (True, 64, False),
                                                       (True, 8, True), (False, 10 ** 6, False)])
def test_a_dev_shm_smaller_than_the_loaders_queue_is_one_warning(monkeypatch, capsys, batched,
                                                                 free_mib, warned):
    """Docker's default /dev/shm is 64 MiB. 2 workers of batches of 16 DINO samples (2 x 224 +
    8 x 96 px crops) queue 5 x 16 x 2.1 MB, 159 MiB, of float32 crops; of uint8 images about a
    quarter of that, 40 MiB."""
    usage = common.shutil.disk_usage("/")._replace(free=free_mib * 2 ** 20)
    monkeypatch.setattr(common.shutil, "disk_usage", lambda path: usage)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dataset = common.SeededDataset(list(range(32)), common.MultiCropAugmentation(), batched=batched)
    common.make_loader(dataset, 16, num_workers=2)
    common.make_loader(dataset, 16, num_workers=0)  # no worker: nothing goes through /dev/shm
    lines = capsys.readouterr().out.splitlines()
    expected = [f"warning: /dev/shm has {free_mib} MiB free, the batches of 2 loader workers a "
                f"process need about {40 if batched else 159} MiB: give the container more (docker "
                f"run --shm-size=2g, or --ipc=host) or use fewer --num_workers"]
    assert lines == (expected if warned else [])


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
    assert stop.value.code == (f"error: out of memory ({reason}); lower --batch_size_per_gpu "
                               f"(now 64) or the crop and image sizes")


def test_an_error_that_is_not_memory_keeps_its_traceback():
    """Only an allocation failure becomes the memory line: another RuntimeError from torch is raised
    as it is (its text is never read)."""
    def main(args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        common.run_script(common.one_line_exits(main), argparse.ArgumentParser(), argv=[])


def test_nonfinite_loss_error_is_the_last_line(tmp_path):
    # merge: as 2>&1, bars and lines
    r = run_here("dino.py", *TINY, "--max_steps_per_epoch", "2", "--lr", "1e30", "--clip_grad", "0",
                 "--warmup_epochs", "0", "--optimizer", "sgd", "--output_dir", str(tmp_path),
                 merge=True)
    assert r.returncode == 1
    lines = [line for line in r.stdout.replace("\r", "\n").splitlines() if line.strip()]
    assert (lines[-2].startswith("error: the loss is")
            and lines[-1].startswith("Likely causes:")), lines[-3:]


def test_ctrl_c_names_the_last_checkpoint_without_a_traceback(tmp_path):
    args = [*TINY, "--epochs", "50", "--max_steps_per_epoch", "0", "--output_dir", str(tmp_path)]
    # A shell without job control starts background commands with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: give the child the default disposition a terminal
    # gives.
    proc = subprocess.Popen([sys.executable, "dino.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    # after the first epoch
    while not (tmp_path / "checkpoint.pth").exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert (proc.returncode == 130 and "Traceback" not in err
            and "KeyboardInterrupt" not in err), err[-3000:]
    last = err.strip().splitlines()[-1]
    checkpoint = tmp_path / "checkpoint.pth"
    assert last.startswith(f"interrupted (Ctrl-C): the last checkpoint is {checkpoint}"), last
    assert "run the same command again to resume" in last


def test_fp16_overflow_is_skipped_by_the_grad_scaler_without_stopping(tmp_path, monkeypatch):
    """Issue: "fp16 overflow is handled by the grad scaler without stopping". fp16 autocast runs on
    CPU (slowly) for this test: every step overflows, is skipped, and the scale halves."""
    # a grad scaler that starts at a scale that makes every gradient overflow
    monkeypatch.setattr(common, "make_grad_scaler", lambda device,
                        precision: torch.amp.GradScaler(device.type, init_scale=2.0 ** 40))
    result = run_here("dino.py", *tiny(epochs="1"), "--precision", "fp16", "--output_dir",
                      str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = load(tmp_path / "checkpoint.pth")
    assert ckpt["scaler"]["scale"] == 2.0 ** 40 / 2 ** 3          # 3 steps, 3 overflows
    assert ckpt["optimizer"]["state"] == {}                        # AdamW never stepped
