"""The third probe of the fault table (docs/ERRORS.md): damaged checkpoints, held-out splits drawn
from a class-sorted folder, image folders with other splits, hidden folders or FIFOs inside, a
preemption that a blocked read would outlast, resumes that the processes of one job decide
apart, and numbers that the libraries cannot hold. Runs are in process on tiny data, except
where the behaviour is the process's (signals, torchrun)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from test_faults import ENV, EVAL, TINY, image_folder  # noqa: E402
from test_reliability import descendants, run_here, stop_at_check  # noqa: E402


def on_folder(flags, data_path):
    """`flags` with --dataset folder --data_path `data_path` in place of the synthetic dataset."""
    synthetic = {"--dataset", "--synthetic_images", "--synthetic_image_size"}
    kept = [f for i, f in enumerate(flags) if f not in synthetic and flags[i - 1] not in synthetic]
    return [*kept, "--dataset", "folder", "--data_path", str(data_path)]


def last_line(result):
    """die()'s line, last on stderr, with no traceback above it."""
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------
# Damaged checkpoints: flipped bits, and a pickle that would run code
# ------------------------------------------------------------------------------------------------
def test_flipped_bytes_in_a_tensor_of_checkpoint_pth_are_refused(tmp_path):
    out = tmp_path / "run"
    assert run_here("dino.py", *TINY, "--output_dir", str(out)).returncode == 0
    path = out / "checkpoint.pth"
    data = bytearray(path.read_bytes())
    weights = data.find(b"data/0") + 200       # inside the first tensor's bytes (past its file header)
    data[weights] ^= 0x10
    data[weights + 1] ^= 0x01
    path.write_bytes(bytes(data))
    line = last_line(run_here("dino.py", *TINY, "--epochs", "2", "--output_dir", str(out)))
    assert line.startswith("error: checkpoint ") and "is damaged: the checksum of its entry" in line, line


class RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_pickle_that_would_run_code_is_refused_without_torchs_advice(tmp_path):
    torch.save({"teacher": RunsCode()}, tmp_path / "w.pth")
    with pytest.raises(SystemExit) as stop:
        common.load_checkpoint(tmp_path / "w.pth")
    line = str(stop.value.code)
    assert "holds more than tensors and plain values (Unsupported global: GLOBAL print)" in line, line
    assert "truncated" not in line and "weights_only" not in line, line


# ------------------------------------------------------------------------------------------------
# --holdout: of a folder (sorted by class), N images drawn with a fixed seed; elsewhere the last N
# ------------------------------------------------------------------------------------------------
def test_holdout_of_a_class_sorted_folder_is_drawn_from_every_class(tmp_path):
    image_folder(tmp_path / "train", ["a", "b", "c"], per_class=6)
    args = Namespace(dataset="folder", data_path=str(tmp_path), holdout=6, skip_bad_images=False)
    train, held = common.build_eval_splits(args)
    assert len(set(held.dataset.targets[i] for i in held.indices)) > 1        # it was class c alone
    assert sorted(train.indices + held.indices) == list(range(18))
    again = common.build_dataset(args, train=False)          # every script, every run: one split
    assert again.indices == held.indices


def test_holdout_of_a_named_dataset_is_still_its_last_images():
    """The logged results' validation splits (Fashion-MNIST, synthetic) stay as they were."""
    args = Namespace(dataset="synthetic", data_path=None, holdout=5, synthetic_images=20,
                     synthetic_image_size=16, synthetic_seed=0)
    assert list(common.build_dataset(args, train=False).indices) == list(range(15, 20))
    assert list(common.build_dataset(args, train=True).indices) == list(range(15))


# ------------------------------------------------------------------------------------------------
# Image folders: no train/ beside val/, hidden folders, files that are not regular
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["dino.py", "eval_knn.py"])
def test_a_data_path_without_train_but_with_val_is_refused(tmp_path, script):
    image_folder(tmp_path / "training", ["a", "b"])
    image_folder(tmp_path / "val", ["a", "b"])
    flags = [*TINY, "--output_dir", str(tmp_path / "out")] if script == "dino.py" else [*EVAL, "--nb_knn", "2"]
    result = run_here(script, *on_folder(flags, tmp_path))
    line = last_line(result)
    assert f"--data_path {tmp_path} has no train/ folder but has val/" in line, line


def test_hidden_folders_and_files_are_no_class_and_no_image(tmp_path):
    image_folder(tmp_path / "train", ["a", "b"])
    image_folder(tmp_path / "train" / ".ipynb_checkpoints", ["x"])
    shutil.copy(tmp_path / "train" / "a" / "0.png", tmp_path / "train" / "b" / "._0.png")
    train = common.build_dataset(Namespace(dataset="folder", data_path=str(tmp_path), holdout=0), train=True)
    assert train.classes == ["a", "b"] and len(train) == 8


# ------------------------------------------------------------------------------------------------
# esvit.py --init_from a mid-epoch checkpoint of longer epochs
# ------------------------------------------------------------------------------------------------
def test_init_from_a_step_past_this_runs_epoch_is_refused(tmp_path, monkeypatch):
    view = tmp_path / "view"
    two_steps = [*TINY, "--max_steps_per_epoch", "2", "--synthetic_images", "24"]
    with monkeypatch.context() as patched:
        stop_at_check(patched, 1)                  # preempted after step 1 of 2
        result = run_here("esvit.py", *two_steps, "--use_region_loss", "false", "--output_dir", str(view))
    assert result.returncode == 0 and torch.load(view / "checkpoint.pth", weights_only=True)["step"] == 1
    result = run_here("esvit.py", *TINY, "--epochs", "2", "--output_dir", str(tmp_path / "full"),
                      "--init_from", str(view / "checkpoint.pth"))     # 1 step per epoch
    assert "stopped after step 1 of epoch 0, but this run's epochs have 1 steps" in last_line(result)


# ------------------------------------------------------------------------------------------------
# A preemption ends the job within its grace period, whatever the loader does
# ------------------------------------------------------------------------------------------------
def test_a_fifo_in_an_image_folder_is_not_listed(tmp_path):
    image_folder(tmp_path / "train", ["a", "b"])
    os.mkfifo(tmp_path / "train" / "a" / "pipe.png")          # reading it would block for ever
    train = common.build_dataset(Namespace(dataset="folder", data_path=str(tmp_path), holdout=0), train=True)
    assert len(train) == 8 and not any("pipe" in path for path, _ in train.samples)


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
    argv = [*on_folder(TINY, tmp_path / "data"), "--epochs", "2", "--output_dir", str(tmp_path / "out")]
    checkpoint = tmp_path / "out" / "checkpoint.pth"
    code = BLOCKED_STEP.format(root=str(ROOT), fifo=str(tmp_path / "fifo"), argv=argv,
                               checkpoint=str(checkpoint))
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**ENV, "PREEMPTION_GRACE_SECONDS": "2"})
    for line in job.stdout:                # epoch 0 is checkpointed: epoch 1's first step is reading
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
    assert line.startswith("error: received SIGTERM, but the step did not reach its checkpoint within 2 s")
    assert "(a read that never returns?); the last checkpoint, if any, is kept" in line
    assert line.endswith("run the same command again to resume"), line
    assert checkpoint.exists()


# ------------------------------------------------------------------------------------------------
# Several machines: rank 0 decides whether the job resumes
# ------------------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_node_that_cannot_see_the_checkpoint_stops_the_job(tmp_path):
    """Two "nodes" on localhost, each its own working folder: a relative --output_dir is not shared,
    so node 1 finds no checkpoint.pth where node 0 resumes (it used to start at epoch 0 and hang)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    assert run_here("dino.py", *TINY, "--output_dir", str(nodes[0] / "out")).returncode == 0
    port, jobs = free_port(), []
    for rank, node in enumerate(nodes):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                    "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
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
    expected = (f"error: process 1 (host {socket.gethostname()}) cannot read the out/checkpoint.pth that "
                f"process 0 resumes from (epoch 1, step 0; it finds no file)")
    for err in errors:
        assert expected in err and "Traceback (most recent call last):\n  File \"" + str(ROOT) not in err


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
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "1", str(ROOT / "dino.py"), *TINY, "--epochs", "10000", "--output_dir",
                                 str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=ENV)
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


# ------------------------------------------------------------------------------------------------
# Numbers the libraries cannot hold
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, expected", [
    ("--seed", "4294967296", "is too large: expected at most 2147483647"),      # numpy's seed: a traceback
    ("--teacher_temp", "1e-50", "is out of float32's range, where it would be 0"),  # logits / 0: NaN
    ("--lr", "1e39", "is out of float32's range, where it would be inf")])
def test_numbers_past_what_the_libraries_hold_are_refused_by_argparse(capsys, flag, value, expected):
    import dino
    with pytest.raises(SystemExit) as stop:
        dino.get_args_parser().parse_args([flag, value])
    assert stop.value.code == 2 and f"argument {flag}: {value} {expected}" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["dino.py", "eval_linear.py"])
def test_an_enormous_epochs_is_refused_not_out_of_memory(tmp_path, script):
    """The schedules hold a value per step: 2**31 - 1 epochs of 6 steps were 1.3e10 values a
    schedule (103 GB), reported as out of memory. --epochs is at most 10,000 (DINO's longest: 800)."""
    r = run_here(script, "--epochs", "2147483647", "--output_dir", str(tmp_path))
    assert "argument --epochs: 2147483647 is out of range: expected a value in [1, 10000]" in r.stderr


# ------------------------------------------------------------------------------------------------
# Smaller: a wrapped weights file, gpu_check's unknown part
# ------------------------------------------------------------------------------------------------
def test_weights_wrapped_in_a_model_entry_suggest_the_checkpoint_key(tmp_path):
    weights = common.build_backbone("vit_pico", patch_size=16, img_size=32).state_dict()
    torch.save({"model": weights, "epoch": 3}, tmp_path / "w.pth")
    flags = [*[f for f in EVAL if f != "--random_init"], "--dataset", "synthetic", "--synthetic_images", "16",
             "--synthetic_image_size", "32", "--nb_knn", "2", "--pretrained_weights", str(tmp_path / "w.pth")]
    assert last_line(run_here("eval_knn.py", *flags)) == (
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


def test_a_grace_period_that_is_no_number_of_seconds_is_one_line():
    code = "import common; common.install_preemption_handler()"  # (nothing happens at import)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, env={**ENV, "PREEMPTION_GRACE_SECONDS": "abc"})
    assert last_line(result) == ("error: PREEMPTION_GRACE_SECONDS=abc is not a finite number of "
                                 "seconds above 0; set it to e.g. 300 (the default), or unset it")
    for value in ("0", "-1", "inf", "nan"):
        with pytest.raises(SystemExit, match=f"PREEMPTION_GRACE_SECONDS={value} is not a finite"):
            common.grace_seconds(value)
    assert common.grace_seconds("2.5") == 2.5


# ------------------------------------------------------------------------------------------------
# Every file a script reads is checked before use: labels of saved features
# ------------------------------------------------------------------------------------------------
def save_features(folder, train_labels, test_labels):
    import eval_knn
    train = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.1]])
    for name, value in zip(eval_knn.FEATURE_FILES, (train, train_labels, torch.tensor([[0.1, 0.9]]),
                                                    test_labels)):
        torch.save(value, folder / name)
    return eval_knn.get_args_parser().parse_args(["--load_features", str(folder), "--nb_knn", "1"])


def test_saved_labels_that_are_no_class_index_are_refused(tmp_path):
    import eval_knn
    for train_labels in (torch.tensor([0, -1, 2]), torch.tensor([0.0, 1.5, 2.0])):
        args = save_features(tmp_path, train_labels, torch.tensor([1]))
        with pytest.raises(SystemExit, match="holds labels that are no class index"):
            eval_knn.main(args)


def test_sparse_saved_labels_are_voted_as_dense_classes(tmp_path):
    """Another tool's class ids (e.g. 10 ** 12) sized the vote's one-hot rows: out of memory."""
    import eval_knn
    args = save_features(tmp_path, torch.tensor([0, 10 ** 12, 7]), torch.tensor([10 ** 12]))
    assert eval_knn.main(args) == {1: (100.0, None)}
