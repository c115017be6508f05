"""The output folder's files: never written through a link planted there, records that survive a
failure between the epoch's log line and its checkpoint, and files that cannot be written."""
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import dino  # noqa: E402

TINY = ["--arch", "vit_pico", "--patch_size", "8", "--out_dim", "32", "--head_hidden_dim", "32",
        "--head_bottleneck_dim", "16", "--dataset", "synthetic", "--synthetic_images", "8",
        "--synthetic_image_size", "32", "--global_crop_size", "32", "--local_crop_size", "16",
        "--local_crops_number", "2", "--batch_size_per_gpu", "4", "--num_workers", "0",
        "--epochs", "1", "--warmup_epochs", "0", "--max_steps_per_epoch", "1", "--device", "cpu",
        "--precision", "fp32"]


def train(out, *extra):
    args = dino.get_args_parser().parse_args([*TINY, "--output_dir", str(out), *extra])
    dino.main(args)


def records(out):
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


@pytest.mark.parametrize("name", [".lock", "args.json", "log.txt"])
def test_a_link_planted_in_the_output_folder_is_refused_and_its_target_untouched(tmp_path, name):
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(precious)
    with pytest.raises(SystemExit, match=f"{out / name}.*symbolic link"):
        train(out)
    assert precious.read_text() == "keep me" and (out / name).is_symlink()


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
        train(out)
    monkeypatch.setattr(common, "save_checkpoint", save)
    train(out)  # nothing left to train: the files of the finished run are written
    assert [r["epoch"] for r in records(out)] == [0]
    assert (out / "teacher_backbone.pth").exists()


def test_a_resumed_run_drops_a_cut_last_line_and_the_lines_no_checkpoint_holds(tmp_path, capsys):
    out = tmp_path / "out"
    train(out)
    with open(out / "log.txt", "a") as f:
        f.write(json.dumps({"epoch": 1, "loss": 1.0}) + "\n")  # its checkpoint was never written
        f.write('{"epoch": 2, "lo')  # cut by a full disk
    train(out, "--epochs", "2")
    assert [r["epoch"] for r in records(out)] == [0, 1]
    assert "2 line(s) dropped" in capsys.readouterr().out


def test_a_file_of_the_output_folder_that_cannot_be_written_is_one_line(tmp_path):
    out = tmp_path / "out"
    (out / "args.json").mkdir(parents=True)  # (as root, a read-only file would still be written)
    with pytest.raises(SystemExit, match=r"^error: cannot use .*args.json: Is a directory"):
        common.run_script(dino.main, dino.get_args_parser(), [*TINY, "--output_dir", str(out)])


def test_a_failed_checkpoint_write_on_a_read_only_folder_is_its_own_line(tmp_path, monkeypatch):
    """The writer's clean-up of its temporary file fails too on a read-only file system: the
    line says why the checkpoint was not written, not why the clean-up failed."""
    def read_only(self, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(self))
    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(common.os, "replace", read_only)
    with pytest.raises(SystemExit, match=r"cannot write .*checkpoint.pth: Read-only file system"):
        common.save_checkpoint({"a": 1}, tmp_path / "checkpoint.pth")
