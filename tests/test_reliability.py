"""Reliability of the training scripts: exact resume (epoch boundary and mid-epoch), 1-process vs
2-process equality, preemption by signal, and bad input, on the `synthetic` data (tiny sizes, CPU).
A run is a real subprocess where the behaviour is the process's (signals, torchrun, loader workers,
the one-line error on stderr with exit status 1); otherwise the script's own entry point runs in this
process (`run_here`), which saves the ~4 s start-up of an interpreter with torch and timm."""
import contextlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

TINY = {"--arch": "vit_pico", "--dataset": "synthetic", "--synthetic_images": "48", "--synthetic_image_size": "32",
        "--global_crop_size": "32", "--local_crop_size": "16", "--local_crops_number": "2", "--out_dim": "64",
        "--batch_size_per_gpu": "8", "--num_workers": "0", "--warmup_epochs": "1", "--device": "cpu",
        "--max_steps_per_epoch": "3", "--epochs": "2", "--saveckp_freq": "1",
        "--precision": "fp32"}  # not auto: runs are compared to the digit, on every CPU


def tiny(**changes):
    """The tiny DINO command line, with `changes` (e.g. epochs="1", data_path=None to drop a flag)."""
    flags = {**TINY, **{f"--{k}": v for k, v in changes.items()}}
    return [x for k, v in flags.items() if v is not None for x in (k, v)]


DINO_TINY = tiny()


def run(script, *args, driver=None, timeout=300):
    cmd = [sys.executable, "-c", driver, script, *args] if driver else [sys.executable, script, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


@contextlib.contextmanager
def one_thread():
    """torch computes on one thread inside, as a subprocess with OMP_NUM_THREADS=1 does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_here(script, *args, merge=False):
    """What `run(script, *args)` gives, computed in this process: the script's own entry point
    (`common.run_script(main, parser, argv)`) with one thread, as under OMP_NUM_THREADS=1. Returns a
    subprocess.CompletedProcess: exit status 0, the code of sys.exit(code), or 1 with die()'s line
    last on stderr (as the interpreter prints it); stdout and stderr as the process writes them
    (merge: stderr into stdout, as 2>&1). An exception that would end the process with a traceback
    is raised, so that the test fails on it. Signal handlers and the preemption flag are restored."""
    if script.startswith("extras/") and str(ROOT / Path(script).parent) not in sys.path:
        sys.path.append(str(ROOT / Path(script).parent))
    module = importlib.import_module(Path(script).stem)
    out = io.StringIO()
    err = out if merge else io.StringIO()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                common.run_script(module.main, module.get_args_parser(), [str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    except BaseException:                  # the output so far goes with the traceback into the report
        print(out.getvalue(), end="")
        print("" if merge else err.getvalue(), end="", file=sys.stderr)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        common._preemption_signal = None
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), "" if merge else err.getvalue())


def start(*cmd):
    """`python *cmd` (a script and its arguments, or -m torch.distributed.run ...) started in the
    background, so that this process can work meanwhile: `finish` it."""
    return subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Runs a training script, pretending that a preemption signal arrived just before the n-th check
# (`stop_at_check` does the same in this process).
STOP_AT_CHECK = """
import runpy, sys
import common
import eval_knn
n, real = N_CHECK, common.preemption_requested
calls = [0]
def preemption_requested(device):
    calls[0] += 1
    if calls[0] == n:
        common._preemption_signal = "SIGTERM (simulated)"
    return real(device)
common.preemption_requested = preemption_requested
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def leaves(state, prefix=""):
    """{dotted name: value} of every leaf of a checkpoint's nested dicts and lists (tensors, and the
    numbers such as an optimizer's lr or step), args and RNG states left out."""
    if isinstance(state, dict):
        items = [(k, v) for k, v in state.items() if k not in ("args", "rng")]
    elif isinstance(state, (list, tuple)):
        items = list(enumerate(state))
    else:
        return {prefix: state}
    return {name: leaf for k, v in items for name, leaf in leaves(v, f"{prefix}.{k}" if prefix else str(k)).items()}


def same(x, y):
    return torch.equal(x, y) if torch.is_tensor(x) else x == y


def assert_same_state(a, b):
    """Every leaf of two checkpoints (weights, optimizer moments, loss buffers) is bit-identical."""
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    for name in la:
        assert same(la[name], lb[name]), name


def rms(t):
    return t.double().pow(2).mean().sqrt().item()


def assert_same_trajectory(a, b, rtol=1e-4):
    """Two runs that follow the same trajectory but sum in another order (1 process with batch 2b
    vs 2 processes with batch b and a gloo all-reduce) agree tensor by tensor to `rtol` of the size
    of what is compared.

    Why this bound: summing the same gradients in another order changes their last bits, and AdamW
    divides each element by its own sqrt(v) + eps, so on the rare element whose gradient is a
    near-cancelling sum the last-bit change can become a visible part of a step (seen: 1 element of
    16384 off by 4e-5 on an AMD EPYC, under 1e-5 on Intel). An elementwise atol therefore depends on
    the CPU. The RMS of the difference over a tensor hardly moves for a few such elements, while a
    real bug (a missing all-reduce, an lr not rescaled, other data) changes every element. The size
    is the tensor's own RMS or, for tensors near zero (fresh biases), the RMS of all tensors of its
    kind (all weights of one model; all first moments; all second moments; one loss's buffers).
    Non-float leaves (step counters, lr values) must be equal.
    """
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    floats = {n: x for n, x in la.items() if torch.is_tensor(x) and x.is_floating_point() and x.numel() > 1}

    def kind(name):  # optimizer moments by field (exp_avg, exp_avg_sq), everything else by top-level key
        return name.rsplit(".", 1)[-1] if name.startswith("optimizer.state") else name.split(".")[0]

    squares, counts = {}, {}
    for n, x in floats.items():
        squares[kind(n)] = squares.get(kind(n), 0.0) + x.double().pow(2).sum().item()
        counts[kind(n)] = counts.get(kind(n), 0) + x.numel()
    for name, x in la.items():
        if name not in floats:
            assert same(x, lb[name]), name
            continue
        size = max(rms(x), (squares[kind(name)] / counts[kind(name)]) ** 0.5)
        diff = rms(x - lb[name])
        assert diff <= rtol * size, f"{name}: RMS difference {diff:.3g} > {rtol} x {size:.3g}"


def load(path):
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def dino_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("dino_full")
    result = run_here("dino.py", *DINO_TINY, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_resume_at_epoch_boundary_is_bit_identical(dino_uninterrupted, tmp_path):
    shutil.copy(dino_uninterrupted / "checkpoint0001.pth", tmp_path / "checkpoint.pth")
    result = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "epoch 1, step 0" in result.stdout
    assert_same_state(load(dino_uninterrupted / "checkpoint.pth"), load(tmp_path / "checkpoint.pth"))


def stop_at_check(monkeypatch, n):
    """STOP_AT_CHECK for `run_here`: the n-th preemption check finds a (simulated) SIGTERM."""
    real, calls = common.preemption_requested, [0]

    def preemption_requested(device):
        calls[0] += 1
        if calls[0] == n:
            common._preemption_signal = "SIGTERM (simulated)"
        return real(device)
    monkeypatch.setattr(common, "preemption_requested", preemption_requested)


def test_resume_mid_epoch_is_bit_identical(dino_uninterrupted, tmp_path, monkeypatch):
    # stop after the 2nd step of epoch 0 (the 2nd check), as a preempted job would
    with monkeypatch.context() as patch:
        stop_at_check(patch, 2)
        first = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "received SIGTERM (simulated)" in first.stdout and "run the same command again to resume" in first.stdout
    ckpt = load(tmp_path / "checkpoint.pth")
    assert (ckpt["epoch"], ckpt["step"]) == (0, 2)
    second = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "epoch 0, step 2" in second.stdout
    assert_same_state(load(dino_uninterrupted / "checkpoint.pth"), load(tmp_path / "checkpoint.pth"))


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
    two = start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "dino.py", *args,
                "--batch_size_per_gpu", "4", "--output_dir", str(tmp_path / "two"))
    one = run_here("dino.py", *args, "--batch_size_per_gpu", "8", "--output_dir", str(tmp_path / "one"))  # meanwhile
    two = finish(two)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load(tmp_path / "one" / "checkpoint.pth"), load(tmp_path / "two" / "checkpoint.pth")
    assert len(b["rng"]) == 2 and len(a["rng"]) == 1
    keys = ("student", "teacher", "dino_loss", "optimizer")
    assert_same_trajectory({k: a[k] for k in keys}, {k: b[k] for k in keys})
    moved = sum((a["student"][k] - a["teacher"][k]).abs().sum() for k in a["student"])
    assert moved > 0   # the runs trained: student and teacher differ


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
    assert f"resumed from {tmp_path / 'checkpoint.pth'} at epoch {ckpt['epoch']}, step {ckpt['step']}" in resumed.stdout


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
def make_folder(root, bad=True):
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(root / cls / f"{i}.jpg")
    Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8), mode="L").save(root / "a" / "gray.png")
    Image.fromarray(rng.integers(0, 255, (40, 40, 4), dtype=np.uint8), mode="RGBA").save(root / "a" / "rgba.png")
    Image.fromarray(rng.integers(0, 255, (5, 3, 3), dtype=np.uint8)).save(root / "b" / "tiny.png")
    Image.fromarray(rng.integers(0, 255, (40, 40), dtype=np.uint8), mode="L").convert("P").save(root / "b" / "palette.png")
    Image.fromarray(rng.integers(0, 65535, (40, 40), dtype=np.uint16)).save(root / "b" / "deep.png")
    if bad:
        data = (root / "a" / "0.jpg").read_bytes()
        (root / "b" / "truncated.jpg").write_bytes(data[: len(data) // 3])


FOLDER_ARGS = tiny(dataset="folder", synthetic_images=None, synthetic_image_size=None, batch_size_per_gpu="4",
                   max_steps_per_epoch="0", epochs="1")


def test_fp16_overflow_is_skipped_by_the_grad_scaler_without_stopping(tmp_path, monkeypatch):
    """Issue: "fp16 overflow is handled by the grad scaler without stopping". fp16 autocast runs on
    CPU (slowly) for this test: every step overflows, is skipped, and the scale halves."""
    # a grad scaler that starts at a scale that makes every gradient overflow
    monkeypatch.setattr(common, "make_grad_scaler",
                        lambda device, precision: torch.amp.GradScaler(device.type, init_scale=2.0 ** 40))
    result = run_here("dino.py", *tiny(epochs="1"), "--precision", "fp16", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = load(tmp_path / "checkpoint.pth")
    assert ckpt["scaler"]["scale"] == 2.0 ** 40 / 2 ** 3          # 3 steps, 3 overflows
    assert ckpt["optimizer"]["state"] == {}                        # AdamW never stepped


def test_unusual_image_modes_are_converted(tmp_path):
    make_folder(tmp_path / "data", bad=False)
    r = run_here("dino.py", *FOLDER_ARGS, "--data_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_truncated_image_is_named_or_skipped(tmp_path, workers):
    """With loader workers, both runs are real processes (at once): the error and the warning come
    from a worker."""
    make_folder(tmp_path / "data")
    base = [*FOLDER_ARGS, "--data_path", str(tmp_path / "data"), "--num_workers", workers]
    if workers == "0":
        r = run_here("dino.py", *base, "--output_dir", str(tmp_path / "out1"))
        skipped = run_here("dino.py", *base, "--skip_bad_images", "--output_dir", str(tmp_path / "out2"))
    else:
        stopped = start("dino.py", *base, "--output_dir", str(tmp_path / "out1"))
        skipped = run("dino.py", *base, "--skip_bad_images", "--output_dir", str(tmp_path / "out2"))
        r = finish(stopped)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read image") and "truncated.jpg" in last and "--skip_bad_images" in last
    r = skipped
    assert r.returncode == 0, r.stderr[-3000:]
    assert "truncated.jpg" in r.stderr
    assert '"skipped_images": 1' in (tmp_path / "out2" / "log.txt").read_text()


@pytest.mark.parametrize("case,expected", [
    ("missing", "does not exist"),
    ("empty", "no images in"),
    ("arch", "invalid choice: 'vit_huge'"),
    ("other_arch_checkpoint", "--arch vit_pico (now vit_tiny)"),
    ("other_arch_checkpoint_allowed", "does not match the checkpoint"),
])
def test_user_mistakes_give_one_line_errors(dino_uninterrupted, tmp_path, case, expected):
    args = [*FOLDER_ARGS, "--output_dir", str(tmp_path / "out")]
    if case == "missing":
        args += ["--data_path", str(tmp_path / "nowhere")]
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        args += ["--data_path", str(tmp_path / "empty")]
    elif case == "arch":
        args = ["--arch", "vit_huge", *args]
    else:   # the run's checkpoint, resumed with another --arch
        (tmp_path / "out").mkdir()
        shutil.copy(dino_uninterrupted / "checkpoint.pth", tmp_path / "out" / "checkpoint.pth")
        args = [*DINO_TINY, "--output_dir", str(tmp_path / "out"), "--arch", "vit_tiny"]
        args += ["--allow_changed_args"] if case.endswith("allowed") else []
    r = run_here("dino.py", *args)
    assert r.returncode == (2 if case == "arch" else 1)       # argparse's status, die()'s
    assert "Traceback" not in r.stderr
    assert expected in r.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------
# Preemption of a whole job: torchrun, its processes and their loader workers all get SIGTERM
# ------------------------------------------------------------------------------------------------
def descendants(pid):
    """Every living process below `pid` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_resumes(tmp_path):
    """SLURM and torchrun signal every process of a job, loader workers included: the workers must
    not die of it before their training process has written its checkpoint."""
    args = [*tiny(max_steps_per_epoch="0", epochs="50", synthetic_images="64", num_workers="2"),
            "--output_dir", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen([*torchrun, "dino.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True)
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
    resumed = subprocess.run([*torchrun, "dino.py", *args, "--epochs", end], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at epoch {ckpt['epoch']}, step {ckpt['step']}" in resumed.stdout
    assert load(tmp_path / "checkpoint.pth")["epoch"] == int(end)


# ------------------------------------------------------------------------------------------------
# Start-up checks of a resumed run: same method, same arguments, a readable checkpoint
# ------------------------------------------------------------------------------------------------
def last_line(result):
    return result.stderr.strip().splitlines()[-1]


def test_resume_with_changed_arguments_refuses_naming_each_difference(dino_uninterrupted, tmp_path):
    refused, out = tmp_path / "refused", tmp_path / "out"
    for folder in (refused, out):
        folder.mkdir()
        shutil.copy(dino_uninterrupted / "checkpoint.pth", folder / "checkpoint.pth")
    # a real process: dino.py's one-line error reaches stderr, with exit status 1 (it runs while the
    # in-process runs below go on in another copy of the run)
    proc = start("dino.py", *DINO_TINY, "--lr", "0.001", "--local_crops_number", "4", "--output_dir", str(refused))
    # extending --epochs is allowed, and so is a change of where the run happens
    r = run_here("dino.py", *tiny(epochs="3", num_workers="1"), "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--epochs changed from 2 to 3" in r.stdout and load(out / "checkpoint.pth")["epoch"] == 3
    assert '"epochs": 3' in (out / "args.json").read_text()
    r = run_here("dino.py", *tiny(epochs="2"), "--output_dir", str(out))
    assert r.returncode == 1 and "already trained 3 epochs, more than --epochs 2" in last_line(r)
    r = finish(proc)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = last_line(r)
    assert "trained with other arguments" in line and "--allow_changed_args" in line
    assert "--lr 0.0005 (now 0.001)" in line and "--local_crops_number 2 (now 4)" in line
    assert not (refused / "args.json").exists()          # written only once every check passed


def test_default_output_dir_is_per_method_and_another_methods_checkpoint_is_named(dino_uninterrupted, tmp_path):
    import dino
    import drloc
    import esvit
    assert dino.get_args_parser().parse_args([]).output_dir == "runs/dino"
    assert esvit.get_args_parser().parse_args([]).output_dir == "runs/esvit"
    assert drloc.get_args_parser().parse_args([]).output_dir == "runs/drloc"
    shutil.copy(dino_uninterrupted / "checkpoint.pth", tmp_path / "checkpoint.pth")
    r = run("esvit.py", *DINO_TINY, "--output_dir", str(tmp_path))   # a real process: status 1, the line on stderr
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'checkpoint.pth'} was written by dino.py, not esvit.py" in last_line(r)


def test_stale_checkpoint_temporaries_are_removed_at_start_up(dino_uninterrupted, tmp_path):
    shutil.copy(dino_uninterrupted / "checkpoint.pth", tmp_path / "checkpoint.pth")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".checkpoint.pth.tmp{int(dead.stdout)}"      # left by a `kill -9` during a save
    alive = tmp_path / f".checkpoint.pth.tmp{os.getppid()}"           # another live process's save in progress: kept
    stale.write_bytes(b"partial")
    alive.write_bytes(b"partial")
    r = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not stale.exists() and alive.exists()
    assert f"removed {stale}" in r.stdout


@pytest.mark.parametrize("damage", ["empty", "truncated", "image", "folder"])
def test_empty_or_truncated_checkpoint_is_named(dino_uninterrupted, tmp_path, damage):
    data = (dino_uninterrupted / "checkpoint.pth").read_bytes()
    if damage == "image":     # torch's own error would advise `weights_only=False`: wrong advice for a picture
        Image.new("RGB", (8, 8)).save(tmp_path / "checkpoint.pth", format="PNG")
    elif damage == "folder":
        (tmp_path / "checkpoint.pth").mkdir()
    else:
        (tmp_path / "checkpoint.pth").write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    r = run_here("dino.py", *DINO_TINY, "--output_dir", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = last_line(r)
    assert line.startswith(f"error: checkpoint {tmp_path / 'checkpoint.pth'}")
    assert {"empty": "is empty (0 bytes", "truncated": "truncated", "image": "is not a PyTorch file",
            "folder": "Is a directory"}[damage] in line
    assert "weights_only" not in line and ("(truncated?)" in line) == (damage == "truncated")
    assert line.rstrip().split(":")[-1].strip()            # a reason, never a blank one


def test_crop_size_rule_is_checked_at_start_up_by_every_self_supervised_script(tmp_path):
    import dino
    import esvit
    import selfpatch
    import common
    for module, arch in ((dino, "swin_pico"), (esvit, "swin_pico"), (selfpatch, "vit_small")):
        bad = module.get_args_parser().parse_args(["--arch", arch, "--local_crop_size", "40"])
        with pytest.raises(SystemExit, match="--local_crop_size 40 is not a multiple"):
            common.check_start_args(bad)
    r = run_here("dino.py", *tiny(global_crop_size="36"), "--output_dir", str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--global_crop_size 36 is not a multiple of the vit_pico token stride (16 px)" in last_line(r)
    assert not (tmp_path / "args.json").exists()


# ------------------------------------------------------------------------------------------------
# Numeric arguments out of range: refused at parse time, in one line
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script,flag,value", [
    ("dino", "--epochs", "0"), ("dino", "--out_dim", "1"), ("selfpatch", "--patch_out_dim", "1"),
    ("dino", "--momentum_teacher", "2"), ("dino", "--lr", "-1"), ("dino", "--lr", "inf"), ("glsd", "--teacher_temp", "inf"),
    ("dino", "--local_crops_number", "-2"), ("dino", "--global_crops_scale", "0"), ("dino", "--teacher_temp", "0"),
    ("esvit", "--batch_size_per_gpu", "0"), ("glsd", "--warmup_epochs", "-1"), ("selfpatch", "--k_num", "0"),
    ("drloc", "--smoothing", "1.5"), ("drloc", "--input_size", "nan"), ("eval_knn", "--temperature", "0"),
    ("eval_knn", "--nb_knn", "0"), ("eval_linear", "--n_last_blocks", "0"), ("eval_linear", "--epochs", "-3"),
])
def test_numeric_arguments_out_of_range_are_refused_at_parse_time(capsys, script, flag, value):
    import importlib
    parser = importlib.import_module(script).get_args_parser()
    values = [value, value] if flag.endswith("crops_scale") else [value]
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([flag, *values])
    assert exit_info.value.code != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in last and ("out of range" in last or "expected" in last)


@pytest.mark.parametrize("script", ["eval_knn.py", "eval_linear.py"])
def test_eval_crop_that_is_not_a_multiple_of_the_patch_is_one_line(script, tmp_path):
    extra = ["--output_dir", str(tmp_path)] if script == "eval_linear.py" else []
    r = run_here(script, "--random_init", "--arch", "vit_pico", "--dataset", "synthetic", "--resize", "36", "--crop",
                 "36", "--device", "cpu", *extra)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--crop 36 is not a multiple of the vit_pico patch size (16 px); use e.g. 32" in last_line(r)


def test_more_neighbours_than_train_images_is_refused(tmp_path):
    r = run_here("eval_knn.py", "--random_init", "--arch", "vit_pico", "--dataset", "synthetic", "--synthetic_images",
                 "16", "--synthetic_image_size", "32", "--resize", "32", "--crop", "32", "--num_workers", "0", "--device",
                 "cpu", "--nb_knn", "10", "200")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--nb_knn 200 is more than the 16 train images" in last_line(r)


# ------------------------------------------------------------------------------------------------
# Evaluation scripts: unreadable images, probes trained on other weights
# ------------------------------------------------------------------------------------------------
EVAL_FOLDER = ["--random_init", "--arch", "vit_pico", "--dataset", "folder", "--resize", "32", "--crop", "32",
               "--batch_size_per_gpu", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def eval_folder(tmp_path_factory):
    """train/: 17 readable images; val/: the same 17 and one truncated JPEG."""
    root = tmp_path_factory.mktemp("eval_data")
    make_folder(root / "train", bad=False)
    make_folder(root / "val", bad=True)
    return root


def test_eval_unreadable_image_is_one_line(eval_folder, tmp_path):
    """Both evaluation scripts as real processes (at once) with a loader worker: the worker's error
    reaches stderr as one line, with exit status 1."""
    procs = {script: start(script, *EVAL_FOLDER, "--data_path", str(eval_folder), "--num_workers", "1", *extra)
             for script, extra in (("eval_knn.py", ["--nb_knn", "5"]),
                                   ("eval_linear.py", ["--epochs", "1", "--output_dir", str(tmp_path)]))}
    for script, proc in procs.items():
        r = finish(proc)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (script, r.stderr[-3000:])
        line = last_line(r)
        assert line.startswith("error: cannot read image") and "truncated.jpg" in line and "--skip_bad_images" in line, \
            (script, line)


def test_eval_knn_drops_unreadable_images_with_their_labels(eval_folder):
    r = run_here("eval_knn.py", *EVAL_FOLDER, "--data_path", str(eval_folder), "--num_workers", "0", "--nb_knn", "5",
                 "--skip_bad_images")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 unreadable images" in r.stdout and "truncated.jpg" in r.stderr
    assert "k-NN over 17 train and 17 test images" in r.stdout     # not 18: no neighbour stands in for it


def test_eval_linear_drops_unreadable_images_and_refuses_a_probe_of_other_weights(eval_folder, tmp_path):
    args = [*EVAL_FOLDER, "--data_path", str(eval_folder), "--num_workers", "0", "--skip_bad_images",
            "--max_steps_per_epoch", "1", "--output_dir", str(tmp_path)]
    r = run_here("eval_linear.py", *args, "--epochs", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "log.txt").read_text().splitlines()[-1])
    assert (record["val_images"], record["val_skipped_images"]) == (17, 1)
    # the same folder, other weights (another random initialisation): the old probe is not reported
    r = run_here("eval_linear.py", *args, "--epochs", "2", "--seed", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "holds a linear probe trained on other weights" in last_line(r)
    r = run_here("eval_linear.py", *args, "--epochs", "2")           # the same weights: resumed
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout


def test_every_argument_has_help_and_the_drloc_normalize_help_names_its_divisor():
    import importlib
    for script in ("dino", "esvit", "glsd", "selfpatch", "drloc", "eval_knn", "eval_linear"):
        parser = importlib.import_module(script).get_args_parser()
        assert [a.dest for a in parser._actions if not a.help] == [], script
    import drloc
    normalize = next(a for a in drloc.get_args_parser()._actions if a.dest == "drloc_normalize")
    assert "k-1" in normalize.help and "k/2" not in normalize.help


def test_selfpatch_teacher_backbone_alone_is_a_one_line_mismatch(tmp_path):
    """SelfPatch's backbone has no CLS token and no final norm: its image token needs the
    aggregation module of checkpoint.pth."""
    import common
    import eval_knn
    backbone = common.build_backbone("vit_pico", class_token=False, final_norm=False)
    torch.save(backbone.state_dict(), tmp_path / "teacher_backbone.pth")
    with pytest.raises(SystemExit, match=r"does not match the checkpoint.*missing: \[cls_token, norm.weight"):
        eval_knn.load_backbone(str(tmp_path / "teacher_backbone.pth"), arch="vit_pico")
