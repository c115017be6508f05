"""The suite's shared harness: how a test runs a script (a real subprocess where the behaviour is
the process's: signals, torchrun, loader workers, the one-line error on stderr with exit status 1;
otherwise the script's own entry point in this process, `run_here`, which saves the ~4 s start-up
of an interpreter with torch and timm), the tiny command lines, small image folders, and the
comparisons of checkpoints. Test files import these names from here (`from conftest import ...`:
pytest puts tests/ on sys.path); no test file imports another."""
import contextlib
import importlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dino  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# One epoch of one step of a vit_pico DINO on 48 synthetic 32 px images.
TINY = ["--arch", "vit_pico", "--dataset", "synthetic", "--synthetic_images", "48",
        "--synthetic_image_size", "32", "--global_crop_size", "32", "--local_crop_size", "16",
        "--local_crops_number", "2", "--out_dim", "64", "--batch_size_per_gpu", "8",
        "--num_workers", "0", "--warmup_epochs", "1", "--device", "cpu",
        "--max_steps_per_epoch", "1", "--epochs", "1",
        "--precision", "fp32"]  # not auto: runs are compared to the digit, on every CPU
# The evaluation scripts on a random vit_pico at 32 px (a --dataset to add).
EVAL = ["--random_init", "--arch", "vit_pico", "--resize", "32", "--crop", "32",
        "--batch_size_per_gpu", "4", "--num_workers", "0", "--device", "cpu"]
# The same DINO for two epochs of three steps, a checkpoint each: a run to resume and compare.
TINY_RUN = {"--arch": "vit_pico", "--dataset": "synthetic", "--synthetic_images": "48",
            "--synthetic_image_size": "32", "--global_crop_size": "32", "--local_crop_size": "16",
            "--local_crops_number": "2", "--out_dim": "64", "--batch_size_per_gpu": "8",
            "--num_workers": "0", "--warmup_epochs": "1", "--device": "cpu",
            "--max_steps_per_epoch": "3", "--epochs": "2", "--saveckp_freq": "1",
            "--precision": "fp32"}  # not auto: runs are compared to the digit, on every CPU
# A vit_pico of 8 px patches and a small head, one step on 8 images: the output folder's tests.
TINY_SMALL_HEAD = ["--arch", "vit_pico", "--patch_size", "8", "--out_dim", "32",
                   "--head_hidden_dim", "32", "--head_bottleneck_dim", "16",
                   "--dataset", "synthetic", "--synthetic_images", "8",
                   "--synthetic_image_size", "32", "--global_crop_size", "32",
                   "--local_crop_size", "16", "--local_crops_number", "2",
                   "--batch_size_per_gpu", "4", "--num_workers", "0", "--epochs", "1",
                   "--warmup_epochs", "0", "--max_steps_per_epoch", "1", "--device", "cpu",
                   "--precision", "fp32"]
DRLOC_TINY = ["--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "64",
              "--arch", "swin_pico", "--input_size", "64", "--batch_size_per_gpu", "8",
              "--max_steps_per_epoch", "1", "--num_workers", "0", "--warmup_epochs", "0",
              "--epochs", "1", "--device", "cpu", "--precision", "fp32"]


def tiny(**changes):
    """The TINY_RUN command line, with `changes` (e.g. epochs="1"; data_path=None drops a flag)."""
    flags = {**TINY_RUN, **{f"--{k}": v for k, v in changes.items()}}
    return [x for k, v in flags.items() if v is not None for x in (k, v)]


DINO_TINY = tiny()
FOLDER_ARGS = tiny(dataset="folder", synthetic_images=None, synthetic_image_size=None,
                   batch_size_per_gpu="4", max_steps_per_epoch="0", epochs="1")


def on_folder(flags, data_path):
    """`flags` with --dataset folder --data_path `data_path` in place of the synthetic dataset."""
    synthetic = {"--dataset", "--synthetic_images", "--synthetic_image_size"}
    kept = [f for i, f in enumerate(flags) if f not in synthetic and flags[i - 1] not in synthetic]
    return [*kept, "--dataset", "folder", "--data_path", str(data_path)]


# ------------------------------------------------------------------------------------------------
# Running a script: as a process, or through its entry point in this process
# ------------------------------------------------------------------------------------------------
def run(*cmd, driver=None, timeout=300):
    """`python script.py args` (or `python -c code ...`, or a full command such as TORCHRUN + ...)
    as a process, waited for; `driver`: Python code run with the script and its arguments as
    sys.argv (a patched script)."""
    if driver:
        cmd = [sys.executable, "-c", driver, *cmd]
    elif str(cmd[0]).endswith(".py") or cmd[0] == "-c":
        cmd = [sys.executable, *cmd]
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=ENV)


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
    is raised, so that the test fails on it. Signal handlers and the preemption flag are
    restored."""
    if script.startswith("extras/") and str(ROOT / Path(script).parent) not in sys.path:
        sys.path.append(str(ROOT / Path(script).parent))
    module = importlib.import_module(Path(script).stem)
    out = io.StringIO()
    err = out if merge else io.StringIO()
    signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    handlers = {sig: signal.getsignal(sig) for sig in signals}
    try:
        with one_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                common.run_script(module.main, module.get_args_parser(), [str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    except BaseException:      # the output so far goes with the traceback into the report
        print(out.getvalue(), end="")
        print("" if merge else err.getvalue(), end="", file=sys.stderr)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        common.preemption.signal = None
    stderr = "" if merge else err.getvalue()
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), stderr)


def start(*cmd):
    """`python *cmd` (a script and its arguments, or -m torch.distributed.run ...) started in the
    background, so that this process can work meanwhile: `finish` it."""
    return subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def parse(module, argv):
    return module.get_args_parser().parse_args(argv)


def train_tiny(out, *extra):
    """dino.py's main() in this process on TINY_SMALL_HEAD, writing into `out`."""
    dino.main(parse(dino, [*TINY_SMALL_HEAD, "--output_dir", str(out), *extra]))


def stop_at_check(monkeypatch, n):
    """For `run_here`: the n-th preemption check finds a (simulated) SIGTERM."""
    real = common.preemption_requested
    calls = [0]

    def preemption_requested(device):
        calls[0] += 1
        if calls[0] == n:
            common.preemption.signal = "SIGTERM (simulated)"
        return real(device)
    monkeypatch.setattr(common, "preemption_requested", preemption_requested)


def descendants(pid):
    """Every living process below `pid` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found = []
    todo = [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def hold_lock(folder):
    """A live process that holds `folder`'s lock as a running training run does (flock), until
    killed."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


HOLD_LOCK = """
import fcntl, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode())
print("locked", flush=True)
time.sleep(600)
"""


# ------------------------------------------------------------------------------------------------
# What a run printed
# ------------------------------------------------------------------------------------------------
def last_line(result):
    return result.stderr.strip().splitlines()[-1]


def one_line_error(result, expected):
    """The run failed, without a traceback, and its last line is the error naming the problem."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, last
    return last


def log_records(out):
    """The records of `out`/log.txt, one a line."""
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# Data: image folders, saved features
# ------------------------------------------------------------------------------------------------
def image_folder(root, classes, per_class=4, size=32, seed=0):
    """root/<class>/<i>.png; every class has its own grey level, so images are told apart by
    class."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            level = 40 + 160 * c / max(len(classes) - 1, 1)
            pixels = np.clip(level + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def make_folder(root, bad=True):
    """root/a, root/b: 6 JPEGs each, and one image of each unusual mode (grey, RGBA, 5x3 px,
    palette, 16 bit); `bad`: and a truncated JPEG."""
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(6):
            pixels = rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.jpg")
    grey = rng.integers(0, 255, (40, 40), dtype=np.uint8)
    Image.fromarray(grey, mode="L").save(root / "a" / "gray.png")
    rgba = rng.integers(0, 255, (40, 40, 4), dtype=np.uint8)
    Image.fromarray(rgba, mode="RGBA").save(root / "a" / "rgba.png")
    Image.fromarray(rng.integers(0, 255, (5, 3, 3), dtype=np.uint8)).save(root / "b" / "tiny.png")
    palette = rng.integers(0, 255, (40, 40), dtype=np.uint8)
    Image.fromarray(palette, mode="L").convert("P").save(root / "b" / "palette.png")
    deep = rng.integers(0, 65535, (40, 40), dtype=np.uint16)
    Image.fromarray(deep).save(root / "b" / "deep.png")
    if bad:
        data = (root / "a" / "0.jpg").read_bytes()
        (root / "b" / "truncated.jpg").write_bytes(data[: len(data) // 3])


def break_images(folder):
    """Overwrite every image under `folder` with bytes no decoder reads."""
    for path in Path(folder).rglob("*.png"):
        path.write_bytes(b"not an image")


def save_features(folder, train_labels, test_labels):
    """eval_knn.py --dump_features's four files in `folder`, with these labels: the parsed
    arguments of `eval_knn.py --load_features folder --nb_knn 1`."""
    import eval_knn
    train = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.1]])
    for name, value in zip(eval_knn.FEATURE_FILES, (train, train_labels, torch.tensor([[0.1, 0.9]]),
                                                    test_labels)):
        torch.save(value, folder / name)
    return eval_knn.get_args_parser().parse_args(["--load_features", str(folder), "--nb_knn", "1"])


# ------------------------------------------------------------------------------------------------
# Checkpoints: loading and comparing them
# ------------------------------------------------------------------------------------------------
def load(path):
    return torch.load(path, weights_only=True)


def leaves(state, prefix=""):
    """{dotted name: value} of every leaf of a checkpoint's nested dicts and lists (tensors, and the
    numbers such as an optimizer's lr or step), args and RNG states left out."""
    if isinstance(state, dict):
        items = [(k, v) for k, v in state.items() if k not in ("args", "rng")]
    elif isinstance(state, (list, tuple)):
        items = list(enumerate(state))
    else:
        return {prefix: state}
    found = {}
    for k, v in items:
        found.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return found


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
    floats = {n: x for n, x in la.items()
              if torch.is_tensor(x) and x.is_floating_point() and x.numel() > 1}

    def kind(name):
        # optimizer moments by field (exp_avg, exp_avg_sq), everything else by top-level key
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


# ------------------------------------------------------------------------------------------------
# Runs that several files start from (computed once per session)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def dino_uninterrupted(tmp_path_factory):
    """The TINY_RUN DINO, two epochs uninterrupted: its --output_dir."""
    out = tmp_path_factory.mktemp("dino_full")
    result = run_here("dino.py", *DINO_TINY, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def patch8_checkpoint(tmp_path_factory):
    """A one-step DINO run of a vit_pico with 8 px patches: its checkpoint.pth."""
    out = tmp_path_factory.mktemp("patch8")
    dino.main(parse(dino, [*TINY, "--patch_size", "8", "--output_dir", str(out)]))
    return out / "checkpoint.pth"
