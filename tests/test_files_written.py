"""Every file a script writes, reads back or locks is a regular file, or it is refused in one line:
a FIFO planted in --output_dir never blocks a run (a read or a write of it would wait for ever for
the other end), and no file is written through a symbolic link or replaces one unseen."""
import contextlib
import os
import signal
import sys

import pytest
from conftest import EVAL, ROOT, TINY_SMALL_HEAD, run_here

import common

PROBE = [*EVAL, "--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size",
         "32", "--n_last_blocks", "1", "--max_steps_per_epoch", "1", "--epochs", "1"]


class Blocked(Exception):
    """Not an OSError: no `suppress(OSError)` around a blocked open hides it."""


@contextlib.contextmanager
def within(seconds):
    """Fail, not hang, if the body blocks (a signal's exception ends a blocked open or read)."""
    def expired(signum, frame):
        raise Blocked(f"blocked for {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def planted(out, name, kind):
    """`out`/`name` made a FIFO, a folder or a symbolic link to a precious file."""
    out.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(out / name)
    elif kind == "folder":
        (out / name).mkdir()
    else:
        (out.parent / "precious").write_text("keep me")
        (out / name).symlink_to(out.parent / "precious")
    return out / name


@pytest.mark.parametrize("kind", ["fifo", "folder"])
@pytest.mark.parametrize("script, name", [("dino.py", "args.json"), ("dino.py", "log.txt"),
                                          ("dino.py", ".lock"), ("dino.py", "checkpoint.pth"),
                                          ("eval_linear.py", "log.txt"),
                                          ("eval_linear.py", "args.json"),
                                          ("eval_linear.py", "linear_checkpoint.pth")])
def test_a_fifo_or_folder_in_the_output_folder_is_refused_in_one_line(tmp_path, script, name,
                                                                      kind):
    path = planted(tmp_path / "out", name, kind)
    flags = TINY_SMALL_HEAD if script == "dino.py" else PROBE
    with within(30):
        result = run_here(script, *flags, "--output_dir", tmp_path / "out")
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and line.startswith(f"error: {path} is not a regular file"), line
    assert "Traceback" not in result.stderr


def test_without_the_checks_no_file_of_the_output_folder_blocks(tmp_path):
    """The functions of common.py alone (a fork without checks.py): log.txt and a checkpoint."""
    with within(30):
        for name in ("log.txt", "checkpoint.pth"):
            path = planted(tmp_path, name, "fifo")
            with pytest.raises(SystemExit, match=f"{path} is not a regular file"):
                if name == "log.txt":
                    common.keep_log_records(path, 1)
                else:
                    common.load_checkpoint(path)
            with pytest.raises(SystemExit, match=f"{path} is not a regular file"):
                common.append_log(tmp_path, {"epoch": 0}) if name == "log.txt" else (
                    common.save_checkpoint({"epoch": 0}, path))


@pytest.mark.parametrize("name", ["checkpoint.pth", "teacher_backbone.pth", "checkpoint0001.pth"])
def test_a_checkpoint_is_never_written_over_a_symbolic_link(tmp_path, name):
    link = planted(tmp_path / "out", name, "link")
    result = run_here("dino.py", *TINY_SMALL_HEAD, "--saveckp_freq", "1", "--epochs", "2",
                      "--output_dir", tmp_path / "out")
    assert result.returncode == 1, result.stdout[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {link} is a symbolic link: these scripts never write through one; remove it")
    assert link.is_symlink() and (tmp_path / "precious").read_text() == "keep me"


def test_a_picture_is_never_written_over_a_symbolic_link(tmp_path):
    sys.path.append(str(ROOT / "extras" / "tools"))
    link = planted(tmp_path / "pictures", "crops.png", "link")
    result = run_here("extras/tools/visualize.py", "crops", "--dataset", "synthetic",
                      "--synthetic_images", "4", "--synthetic_image_size", "32",
                      "--global_crop_size", "32", "--local_crop_size", "16", "--output", link)
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {link} is a symbolic link")
    assert (tmp_path / "precious").read_text() == "keep me"


def test_the_experiment_drivers_never_write_through_a_symbolic_link(tmp_path):
    """A generated document, the curves picture, a run's output log and a starting checkpoint of
    extras/experiments: each refuses a symbolic link in its place in one line, the target intact."""
    sys.path.insert(0, str(ROOT / "extras" / "experiments"))
    import curves
    import provenance
    import results
    precious = tmp_path / "precious.txt"
    precious.write_text("keep")
    links = {name: tmp_path / name for name in ("doc.md", "curves.png", "run.txt", "start.pth")}
    for link in links.values():
        link.symlink_to(precious)
    writes = [lambda: results.write_documents({links["doc.md"]: {}}),
              lambda: curves.save_curves(common.torch.zeros(3, 4, 4, dtype=common.torch.uint8),
                                         "{}", type("Args", (), {"output": links["curves.png"]})),
              lambda: provenance.run([sys.executable, "-c", "pass"], links["run.txt"])]
    for write in writes:
        with pytest.raises(SystemExit, match="is a symbolic link"):
            write()
    with pytest.raises(SystemExit, match="is a symbolic link"):
        common.save_checkpoint({"a": 1}, links["start.pth"])  # provenance.starting_checkpoint's
    assert precious.read_text() == "keep"
