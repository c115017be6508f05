"""A checkpoint.pth in the layout of the DINO authors' main_dino.py (facebookresearch/dino): what
eval_knn.py, eval_linear.py and the tools read as users expect, and what a resume or esvit.py
--init_from refuses in one line that names the flag evaluating it.

main_dino.py saves `student` (DistributedDataParallel: `module.backbone.`, `module.head.`),
`teacher` (no DDP without batch norms: `backbone.`, `head.`), `optimizer` (its param groups' lr
and weight_decay set from numpy schedules: numpy.float64), `epoch`, `args` (an
argparse.Namespace) and `dino_loss` (the center), and `fp16_scaler` with fp16."""
import argparse
import io
import os
import zipfile

import numpy as np
import pytest
import torch
from conftest import DINO_TINY, EVAL, TINY, one_line_error, run_here

import common

DATA = ["--dataset", "synthetic", "--synthetic_images", "40", "--synthetic_image_size", "32"]


def authors_layout(ckpt):
    """The weights and state of this repository's dino.py checkpoint, saved as main_dino.py saves
    them."""
    optimizer = ckpt["optimizer"]
    for group in optimizer["param_groups"]:
        group["lr"] = np.float64(group["lr"])
        group["weight_decay"] = np.float64(group["weight_decay"])
    return {"student": {f"module.{k}": v for k, v in ckpt["student"].items()},
            "teacher": ckpt["teacher"], "optimizer": optimizer, "epoch": ckpt["epoch"],
            "args": argparse.Namespace(**ckpt["args"], dist_url="env://", gpu=0),
            "dino_loss": ckpt["dino_loss"], "fp16_scaler": {"scale": np.float32(65536.0)}}


def numpy1_copy(path, to):
    """`path` as numpy 1 pickles its scalars (numpy.core.multiarray.scalar, not numpy._core)."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(to, "w") as copy:
        for entry in source.infolist():
            data = source.read(entry.filename)
            if entry.filename.endswith("data.pkl"):
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            copy.writestr(entry, data)


@pytest.fixture(scope="module")
def authors_file(dino_uninterrupted, tmp_path_factory):
    """dino.py's checkpoint.pth and the same weights in main_dino.py's layout."""
    folder = tmp_path_factory.mktemp("authors")
    ckpt = torch.load(dino_uninterrupted / "checkpoint.pth", weights_only=True)
    torch.save(authors_layout(ckpt), folder / "checkpoint.pth")
    return dino_uninterrupted / "checkpoint.pth", folder / "checkpoint.pth"


def test_the_authors_layout_holds_numpy_scalars_and_a_namespace(authors_file):
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(authors_file[1])
    assert {"argparse.Namespace", "numpy.dtype"} <= set(unsafe)
    assert any(name.endswith("multiarray.scalar") for name in unsafe)


@pytest.mark.parametrize("key", ["teacher", "student"])
def test_eval_knn_gives_the_same_top1_on_the_authors_layout(authors_file, key):
    ours, theirs = authors_file
    flags = [*[f for f in EVAL if f != "--random_init"], *DATA, "--nb_knn", "5", "20",
             "--checkpoint_key", key]
    results = {}
    for path in (ours, theirs):
        result = run_here("eval_knn.py", "--pretrained_weights", path, *flags)
        assert result.returncode == 0, result.stderr[-2000:]
        results[path] = [line for line in result.stdout.splitlines() if "NN classifier" in line]
        assert len(results[path]) == 2
    assert results[ours] == results[theirs]


def test_the_numpy_1_module_path_loads_and_nothing_else_is_widened(authors_file, tmp_path):
    numpy1_copy(authors_file[1], tmp_path / "numpy1.pth")
    raw = zipfile.ZipFile(tmp_path / "numpy1.pth").read("checkpoint/data.pkl")
    assert b"numpy.core.multiarray" in raw and b"numpy._core" not in raw
    ckpt = common.load_checkpoint(tmp_path / "numpy1.pth")
    lrs = [g["lr"] for g in ckpt["optimizer"]["param_groups"]]
    assert all(isinstance(lr, np.float64) for lr in lrs)
    torch.save({"weights": np.zeros(3)}, tmp_path / "array.pth")  # an ndarray: still refused
    with pytest.raises(SystemExit, match="holds numpy.*_reconstruct.* beyond tensors"):
        common.load_checkpoint(tmp_path / "array.pth")


def test_a_resume_of_the_authors_file_names_the_flag_that_evaluates_it(authors_file, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pth").write_bytes(authors_file[1].read_bytes())
    result = run_here("dino.py", *DINO_TINY, "--output_dir", out)
    one_line_error(result, "was written by the authors' code, not dino.py: it cannot be resumed; "
                           "evaluate it with --pretrained_weights of eval_knn.py or eval_linear.py")
    result = run_here("esvit.py", *TINY, "--init_from", authors_file[1], "--output_dir",
                      tmp_path / "esvit")
    one_line_error(result, "--pretrained_weights of eval_knn.py or eval_linear.py")


def test_a_converted_copy_names_the_program_or_says_it_is_unknown(authors_file, tmp_path):
    ckpt = torch.load(authors_file[0], weights_only=True)
    for method, expected in ((None, "an unknown program"), ("esvit", "esvit.py")):
        out = tmp_path / str(method)
        out.mkdir()
        copy = {k: v for k, v in ckpt.items() if k != "method"}
        torch.save({**copy, **({"method": method} if method else {})}, out / "checkpoint.pth")
        result = run_here("dino.py", *DINO_TINY, "--output_dir", out)
        one_line_error(result, f"was written by {expected}, not dino.py")


def test_a_refused_global_is_named_without_torchs_advice(tmp_path):
    """torch 2.14's message for a blocked module (posix.system) advises weights_only=False."""
    class Payload:  # never run: the files are refused unread
        def __init__(self, function):
            self.function = function

        def __reduce__(self):
            return (self.function, ("true",))
    torch.save({"x": Payload(os.system)}, tmp_path / "system.pth")
    torch.save({"x": Payload(eval)}, tmp_path / "eval.pth")
    buffer = io.BytesIO()
    torch.save({"x": Payload(os.system)}, buffer, _use_new_zipfile_serialization=False)
    (tmp_path / "legacy.pth").write_bytes(buffer.getvalue())
    system = os.system.__module__  # posix
    for name, named in (("system.pth", f"{system}.system"), ("eval.pth", "builtins.eval"),
                        ("legacy.pth", "an object")):
        result = run_here("eval_knn.py", "--pretrained_weights", tmp_path / name, *DATA,
                          *[f for f in EVAL if f != "--random_init"])
        line = one_line_error(result, f"holds {named} beyond tensors and plain values: refused")
        assert "weights_only" not in result.stderr and "Re-running" not in result.stderr, line
