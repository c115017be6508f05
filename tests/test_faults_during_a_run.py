"""Faults during a training or evaluation run, which end it in one line or which it survives: a
user's mistake, an unreadable image and Ctrl-C end in one line (also in torchrun's error file);
an error whose cause torch names (a dead loader worker, out of memory, a lost peer) keeps torch's
own message, and torchrun's error file comes from torch's `record`; a non-finite loss stops with
advice; an fp16 overflow is skipped by the grad scaler. Real processes where the behaviour is the
process's (torchrun, signals, loader workers); otherwise in this process."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, ENV, TORCHRUN, TINY, tiny, run, run_here, descendants, load
import checks
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


def test_an_error_on_one_torchrun_rank_is_the_root_cause_torchrun_reports(tmp_path):
    """Rank 0 alone writes checkpoints; when it stops (here: a full disk, one line), rank 1's next
    collective fails with torch's own error. torchrun's report names rank 0's line as the root
    cause, from the error file that `record` (`checks.one_line_exits`) writes."""
    driver = tmp_path / "full_disk.py"
    driver.write_text(FULL_DISK_ON_RANK_0)
    r = run(*TORCHRUN, str(driver), "dino.py", *TINY, "--output_dir", str(tmp_path / "out"),
            timeout=120)
    assert r.returncode != 0
    rank0 = f"error: cannot write {tmp_path / 'out' / 'checkpoint.pth'}: No space left on device"
    assert rank0 in r.stderr
    assert rank0 in r.stderr.split("Root Cause")[1].split("Other Failures")[0]


def test_a_killed_loader_worker_keeps_torchs_message_and_the_run_resumes(tmp_path):
    """torch names a loader worker killed by the kernel (its text is not read here); the run
    resumes from its last checkpoint."""
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
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" in err, err[-2000:]
    epoch = torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"]
    again = run("dino.py", *flags, "--epochs", str(epoch + 1), "--num_workers", "0")
    assert (again.returncode == 0
            and f"resumed from {tmp_path / 'checkpoint.pth'} at epoch {epoch}" in again.stdout)


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."),
    MemoryError("Unable to allocate 74.5 GiB for an array"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
    ConnectionResetError(104, "Connection reset by peer")])
def test_an_error_torch_names_keeps_its_type_and_message(error):
    """Out of memory, a broken connection, any error not the user's: raised as it is, its text
    never read."""
    def main(args):
        raise error
    with pytest.raises(type(error)) as raised:
        common.run_script(checks.one_line_exits(main), argparse.ArgumentParser(), argv=[])
    assert raised.value is error


def test_torchruns_error_file_holds_a_users_mistake_and_any_other_error(tmp_path, monkeypatch):
    """The file that torchrun reports from: a `die` line as it is (no traceback of ours); another
    error as torch's `record` writes it, with its traceback."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def mistake(args):
        common.die("--arch vit_huge is unknown")
    with pytest.raises(SystemExit, match="^error: --arch vit_huge is unknown$"):
        common.run_script(checks.one_line_exits(mistake), argparse.ArgumentParser(), argv=[])
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message == "error: --arch vit_huge is unknown"

    def crash(args):
        raise ValueError("a bug")
    with pytest.raises(ValueError):
        common.run_script(checks.one_line_exits(crash), argparse.ArgumentParser(), argv=[])
    assert json.loads(error_file.read_text())["message"]["message"] == "ValueError: a bug"


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
