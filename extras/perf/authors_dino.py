"""The authors' DINO (facebookresearch/dino: main_dino.py, utils.py, vision_transformer.py),
imported from a folder given at run time and run as it is, for extras/perf/side_by_side.py.
Nothing of theirs is copied here: their training step is built from their own classes and
functions, as their `train_dino` builds it, and runs in their own `train_one_epoch`.

Shims, outside their files (`shims`): their `torch.cuda.amp.autocast(enabled)` takes the precision
measured (for fp16 it is exactly theirs); on a CPU their `.cuda()` and `torch.cuda.synchronize()`
do nothing and their MetricLogger's final all-reduce (of a CUDA tensor) is skipped. Their code
imports and runs with torch 2.14 as it is (FutureWarnings for `torch.cuda.amp` and
`nn.utils.weight_norm`, silenced here); `main_dino.get_args_parser` is not called (it asks
torch.hub for a list over the network). Not a script.
"""
import argparse
import contextlib
import importlib
import io
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402

FILES = ("main_dino.py", "utils.py", "vision_transformer.py")


def load(folder):
    """Their modules (main_dino, utils, vision_transformer), imported by path; they import each
    other by bare name, so their folder goes first on sys.path."""
    folder = Path(folder).resolve()
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        common.die(f"--authors_code {folder}: no {', '.join(missing)} there (the authors' "
                   "facebookresearch/dino files)")
    sys.path.insert(0, str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        modules = {name: importlib.import_module(name) for name in
                   ("main_dino", "utils", "vision_transformer")}
    foreign = [m.__name__ for m in modules.values() if Path(m.__file__).parent != folder]
    if foreign:
        common.die(f"--authors_code {folder}: the module(s) {', '.join(foreign)} were imported "
                   "from elsewhere first; run side_by_side.py in a fresh process")
    return argparse.Namespace(**modules)


@contextlib.contextmanager
def shims(authors, device, precision):
    """Their training step, run as it is, in `precision` on `device`: their autocast
    (`torch.cuda.amp.autocast(enabled)`, fp16) takes the dtype measured; on a CPU their CUDA-only
    calls become no-ops. Everything is restored on exit."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    saved = [(torch.cuda.amp, "autocast", torch.cuda.amp.autocast)]

    def autocast(enabled=True, **_):
        return torch.autocast(device.type, dtype=dtype, enabled=enabled and precision != "fp32")
    torch.cuda.amp.autocast = autocast
    if device.type == "cpu":
        saved += [(torch.Tensor, "cuda", torch.Tensor.cuda),
                  (torch.cuda, "synchronize", torch.cuda.synchronize),
                  (authors.utils, "is_dist_avail_and_initialized",
                   authors.utils.is_dist_avail_and_initialized)]
        torch.Tensor.cuda = lambda self, *a, **k: self
        torch.cuda.synchronize = lambda *a, **k: None
        authors.utils.is_dist_avail_and_initialized = lambda: False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # torch.cuda.amp, weight_norm
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def build(authors, spec, batch, precision, device, steps):
    """main_dino.train_dino's networks, loss, optimizer, scaler and schedules, from their classes
    and functions; returns (their train_one_epoch on a loader, the student and teacher)."""
    vits = authors.vision_transformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # their weight_norm
        student = vits.__dict__[spec["arch"]](patch_size=spec["patch_size"], drop_path_rate=0.1)
        teacher = vits.__dict__[spec["arch"]](patch_size=spec["patch_size"])
        head = dict(hidden_dim=spec["hidden_dim"], bottleneck_dim=spec["bottleneck_dim"])
        student = authors.utils.MultiCropWrapper(student, vits.DINOHead(
            student.embed_dim, spec["out_dim"], use_bn=False, norm_last_layer=True, **head))
        teacher = authors.utils.MultiCropWrapper(teacher, vits.DINOHead(
            teacher.embed_dim, spec["out_dim"], False, **head))
    student, teacher = student.to(device), teacher.to(device)
    wrapped = nn.parallel.DistributedDataParallel(
        student, device_ids=[device] if device.type == "cuda" else None)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    loss = authors.main_dino.DINOLoss(spec["out_dim"], spec["local_crops"] + 2, 0.04, 0.04, 0,
                                      1).to(device)
    optimizer = torch.optim.AdamW(authors.utils.get_params_groups(wrapped))
    # their torch.cuda.amp.GradScaler() with --use_fp16; any scaler turns their autocast on
    scaler = (None if precision == "fp32"
              else torch.amp.GradScaler(device.type, enabled=precision == "fp16"))
    cosine = authors.utils.cosine_scheduler
    schedules = [cosine(0.0005 * batch / 256, 1e-6, 1, steps), cosine(0.04, 0.4, 1, steps),
                 cosine(0.996, 1, 1, steps)]
    settings = argparse.Namespace(epochs=1, clip_grad=3.0, freeze_last_layer=0)

    def train(loader):
        with shims(authors, device, precision), contextlib.redirect_stdout(io.StringIO()):
            stats = authors.main_dino.train_one_epoch(wrapped, teacher, teacher, loss, loader,
                                                      optimizer, *schedules, 0, scaler, settings)
        return stats["loss"]
    return train, (student, teacher)


def loader(authors, spec, folder, batch, workers, device):
    """main_dino.train_dino's data: DataAugmentationDINO, ImageFolder, DistributedSampler."""
    transform = authors.main_dino.DataAugmentationDINO((0.4, 1.0), (0.05, 0.4),
                                                       spec["local_crops"])
    dataset = torchvision.datasets.ImageFolder(str(folder), transform=transform)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    return torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=batch,
                                       num_workers=workers, pin_memory=device.type == "cuda",
                                       drop_last=True)
