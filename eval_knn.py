"""Weighted k-NN evaluation of frozen features (Caron et al., "Emerging Properties in
Self-Supervised Vision Transformers", ICCV 2021, appendix "k-NN classification"; Wu et al., CVPR
2018).

Protocol. The pretrained backbone is frozen. Every image of the train and test splits goes through
the evaluation transform (Resize(256, bicubic) -> CenterCrop(224) -> ImageNet normalisation) and
the backbone; its global feature is l2-normalised:

    ViT        the CLS token after the final LayerNorm
    Swin       the mean of the final-LayerNorm tokens (EsViT's pooling)
    SelfPatch  the image token of its aggregation head (its backbone has no CLS token)

A test feature x votes with its k nearest train features (cosine similarity s_i, labels c_i):

    score(c) = sum_{i in top-k(x)} exp(s_i / T) [c_i = c],   prediction = argmax_c score(c)

with T = 0.07 (not tuned, as in Wu et al.) and k in {10, 20, 100, 200}; the paper finds k = 20 best.
Top-1 and top-5 accuracies are reported (top-5 only with at least 5 classes).

The backbone comes from `load_backbone`, which eval_linear.py uses too: one loader for this
repository's checkpoints (any method), its teacher_backbone.pth, the DINO authors' released ViT
weights and the EsViT / GLSD authors' released Swin checkpoints.

Where this file differs from the authors' eval_knn.py:
  * test rows are processed in chunks of a fixed number of rows; the authors' `n // 100` rows per
    chunk is 0, and crashes, below 100 test images;
  * the vote has one column per class present in the labels instead of a fixed 1000; the ranking of
    the classes that receive votes is the same, so every result is the same unless fewer than five
    classes get a vote and the true class is among the zero-vote ties;
  * loading is strict (after removing wrapper prefixes and heads): a mismatching checkpoint is an
    error, where the authors' `strict=False` load goes on with whatever matched;
  * the train features stay on the GPU only when they fit (the authors' `--use_cuda` flag).
  * each test row's weights are divided by its top one, exp(s_1 / T): the same vote, where the
    authors' exp(s / T) overflows float32 below T = 1/88.7 and ranks the classes by inf and NaN.
"""
import argparse
import math
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import checks
import common


# ================================================================================================
# Any checkpoint's backbone, and features by dataset index (shared with eval_linear.py and extras/)
# ================================================================================================
def add_weights_args(parser):
    """The pretrained model to evaluate (eval_knn.py, eval_linear.py and the extras)."""
    g = parser.add_argument_group("pretrained model")
    g.add_argument("--pretrained_weights", default="", type=str,
                   help="checkpoint.pth of any method of this repository, its "
                        "teacher_backbone.pth, a released DINO ViT file, or a released EsViT / "
                        "GLSD Swin checkpoint")
    g.add_argument("--checkpoint_key", default="teacher", type=str,
                   help="which network of a full checkpoint to evaluate (teacher or student)")
    g.add_argument("--random_init", action="store_true",
                   help="evaluate the architecture at random initialisation instead (a baseline; "
                        "with --pretrained_weights, the architecture of that checkpoint)")
    g.add_argument("--arch", default="vit_small", choices=list(common.ARCHS),
                   help="architecture of a plain state dict (full checkpoints record their own)")
    g.add_argument("--patch_size", default=16, type=common.GRID,
                   help="ViT patch size of a plain state dict")
    g.add_argument("--window_size", default=7, type=common.GRID,
                   help="Swin window size of a plain state dict")
    return g


def add_eval_data_args(parser, batch_size=128):
    g = common.add_data_args(parser)
    g.add_argument("--resize", default=256, type=common.PIXELS,
                   help="shorter side after resizing (bicubic)")
    g.add_argument("--crop", default=224, type=common.PIXELS,
                   help="side of the center crop; for small datasets, e.g. --resize 64 --crop "
                        "64 on 64-px images")
    g.add_argument("--batch_size_per_gpu", default=batch_size, type=common.POSITIVE_INT,
                   help="images per process")
    return g


def add_eval_run_args(parser):
    g = parser.add_argument_group("run")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when present), cpu, cuda, or cuda:N (one process only: under "
                        "torchrun each process takes the GPU of its LOCAL_RANK)")
    g.add_argument("--seed", default=0, type=common.COUNT,
                   help="seeds --random_init (and eval_linear's data order)")
    return g


def check_eval_crop(crop, arch, patch_size, flag="--crop"):
    """Evaluation crops: a ViT needs whole patches (a Swin pads its token maps, which DRLoc's
    small-image runs rely on)."""
    if common.ARCHS[arch]["family"] == "vit" and crop % patch_size:
        common.die(f"{flag} {crop} is not a multiple of the {arch} patch size ({patch_size} px); "
                   f"use e.g. {max(patch_size, crop // patch_size * patch_size)}")


class PooledViT(nn.Module):
    """A CLS-free ViT read through class-attention pooling (SelfPatch's network for evaluation):
    `model(x)` is the image token [B, D]. Key names `backbone.*` and `ca_head.*` as in its
    checkpoints."""

    def __init__(self, backbone, ca_head):
        super().__init__()
        self.backbone = backbone
        self.ca_head = ca_head

    def forward(self, images):
        _, grid = self.backbone.forward_dense(images, norm=False)
        return self.ca_head(grid.flatten(1, 2))


def recorded_backbone(ckpt):
    """A full checkpoint's backbone record; checkpoints written before records existed give theirs
    from their args (SelfPatch's: the CLS-free ViT and its aggregation module)."""
    if "backbone" in ckpt:
        return ckpt["backbone"]
    args = ckpt["args"]
    record = dict(arch=args["arch"], patch_size=args.get("patch_size", 16),
                  window_size=args.get("window_size", 7),
                  img_size=args.get("global_crop_size") or args.get("input_size") or 224)
    if ckpt["method"] == "selfpatch":
        record.update(class_token=False, final_norm=False, image_token="ca_head")
    return record


def backbone_state_dict(state_dict):
    """The backbone entries of a checkpoint's state dict, renamed to timm's keys, and the names of
    the entries left out.

    `module.` (DistributedDataParallel) is removed. If some keys start with `backbone.` (a model
    wrapper, as in this repository and the DINO authors' checkpoints), only those are kept. Heads
    (`head*`, which EsViT attaches to the backbone itself) and the official Swin's buffers
    (relative_position_index, attn_mask; timm recomputes them) are left out. The official
    Swin merges patches at the end of a stage, timm at the start of the next one, so the
    official `layers.{i}.downsample` becomes `layers.{i+1}.downsample`.
    """
    state = {k.removeprefix("module."): v for k, v in state_dict.items()}
    ignored = []
    if any(k.startswith("backbone.") for k in state):
        ignored += [k for k in state if not k.startswith("backbone.")]
        state = {k.removeprefix("backbone."): v for k, v in state.items()
                 if k.startswith("backbone.")}
    timm_buffers = (".relative_position_index", ".attn_mask")
    for k in list(state):
        if k.split(".")[0].startswith("head") or k.endswith(timm_buffers):
            ignored.append(k)
            del state[k]
    # the official Swin stage layout
    if any(k.startswith("layers.0.downsample.") for k in state):
        state = {re.sub(r"^layers\.(\d+)\.downsample\.",
                        lambda m: f"layers.{int(m[1]) + 1}.downsample.", k): v
                 for k, v in state.items()}
    return state, ignored


def plain_state_shape(state, window_size, crop):
    """(window sizes, image size) to rebuild a plain backbone state dict: a ViT's image size from
    its position table (patch grid x patch), a Swin's windows from its relative-position
    tables (one per stage; the evaluation crop is taken as its image size). Without a state dict (a
    random initialisation), `window_size` and the evaluation crop."""
    state = backbone_state_dict(state)[0] if isinstance(state, dict) else {}
    if "pos_embed" in state and "patch_embed.proj.weight" in state:
        n = state["pos_embed"].shape[1] - ("cls_token" in state)
        return window_size, math.isqrt(n) * state["patch_embed.proj.weight"].shape[-1]
    tables = sorted((k, v) for k, v in state.items()
                    if k.endswith("blocks.0.attn.relative_position_bias_table"))
    if tables:
        return tuple((math.isqrt(v.shape[0]) + 1) // 2 for _, v in tables), crop
    return window_size, crop


def load_backbone(path, checkpoint_key="teacher", arch="vit_small", patch_size=16, window_size=7,
                  random_init=False, crop=224, crop_flag="--crop"):
    """A frozen network in eval mode whose `model(x)` is the global feature [B, D], and a dict
    describing it (method, arch, patch_size, window_size).

    `path` is one of: this repository's checkpoint.pth (any method; the network is rebuilt from its
    "backbone" record, the weights come from `checkpoint_key`), a plain backbone state dict
    (teacher_backbone.pth, a released DINO ViT file; the architecture comes from the arguments, the
    image size and windows from the weights' tables: `plain_state_shape`), or
    a released EsViT / GLSD checkpoint (`checkpoint_key` entry with wrapper prefixes and the
    official Swin layout). With `random_init` the weights are not loaded (the architecture
    still comes from `path`, if any). SelfPatch's network is a `PooledViT`: its image token, not a
    CLS token. `crop` (the script's `crop_flag`) must be tiled by a ViT's patches.
    """
    ckpt = None
    if path:
        if not Path(path).is_file():
            common.die(f"--pretrained_weights {path} is not a file")
        ckpt = common.load_checkpoint(path)
    elif not random_init:
        common.die("give --pretrained_weights (a checkpoint to evaluate) or --random_init (a "
                   "baseline)")
    full = isinstance(ckpt, dict) and "args" in ckpt and "method" in ckpt  # written by this repo
    if full and checkpoint_key == "teacher" and "teacher" not in ckpt and "model" in ckpt:
        checkpoint_key = "model"       # a supervised run (DRLoc) trains one network
    state = ckpt
    if isinstance(ckpt, dict) and checkpoint_key in ckpt:
        state = ckpt[checkpoint_key]
    elif full or (isinstance(ckpt, dict) and {"teacher", "student"} & set(ckpt)):
        common.die(f"--checkpoint_key {checkpoint_key!r} is not in {path}; it has: "
                   f"{', '.join(map(str, ckpt))}")
    weights = isinstance(state, dict) and all(torch.is_tensor(v) for v in state.values())
    if not random_init and state is not None and not weights:
        kind = type(state).__name__
        kind = f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"
        if state is not ckpt:
            common.die(f"--checkpoint_key {checkpoint_key} picks {kind} in {path}, not a network's "
                       f"weights; choose teacher or student")
        entries = ckpt.items() if isinstance(ckpt, dict) else ()
        networks = [str(k) for k, v in entries if isinstance(v, dict) and v
                    and all(torch.is_tensor(t) for t in v.values())]
        if networks:  # e.g. {"model": ...}, {"state_dict": ...}: another tool's wrapper
            common.die(f"--pretrained_weights {path} holds the weights of {', '.join(networks)}: "
                       f"choose one with --checkpoint_key {networks[0]}")
        common.die(f"--pretrained_weights {path} holds {kind}, not a network's weights (a state "
                   "dict): give a checkpoint.pth, a teacher_backbone.pth or released backbone "
                   "weights")
    record = recorded_backbone(ckpt) if full else dict(arch=arch, patch_size=patch_size)
    check_eval_crop(crop, record["arch"], record["patch_size"], crop_flag)  # before building
    if not full:
        window_size, img_size = plain_state_shape(state, window_size, crop)
        record = dict(arch=arch, patch_size=patch_size, window_size=window_size, img_size=img_size)
    build = {k: v for k, v in record.items() if k != "image_token"}
    # method: the method of this repository that wrote the checkpoint, or "external" (a plain state
    # dict, an authors' checkpoint), or "random" (no file)
    method = ckpt["method"] if full else "random" if ckpt is None else "external"
    info = {"method": method, "arch": build["arch"], "patch_size": build["patch_size"],
            "window_size": build["window_size"]}

    backbone = common.build_backbone(**build, drop_path_rate=0.0)
    if record.get("image_token") == "ca_head":  # SelfPatch: the aggregation module's image token
        pool = common.ClassAttentionPool(backbone.num_features, backbone.blocks[0].attn.num_heads)
        model = PooledViT(backbone, pool)
        if not random_init:
            # not the heads
            state = {k: v for k, v in state.items() if k.startswith(("backbone.", "ca_head."))}
            common.load_state_dict_strict(
                model, state, what=f"{method} {checkpoint_key} backbone and aggregation module")
    else:
        model = backbone
        if state is not None and not random_init:
            state, ignored = backbone_state_dict(state)
            if ignored:
                common.log(f"the backbone leaves out {len(ignored)} checkpoint entries that are "
                           f"not its weights: {', '.join(ignored[:6])}"
                           f"{' ...' if len(ignored) > 6 else ''}")
            common.load_state_dict_strict(model, state, what=f"{build['arch']} backbone")
    diverged = [name for name, t in model.state_dict().items()
                if t.is_floating_point() and not t.isfinite().all()]
    # they would give a k-NN or probe figure on NaN features, without a word
    if diverged:
        common.die(f"{path} [{checkpoint_key}] holds non-finite weights ({', '.join(diverged[:3])}"
                   f"{' ...' if len(diverged) > 3 else ''}): the run that wrote them diverged; "
                   "evaluate an earlier checkpoint")
    shape = (f"window {info['window_size']}" if isinstance(backbone, common.Swin)
             else f"patch {info['patch_size']}")
    source = "random initialisation" if random_init else f"weights from {path} [{checkpoint_key}]"
    common.log(f"model: {method} {info['arch']} ({shape}), {source}")
    return model.eval().requires_grad_(False), info


def dense_backbone(model):
    """The module with `forward_dense` inside what `load_backbone` returns."""
    return model.backbone if isinstance(model, PooledViT) else model


SKIPPED = common.ImageFolderSafe.SKIPPED  # the label of an unreadable image's row in evaluation


class IndexedDataset(torch.utils.data.Dataset):
    """(transform(image), label, index) so that rows computed by any process land at their index.
    An unreadable image (with --skip_bad_images) comes as a blank image with label SKIPPED, and
    evaluation drops its row: it must not count a neighbour's image and label instead."""

    def __init__(self, base, transform):
        self.base = base
        self.transform = transform
        # (a --holdout Subset's folder)
        if isinstance(getattr(base, "dataset", base), common.ImageFolderSafe):
            getattr(base, "dataset", base).substitute = False

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        return self.transform(image), label, index


def all_gather_rows(*tensors):
    """Collective: each tensor's rows from every process, concatenated in rank order (the same on
    every process). Processes may hold different numbers of rows: they are padded for the
    exchange."""
    if not common.is_dist():
        return tensors
    count = torch.tensor([len(tensors[0])], device=tensors[0].device)
    counts = [torch.zeros_like(count) for _ in range(common.get_world_size())]
    dist.all_gather(counts, count)
    counts = [int(c) for c in counts]
    gathered = []
    for t in tensors:
        padded = t.new_zeros((max(counts), *t.shape[1:]))
        padded[:len(t)] = t
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded)
        gathered.append(torch.cat([part[:n] for part, n in zip(parts, counts)]))
    return gathered


# ================================================================================================
# Arguments (defaults: the authors' eval_knn.py)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("eval_knn.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_weights_args(p)
    g = p.add_argument_group("k-NN")
    g.add_argument("--nb_knn", default=[10, 20, 100, 200], nargs="+", type=common.POSITIVE_INT,
                   help="numbers of neighbours k; the paper finds k=20 consistently best")
    g.add_argument("--temperature", default=0.07, type=common.POSITIVE,
                   help="T in the vote weight exp(similarity / T), from Wu et al. (not tuned)")
    g.add_argument("--dump_features", default=None,
                   help="save the features and labels to this folder (created; a folder that "
                        "already holds features is refused: they are never overwritten)")
    g.add_argument("--load_features", default=None,
                   help="load features and labels saved by --dump_features (no model, no images)")
    add_eval_data_args(p)
    add_eval_run_args(p)
    return p


# ================================================================================================
# Features, extracted in parallel and gathered by dataset index
# ================================================================================================
def bank_device(n_rows, dim, device):
    """Where the train features live: the GPU when they take less than half of its free memory."""
    if device.type != "cuda":
        return device
    free, _total = torch.cuda.mem_get_info(device)
    return device if n_rows * dim * 4 < free / 2 else torch.device("cpu")


@torch.no_grad()
def extract_features(model, dataset, transform, args, device):
    """Collective: l2-normalised features [N, D] and labels [N] in dataset order, on the main
    process (None on the others). Every process computes the rows of its share of the dataset."""
    loader, _ = common.make_loader(IndexedDataset(dataset, transform), args.batch_size_per_gpu,
                                   args.num_workers, train=False)
    features = labels = None
    for images, targets, index in common.progress(loader, desc="features"):
        feats = model(images.to(device, non_blocking=True)).float()
        feats, targets, index = all_gather_rows(feats, targets.to(device), index.to(device))
        if not common.is_main_process():
            continue
        if features is None:
            where = bank_device(len(dataset), feats.shape[1], device)
            features = torch.zeros(len(dataset), feats.shape[1], device=where)
            labels = torch.zeros(len(dataset), dtype=torch.long, device=where)
        # sampler padding: a repeated row
        features[index.to(features.device)] = feats.to(features.device)
        labels[index.to(labels.device)] = targets.to(labels.device)
    if features is None:
        return None, None
    if not features.isfinite().all():     # finite weights can still overflow
        common.die("the network gives non-finite features for "
                   f"{int((~features.isfinite().all(1)).sum())} of {len(dataset)} images: its "
                   "activations overflow; evaluate an earlier checkpoint")
    readable = labels != SKIPPED
    if not readable.all():
        common.log(f"skipped {int((~readable).sum())} unreadable images (--skip_bad_images): left "
                   f"out, image and label")
    return F.normalize(features[readable], dim=1, p=2), labels[readable]


# ================================================================================================
# Weighted k-NN
# ================================================================================================
@torch.no_grad()
def knn_classifier(train_features, train_labels, test_features, test_labels, k, T, num_classes,
                   chunk_size=256):
    """Top-1 and top-5 accuracy (%) of the weighted k-NN vote; top-5 is None with fewer than 5
    classes. Features must be l2-normalised (so the dot product is the cosine similarity).
    Test rows go by chunks of `chunk_size` to the device of the train features."""
    device = train_features.device
    correct_top1 = correct_top5 = 0
    for start in range(0, len(test_labels), chunk_size):
        features = test_features[start:start + chunk_size].to(device)
        targets = test_labels[start:start + chunk_size].to(device)
        # [n, k], most similar first
        similarity, neighbours = (features @ train_features.T).topk(k, dim=1)
        # exp(s / T) overflows float32 below T = 1/88.7 (0.01 gave 1% for 100%); dividing each row
        # by its top weight exp(s_1 / T) leaves the vote's ranking unchanged, every weight in (0, 1]
        weights = ((similarity - similarity[:, :1]) / T).exp()
        one_hot = F.one_hot(train_labels[neighbours], num_classes)  # [n, k, C]
        votes = (one_hot * weights[..., None]).sum(dim=1)           # [n, C]
        ranked = votes.argsort(dim=1, descending=True)[:, :min(5, k)]
        correct = ranked == targets[:, None]
        correct_top1 += correct[:, 0].sum().item()
        correct_top5 += correct.sum().item()
    top5 = 100.0 * correct_top5 / len(test_labels) if num_classes >= 5 else None
    return 100.0 * correct_top1 / len(test_labels), top5


# ================================================================================================
# main
# ================================================================================================
# the authors' names
FEATURE_FILES = ("trainfeat.pth", "trainlabels.pth", "testfeat.pth", "testlabels.pth")


def check_dump_folder(folder):
    """--dump_features names a folder to create or one without features in it: never overwrite."""
    common.make_folder(folder, "--dump_features")
    existing = [name for name in FEATURE_FILES if (Path(folder) / name).exists()]
    if existing:
        common.die(f"--dump_features {folder} already holds {', '.join(existing)}; choose another "
                   f"folder (or delete them)")


def dump_features(folder, tensors):
    """All four files or none: a part (a full disk) would be refused by the next --dump_features
    and --load_features."""
    written = []
    try:
        for name, tensor in zip(FEATURE_FILES, tensors):
            # atomic; a failed write is one line
            common.save_checkpoint(tensor.cpu(), Path(folder) / name)
            written.append(Path(folder) / name)
    finally:
        if len(written) < len(FEATURE_FILES):
            for path in written:
                path.unlink()
    common.log(f"features saved to {folder}")


def load_features(folder):
    """What --dump_features wrote into `folder`: train and test features [N, D] and labels [N],
    checked."""
    if not all((Path(folder) / name).is_file() for name in FEATURE_FILES):
        common.die(f"--load_features {folder} must hold {', '.join(FEATURE_FILES)} (written by "
                   "--dump_features)")
    # refused if empty, truncated or not torch's
    loaded = [common.load_checkpoint(Path(folder) / name, "--load_features",
                                     "; write the features again with --dump_features")
              for name in FEATURE_FILES]
    train_features, train_labels, test_features, test_labels = loaded
    fit = (all(torch.is_tensor(t) for t in loaded)
           and train_features.ndim == test_features.ndim == 2
           and train_labels.ndim == test_labels.ndim == 1
           and train_features.shape[1] == test_features.shape[1]
           and len(train_features) == len(train_labels) and len(test_features) == len(test_labels))
    if not fit:
        shapes = [list(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in loaded]
        common.die(f"--load_features {folder}: the files do not fit together: train features "
                   f"{shapes[0]}, labels {shapes[1]}; test features {shapes[2]}, labels "
                   f"{shapes[3]} (features [N, D] and N labels per split, one D); write them again "
                   "with --dump_features")
    if not (train_features.isfinite().all() and test_features.isfinite().all()):
        common.die(f"--load_features {folder} holds non-finite features (NaN or inf): there is no "
                   "k-NN result")
    labels = torch.cat([train_labels.double(), test_labels.double()])
    if not (labels.isfinite().all() and (labels == labels.round()).all() and (labels >= 0).all()):
        common.die(f"--load_features {folder} holds labels that are no class index (negative, "
                   f"fractional or not finite); write them again with --dump_features")
    # class indices 0..C-1 in their order: another tool's sparse ones (e.g. 10 ** 9) would size the
    # vote's one-hot rows
    dense = torch.unique(labels, return_inverse=True)[1]
    train_labels = dense[:len(train_labels)]
    test_labels = dense[len(train_labels):]
    # the vote needs unit rows and int64 labels: --dump_features wrote them so, another tool may
    # not have
    return (F.normalize(train_features.float(), dim=1), train_labels.long(),
            F.normalize(test_features.float(), dim=1), test_labels.long())


def check_load_features_args(args):
    """--load_features holds features already: a model or data flag beside it would be silently
    unused."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_weights_args(scratch)
    add_eval_data_args(scratch)
    defaults = vars(scratch.parse_args([]))
    unused = [f"--{name}" for name, default in defaults.items() if getattr(args, name) != default]
    unused += ["--dump_features"] * bool(args.dump_features)
    if unused:
        common.die(f"--load_features {args.load_features} evaluates saved features: "
                   f"{', '.join(unused)} would be ignored; drop "
                   f"{'it' if len(unused) == 1 else 'them'}")


def check_nb_knn(nb_knn, n_train):
    if max(nb_knn) > n_train:
        common.die(f"--nb_knn {max(nb_knn)} is more than the {n_train} train images; "
                   f"pass smaller values, e.g. --nb_knn {min(20, n_train)}")


@checks.one_line_exits  # checks
def main(args):
    """Returns {k: (top1, top5)} on the main process, None on the others."""
    device = common.init_distributed(args.device)
    common.fix_random_seeds(args.seed)
    if args.load_features:
        check_load_features_args(args)
        train_features, train_labels, test_features, test_labels = load_features(args.load_features)
        images = {"train": 0, "test": 0}  # (not known: the features are all there is)
    else:
        if args.dump_features:      # checked before the features are extracted, not after
            check_dump_folder(args.dump_features)
        model, info = load_backbone(args.pretrained_weights, args.checkpoint_key, args.arch,
                                    args.patch_size, args.window_size, args.random_init, args.crop)
        model.to(device)
        checks.check_data_path(args)  # checks
        transform = common.eval_transform(args.resize, args.crop)
        # test labels numbered as train's classes
        train_set, test_set = common.build_eval_splits(args)
        images = {"train": len(train_set), "test": len(test_set)}
        common.log(f"data: {len(train_set)} train and {len(test_set)} test images")
        check_nb_knn(args.nb_knn, len(train_set))  # before the features are extracted
        train_features, train_labels = extract_features(model, train_set, transform, args, device)
        test_features, test_labels = extract_features(model, test_set, transform, args, device)
        if args.dump_features and common.is_main_process():
            dump_features(args.dump_features,
                          (train_features, train_labels, test_features, test_labels))
    if not common.is_main_process():
        # as the authors: every process ends after rank 0's k-NN (not a group torn down under it)
        dist.barrier()
        return None

    # an accuracy over no image is none
    for split, labels in (("train", train_labels), ("test", test_labels)):
        if not len(labels) and images[split]:
            common.die(f"none of the {images[split]} {split} images could be read "
                       f"(--skip_bad_images left them all out): there is no k-NN result")
        if not len(labels):
            common.die(f"--load_features {args.load_features} holds no {split} features: there is "
                       "no k-NN result")
    common.log(f"k-NN over {len(train_labels)} train and {len(test_labels)} test images")
    check_nb_knn(args.nb_knn, len(train_labels))
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    results = {}
    for k in args.nb_knn:
        top1, top5 = knn_classifier(train_features, train_labels, test_features, test_labels,
                                    k, args.temperature, num_classes)
        results[k] = (top1, top5)
        common.log(f"{k}-NN classifier result: top-1 {top1:.2f}%"
                   + (f", top-5 {top5:.2f}%" if top5 is not None else ""))
    if common.is_dist():
        dist.barrier()
    return results


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
