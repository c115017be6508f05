"""eval_linear.py keeps its log and stops on a preemption signal as the training scripts do: the
epoch's line before the checkpoint that marks the epoch done, a cut last line dropped on resume,
and on SIGTERM or SIGUSR1 (at an epoch's end or mid-epoch) linear_checkpoint.pth written, one
line, exit 0, and a resume that ends where an uninterrupted run ends."""
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ENV, EVAL, ROOT, log_records, run_here, stop_at_check

import common

PROBE = [*EVAL, "--dataset", "synthetic", "--synthetic_images", "48", "--synthetic_image_size",
         "32", "--n_last_blocks", "1", "--max_steps_per_epoch", "3", "--epochs", "2"]


def probe(out, *extra):
    result = run_here("eval_linear.py", *PROBE, "--output_dir", out, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_epochs_line_is_logged_before_the_checkpoint_that_marks_it_done(tmp_path,
                                                                              monkeypatch):
    seen = []
    real = common.save_checkpoint

    def save_checkpoint(state, path):
        seen.append((state["epoch"], [r["epoch"] for r in log_records(tmp_path)]))
        real(state, path)
    monkeypatch.setattr(common, "save_checkpoint", save_checkpoint)
    probe(tmp_path)
    assert seen == [(1, [0]), (2, [0, 1])]


def test_a_cut_last_line_is_dropped_on_resume(tmp_path):
    probe(tmp_path, "--epochs", "1")
    with open(tmp_path / "log.txt", "a") as f:
        f.write('{"train_loss": 2.3, "epo')  # a write cut by a full disk or a kill
    result = probe(tmp_path)
    assert "1 line(s) dropped" in result.stdout
    assert [r["epoch"] for r in log_records(tmp_path)] == [0, 1]


@pytest.mark.parametrize("check", [2, 4], ids=["mid-epoch", "at-the-epochs-end"])
def test_a_preempted_probe_checkpoints_exits_0_and_resumes_to_the_same_probe(tmp_path,
                                                                              monkeypatch, check):
    """Preemption checks: one per step (3 an epoch), then one at the epoch's end: the 2nd is
    mid-epoch 0, the 4th at epoch 0's end."""
    probe(tmp_path / "whole")
    with monkeypatch.context() as patched:
        stop_at_check(patched, check)
        result = probe(tmp_path / "cut")
    checkpoint = tmp_path / "cut" / "linear_checkpoint.pth"
    assert result.stdout.strip().splitlines()[-1] == (
        f"received SIGTERM (simulated): checkpoint written to {checkpoint}; run the same command "
        f"again to resume")
    saved = torch.load(checkpoint, weights_only=True)
    assert (saved["epoch"], saved["step"]) == ((0, 2) if check == 2 else (1, 0))
    resumed = probe(tmp_path / "cut")
    assert f"at epoch {saved['epoch']}, step {saved['step']}" in resumed.stdout
    whole, cut = (torch.load(tmp_path / d / "linear_checkpoint.pth", weights_only=True)
                  for d in ("whole", "cut"))
    assert all(torch.equal(whole["linear"][k], cut["linear"][k]) for k in whole["linear"])
    assert whole["best_top1"] == cut["best_top1"]
    assert [r["epoch"] for r in log_records(tmp_path / "cut")] == [0, 1]


def test_sigterm_stops_the_probe_with_its_checkpoint(tmp_path):
    args = [*PROBE, "--epochs", "200", "--precomputed_features", "true", "--output_dir",
            str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "eval_linear.py", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # (progress bars on stderr: read, or the pipe fills)
        if " epoch=0 " in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("received SIGTERM: checkpoint written to "
                                                   f"{tmp_path / 'linear_checkpoint.pth'}")
    saved = torch.load(tmp_path / "linear_checkpoint.pth", weights_only=True)
    assert 1 <= saved["epoch"] < 200
    resumed = probe(tmp_path, "--precomputed_features", "true", "--epochs",
                    str(saved["epoch"] + 1))
    assert f"resumed from {tmp_path / 'linear_checkpoint.pth'} at epoch" in resumed.stdout
