"""`--batched_crops` changes only where the crops are cut: DINO and EsViT resume mid-epoch bit for
bit with the path on and with it off (each against an uninterrupted run of the same flags; DINO's
two: tests/test_preemption_and_resume.py), and a resume that toggles it is accepted, as
one that changes the precision is (`checks.RUN_ONLY_ARGS`)."""
import pytest

from conftest import tiny, run_here, stop_at_check, load, assert_same_state


def stopped_after_two_steps(script, flags, out, monkeypatch):
    with monkeypatch.context() as patch:
        stop_at_check(patch, 2)
        first = run_here(script, *flags, "--output_dir", str(out))
    assert first.returncode == 0 and "received SIGTERM (simulated)" in first.stdout, \
        first.stderr[-3000:]


@pytest.mark.parametrize("script, batched", [("esvit.py", "true"), ("esvit.py", "false")])
def test_a_mid_epoch_resume_is_bit_identical(script, batched, tmp_path, monkeypatch):
    flags = tiny(epochs="1", saveckp_freq=None, batched_crops=batched)
    whole = run_here(script, *flags, "--output_dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped_after_two_steps(script, flags, tmp_path / "resumed", monkeypatch)
    second = run_here(script, *flags, "--output_dir", str(tmp_path / "resumed"))
    assert second.returncode == 0 and "epoch 0, step 2" in second.stdout, second.stderr[-3000:]
    assert_same_state(load(tmp_path / "whole" / "checkpoint.pth"),
                      load(tmp_path / "resumed" / "checkpoint.pth"))


@pytest.mark.parametrize("script", ["dino.py", "esvit.py"])
def test_a_resume_may_toggle_batched_crops(script, tmp_path, monkeypatch):
    flags = tiny(epochs="1", saveckp_freq=None, batched_crops="true")
    stopped_after_two_steps(script, flags, tmp_path, monkeypatch)
    second = run_here(script, *tiny(epochs="1", saveckp_freq=None, batched_crops="false"),
                      "--output_dir", str(tmp_path))
    assert second.returncode == 0 and "epoch 0, step 2" in second.stdout, second.stderr[-3000:]
    assert load(tmp_path / "checkpoint.pth")["epoch"] == 1
