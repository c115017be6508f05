"""The output folder: one run at a time (the kernel's `flock` on `.lock`, which a killed run
releases and which is never deleted), and records that survive a failure between an epoch's log
line and its checkpoint, or a cut last line. Its refusals (a link planted there, a file that
cannot be written) are in test_refusals.py."""
import json
import os
from pathlib import Path

import pytest

from conftest import TINY, run_here, train_tiny, hold_lock, log_records
import checks
import common


def test_the_lock_file_of_an_ended_run_is_no_lock_and_is_never_deleted(tmp_path):
    """The lock is the kernel's `flock`, not the file: a file left by a killed run (any content)
    is taken over, and the file stays (a deleted lock file could be locked twice)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("pid 4321 on host elsewhere")
    r = run_here("dino.py", *TINY, "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / ".lock").exists() and (out / "checkpoint.pth").exists()


def test_the_lock_of_a_killed_run_is_taken_over_and_a_live_one_refused_in_process(tmp_path):
    """The lock is the kernel's (flock): held while its process lives, released however it dies
    (kill -9, a node failure on NFS: the server drops the dead client's locks), so no pid or host
    has to be checked; a lock this process already holds is its own (main() called twice)."""
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(SystemExit, match=f"in use by another run \\(pid {holder.pid} on host"):
            checks.claim_output_dir(tmp_path, "dino.py")
    finally:
        holder.kill()
        holder.wait()
    checks.claim_output_dir(tmp_path, "dino.py")             # the killed holder's lock is free
    checks.claim_output_dir(tmp_path, "dino.py")             # again in the same process: its own
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on host")


def test_the_epochs_line_is_written_before_the_checkpoint_that_says_it_is_done(tmp_path,
                                                                               monkeypatch):
    """A failure after checkpoint.pth (here: teacher_backbone.pth cannot be written) used to lose
    the epoch's log line for good; now the line is written first and survives the relaunch."""
    out = tmp_path / "out"
    save = common.save_checkpoint

    def full_disk_for_the_backbone(state, path):
        if Path(path).name == "teacher_backbone.pth":
            common.die(f"cannot write {path}: No space left on device")
        save(state, path)
    monkeypatch.setattr(common, "save_checkpoint", full_disk_for_the_backbone)
    with pytest.raises(SystemExit, match="No space left"):
        train_tiny(out)
    monkeypatch.setattr(common, "save_checkpoint", save)
    train_tiny(out)  # nothing left to train: the files of the finished run are written
    assert [r["epoch"] for r in log_records(out)] == [0]
    assert (out / "teacher_backbone.pth").exists()


def test_a_resumed_run_drops_a_cut_last_line_and_the_lines_no_checkpoint_holds(tmp_path, capsys):
    out = tmp_path / "out"
    train_tiny(out)
    with open(out / "log.txt", "a") as f:
        f.write(json.dumps({"epoch": 1, "loss": 1.0}) + "\n")  # its checkpoint was never written
        f.write('{"epoch": 2, "lo')  # cut by a full disk
    train_tiny(out, "--epochs", "2")
    assert [r["epoch"] for r in log_records(out)] == [0, 1]
    assert "2 line(s) dropped" in capsys.readouterr().out
