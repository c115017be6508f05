"""Preemption and exact resume of the training scripts on the `synthetic` data (tiny sizes, CPU):
resumes at an epoch boundary and mid-epoch bit-identical to an uninterrupted run, 2 processes
equal to 1, SIGTERM to a process, to a whole job (torchrun, loader workers) or to the launcher
alone, a step blocked past the grace period, a dead save's temporaries, and --epochs lowered to
the epochs trained. A run is a real subprocess where the behaviour is the process's (signals,
torchrun); otherwise the script's own entry point runs in this process (`run_here`)."""
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (ROOT, ENV, TINY, DRLOC_TINY, tiny, DINO_TINY, on_folder, run_here, start,
                      finish, parse, stop_at_check, descendants, image_folder, load,
                      assert_same_state, assert_same_trajectory)
import common


def test_resume_at_epoch_boundary_is_bit_identical(dino_uninterrupted, tmp_path):
    shutil.copy(dino_uninterrupted / "checkpoint0001.pth", tmp_path / "checkpoint.pth")
    result = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "epoch 1, step 0" in result.stdout
    assert_same_state(load(dino_uninterrupted / "checkpoint.pth"),
                      load(tmp_path / "checkpoint.pth"))


def test_resume_mid_epoch_is_bit_identical(dino_uninterrupted, tmp_path, monkeypatch):
    # stop after the 2nd step of epoch 0 (the 2nd check), as a preempted job would
    with monkeypatch.context() as patch:
        stop_at_check(patch, 2)
        first = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    assert ("received SIGTERM (simulated)" in first.stdout
            and "run the same command again to resume" in first.stdout)
    ckpt = load(tmp_path / "checkpoint.pth")
    assert (ckpt["epoch"], ckpt["step"]) == (0, 2)
    second = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "epoch 0, step 2" in second.stdout
    assert_same_state(load(dino_uninterrupted / "checkpoint.pth"),
                      load(tmp_path / "checkpoint.pth"))


def test_resume_mid_epoch_with_batched_crops_is_bit_identical(tmp_path, monkeypatch):
    """--batched_crops: the draws depend on (seed, epoch, index) only, wherever the crops are
    cut: a run stopped after its 2nd step and resumed ends as an uninterrupted one."""
    flags = tiny(epochs="1", saveckp_freq=None, batched_crops="true")
    whole = run_here("dino.py", *flags, "--output_dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    with monkeypatch.context() as patch:
        stop_at_check(patch, 2)
        first = run_here("dino.py", *flags, "--output_dir", str(tmp_path / "resumed"))
    assert first.returncode == 0 and "received SIGTERM (simulated)" in first.stdout
    second = run_here("dino.py", *flags, "--output_dir", str(tmp_path / "resumed"))
    assert second.returncode == 0 and "epoch 0, step 2" in second.stdout, second.stderr[-3000:]
    assert_same_state(load(tmp_path / "whole" / "checkpoint.pth"),
                      load(tmp_path / "resumed" / "checkpoint.pth"))


def test_save_every_iters_writes_mid_epoch_checkpoints(tmp_path, monkeypatch):
    real, written = common.save_checkpoint, []

    def save_checkpoint(state, path):        # every checkpoint the run writes
        written.append(f"saved {path.name} epoch {state.get('epoch')} step {state.get('step')}")
        real(state, path)
    monkeypatch.setattr(common, "save_checkpoint", save_checkpoint)
    result = run_here("dino.py", *tiny(epochs="1", max_steps_per_epoch="5", save_every_iters="2"),
                      "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    saves = [line for line in written if line.startswith("saved checkpoint.pth")]
    assert saves == ["saved checkpoint.pth epoch 0 step 2", "saved checkpoint.pth epoch 0 step 4",
                     "saved checkpoint.pth epoch 1 step 0"]


def test_two_processes_equal_one_process(tmp_path):
    """torchrun --nproc_per_node=2 with batch b per process == one process with batch 2b
    (same data order and crops, averaged gradients, all-reduced centers); drop path off."""
    args = tiny(drop_path_rate="0", epochs="1")
    two = start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "dino.py",
                *args, "--batch_size_per_gpu", "4", "--output_dir", str(tmp_path / "two"))
    one = run_here("dino.py", *args, "--batch_size_per_gpu", "8", "--output_dir",
                   str(tmp_path / "one"))  # meanwhile
    two = finish(two)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load(tmp_path / "one" / "checkpoint.pth"), load(tmp_path / "two" / "checkpoint.pth")
    assert len(b["rng"]) == 2 and len(a["rng"]) == 1
    keys = ("student", "teacher", "dino_loss", "optimizer")
    assert_same_trajectory({k: a[k] for k in keys}, {k: b[k] for k in keys})
    moved = sum((a["student"][k] - a["teacher"][k]).abs().sum() for k in a["student"])
    assert moved > 0   # the runs trained: student and teacher differ


def test_a_temporary_left_by_a_killed_save_is_written_over_by_the_next(dino_uninterrupted,
                                                                         tmp_path):
    """A `kill -9` during a save leaves `.checkpoint.pth.tmp` beside the intact checkpoint: the
    resumed run's next save of that file writes over it and renames it (none accumulate)."""
    shutil.copy(dino_uninterrupted / "checkpoint.pth", tmp_path / "checkpoint.pth")
    stale = tmp_path / ".checkpoint.pth.tmp"
    stale.write_bytes(b"partial")
    r = run_here("dino.py", *tiny(epochs="3"), "--output_dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not stale.exists() and not list(tmp_path.glob(".*.tmp*"))
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 3


SSL_FLAGS = {"dino": TINY, "esvit": TINY, "glsd": TINY, "selfpatch": [*TINY, "--patch_size", "8",
                                                                      "--local_crop_size", "24",
                                                                      "--patch_out_dim", "32"]}


def preempted_after_first_epoch(monkeypatch, output_dir):
    """A preemption signal arrives once the first epoch's checkpoint is written."""
    monkeypatch.setattr(common, "preemption_requested",
                        lambda device: (output_dir / "checkpoint.pth").exists())


@pytest.mark.parametrize("method", ["dino", "esvit", "glsd", "selfpatch", "drloc"])
def test_lowering_epochs_to_those_trained_writes_what_the_done_line_names(tmp_path, monkeypatch,
                                                                          capsys, method):
    module = importlib.import_module(method)
    flags = [*(DRLOC_TINY if method == "drloc" else SSL_FLAGS[method]), "--output_dir",
             str(tmp_path)]
    with monkeypatch.context() as patched:
        preempted_after_first_epoch(patched, tmp_path)
        # exit 0 (torch's `record` returns for it)
        assert module.main(parse(module, [*flags, "--epochs", "3"])) is None
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 1
    backbone_file, network = ("backbone.pth",
                              "model") if method == "drloc" else ("teacher_backbone.pth", "teacher")
    assert not (tmp_path / backbone_file).exists()
    started = time.time_ns()
    capsys.readouterr()
    # the epoch already trained: nothing left to train
    module.main(parse(module, [*flags, "--epochs", "1"]))
    lines = capsys.readouterr().out.strip().splitlines()
    done = f"nothing left to train: {tmp_path / 'checkpoint.pth'} has trained all 1 epochs"
    assert any(line.startswith(done) for line in lines), lines[-3:]
    named = Path(lines[-1].split(": ")[-1])
    assert (lines[-1].startswith("done;") and named.parent == tmp_path
            and named.stat().st_mtime_ns >= started)
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    backbone = torch.load(tmp_path / backbone_file, weights_only=True)
    assert ckpt["epoch"] == 1
    assert backbone.keys() == {k[9:] for k in ckpt[network] if k.startswith("backbone.")}
    assert all(torch.equal(v, ckpt[network][f"backbone.{k}"]) for k, v in backbone.items())


# ------------------------------------------------------------------------------------------------
# Preemption: SIGTERM to a process, to a whole job, to the launcher; a step that never ends
# ------------------------------------------------------------------------------------------------

def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path):
    args = [*tiny(max_steps_per_epoch="0", epochs="50"), "--output_dir", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "dino.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    for line in proc.stdout:            # the handler is installed before the data are built
        if line.startswith("data:"):
            break
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "received SIGTERM" in out and "run the same command again to resume" in out
    ckpt = load(tmp_path / "checkpoint.pth")
    assert ckpt["epoch"] < 50
    resumed = run_here("dino.py", *tiny(max_steps_per_epoch="0", epochs=str(ckpt["epoch"] + 1)),
                       "--output_dir", str(tmp_path))
    # a different --epochs changes the schedules, but the run must still load and continue
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from {tmp_path / 'checkpoint.pth'} at epoch {ckpt['epoch']}, "
            f"step {ckpt['step']}" in resumed.stdout)


def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_resumes(tmp_path):
    """SLURM and torchrun signal every process of a job, loader workers included: the workers must
    not die of it before their training process has written its checkpoint."""
    args = [*tiny(max_steps_per_epoch="0", epochs="50", synthetic_images="64", num_workers="2"),
            "--output_dir", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen([*torchrun, "dino.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("data:"):
            break
    deadline = time.time() + 60   # 1 agent -> 2 training processes -> 2 loader workers each
    while len(descendants(proc.pid)) < 6 and time.time() < deadline:
        time.sleep(0.2)
    assert len(descendants(proc.pid)) >= 6, "the loader workers never started"
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert "is killed by signal" not in err, err[-3000:]
    assert "received SIGTERM" in out, err[-3000:]
    ckpt = load(tmp_path / "checkpoint.pth")
    assert ckpt["epoch"] < 50 and len(ckpt["rng"]) == 2
    end = str(ckpt["epoch"] + 1)
    resumed = subprocess.run([*torchrun, "dino.py", *args, "--epochs", end], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at epoch {ckpt['epoch']}, step {ckpt['step']}" in resumed.stdout
    assert load(tmp_path / "checkpoint.pth")["epoch"] == int(end)


BLOCKED_STEP = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
import common, dino
real = common.load_image
def load_image(path):              # epoch 1 blocks on a read that never returns
    return open({fifo!r}).read() if Path({checkpoint!r}).exists() else real(path)
common.load_image = load_image
common.run_script(dino.main, dino.get_args_parser(), {argv!r})
"""


def test_sigterm_ends_a_step_blocked_on_a_read_within_the_grace_period(tmp_path):
    image_folder(tmp_path / "data" / "train", ["a", "b"])
    os.mkfifo(tmp_path / "fifo")
    argv = [*on_folder(TINY, tmp_path / "data"), "--epochs", "2", "--output_dir",
            str(tmp_path / "out")]
    checkpoint = tmp_path / "out" / "checkpoint.pth"
    code = BLOCKED_STEP.format(root=str(ROOT), fifo=str(tmp_path / "fifo"), argv=argv,
                               checkpoint=str(checkpoint))
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**ENV,
                                                                   "PREEMPTION_GRACE_SECONDS": "2"})
    # epoch 0 is checkpointed: epoch 1's first step is reading
    for line in job.stdout:
        if "epoch=0" in line:
            break
    time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    try:
        _out, err = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        pytest.fail("the run was still alive 30 s after SIGTERM")
    assert job.returncode == 1 and "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: received SIGTERM, but the step did not reach its checkpoint "
                           "within 2 s")
    assert "(a read that never returns?); the last checkpoint, if any, is kept" in line
    assert line.endswith("run the same command again to resume"), line
    assert checkpoint.exists()


def test_the_process_group_outlasts_rank_0s_long_work(monkeypatch):
    """NCCL's default watchdog (10 minutes) ended a job while rank 0 wrote a large checkpoint."""
    seen = {}
    monkeypatch.setattr(common.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    common.init_distributed("cpu")
    assert seen["timeout"].total_seconds() >= 30 * 60


def running(pid):
    """Alive and not a zombie (an orphan's reaper may be slow)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_end_when_the_torchrun_launcher_is_killed(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", "1", str(ROOT / "dino.py"), *TINY, "--epochs",
                                 "10000", "--output_dir", str(tmp_path / "out")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=ENV)
    for line in launcher.stdout:           # the worker trains
        if line.startswith("data:"):
            break
    workers = descendants(launcher.pid)
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(map(running, workers)):
        time.sleep(0.2)
    alive = [pid for pid in workers if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert workers and not alive, "the worker ran on alone after its launcher's SIGKILL"
    rest = launcher.stdout.read()
    assert "received SIGTERM: checkpoint written to" in rest, rest[-2000:]
