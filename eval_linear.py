"""Linear evaluation of frozen features (Caron et al., "Emerging Properties in Self-Supervised
Vision Transformers", ICCV 2021, appendix "Linear classification"; Swin features as in Li et al.,
"Efficient Self-supervised Vision Transformers for Representation Learning" (EsViT), ICLR 2022).

Protocol. The projection head is removed and the backbone frozen; a linear classifier is trained
on its features with the labels, and central-crop accuracy is reported. The features:

    ViT   the CLS tokens of the last n blocks (n = 4 for ViT-S, 1 for ViT-B), each through the final
          LayerNorm, concatenated [n*D]. With --avgpool_patchtokens (ViT-B, n = 1), the mean of the
          last block's normed patch tokens is added [2D].
    Swin  the token means of the outputs of the last n *blocks* (not stages), concatenated; the
          blocks of the last stage go through the final LayerNorm, earlier blocks do not. For Swin-T
          with n = 4: 384 + 384 + 768 + 768 = 2304 dimensions.
    SelfPatch  the image token of its aggregation head (n does not apply).

Training (the authors' eval_linear.py): Linear(dim, classes) initialised N(0, 0.01), bias 0; SGD
with momentum 0.9 and no weight decay, lr = 0.001 * total batch / 256, cosine annealing to 0 over
the epochs (one value per epoch: lr_e = lr (1 + cos(pi e / epochs)) / 2, the values of the authors'
CosineAnnealingLR), 100 epochs; cross-entropy. Train images: RandomResizedCrop
(PyTorch defaults) + horizontal flip; validation images: Resize(256, bicubic) + CenterCrop(224).
The paper sweeps the learning rate per model: --lr is the knob to tune.

--precomputed_features true (not the paper's protocol; a cheap probe for small models on a CPU): the
train images pass through the frozen backbone once, with the validation transform and no
augmentation, and the classifier trains on those features for every epoch; the epochs then cost
a pass over a feature matrix instead of a pass of the backbone. Same classifier, optimiser and
schedule. The features of the whole train split are held in memory (images x dimensions floats).

Where this file differs from the authors' eval_linear.py:
  * with --avgpool_patchtokens the authors' code interleaves CLS and patch-mean channels
    ([cls_0, avg_0, cls_1, avg_1, ...]); this file keeps that layout, so their linear weights load,
    and, as in their code, allows it with one block only (n_last_blocks = 1);
  * the last incomplete train batch is dropped (common.make_loader); validation counts every
    image exactly once, also under torchrun;
  * the learning rate of epoch e is computed from (e, --epochs) instead of being a scheduler state
    that is saved and restored, so a run resumed with more --epochs follows the longer schedule;
  * the checkpoint is linear_checkpoint.pth (not checkpoint.pth.tar), and an --output_dir that
    holds another script's run (a pretraining folder) is refused, so that no run's files are
    overwritten;
  * as the training scripts, a SIGTERM or SIGUSR1 (a preemption) writes linear_checkpoint.pth (at
    the epoch's end or mid-epoch) and exits 0; the same command resumes it.
"""
import argparse
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import transforms

import checks
import common
import eval_knn


# ================================================================================================
# Arguments (defaults: the authors' eval_linear.py)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("eval_linear.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    eval_knn.add_weights_args(p)
    g = p.add_argument_group("linear probe")
    g.add_argument("--n_last_blocks", default=4, type=common.POSITIVE_INT,
                   help="concatenate the features of the last n blocks: 4 for ViT-S (the paper "
                        "finds 4 best), 1 for ViT-B; EsViT uses 4 for Swin")
    g.add_argument("--avgpool_patchtokens", default=False, type=common.bool_flag,
                   help="add the mean of the patch tokens to the CLS token (ViT only, with "
                        "--n_last_blocks 1; the paper's choice for ViT-B)")
    g.add_argument("--epochs", default=100, type=common.EPOCHS,
                   help="epochs of the linear probe (the authors: 100)")
    g.add_argument("--lr", default=0.001, type=common.NONNEGATIVE,
                   help="lr at total batch 256 (linear scaling); "
                        "the paper sweeps it for each model")
    g.add_argument("--val_freq", default=1, type=common.POSITIVE_INT,
                   help="validate every N epochs (and after the last)")
    g.add_argument("--num_labels", default=None, type=common.POSITIVE_INT,
                   help="number of classes (default: from the dataset)")
    g.add_argument("--precomputed_features", default=False, type=common.bool_flag,
                   help="extract the train features once (validation transform, no augmentation) "
                        "and train the classifier on them: epochs cost seconds; not the paper's "
                        "protocol (it augments every epoch)")
    eval_knn.add_eval_data_args(p)
    g = eval_knn.add_eval_run_args(p)
    g.add_argument("--output_dir", default=".", type=str,
                   help="args.json, log.txt and linear_checkpoint.pth; a run resumes from here. "
                        "Not a folder of another script's run, and one run at a time (.lock)")
    g.add_argument("--max_steps_per_epoch", default=0, type=common.COUNT,
                   help="stop each epoch after N steps (0 = full epoch); for smoke tests")
    return p


# ================================================================================================
# Features of the frozen backbone
# ================================================================================================
def vit_features(vit, x, n_last_blocks, avgpool_patchtokens=False):
    """CLS tokens of the last n blocks, each through the final norm, concatenated [B, n*D]. With
    avgpool_patchtokens (n = 1) the mean of the normed patch tokens is interleaved channel by
    channel with the CLS token, the authors' layout: [cls_0, avg_0, cls_1, avg_1, ...] [B, 2D]."""
    tokens = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
    outputs = []
    for i, block in enumerate(vit.blocks):
        tokens = block(tokens)
        if i >= len(vit.blocks) - n_last_blocks:
            outputs.append(vit.norm(tokens))
    features = torch.cat([out[:, 0] for out in outputs], dim=-1)
    if avgpool_patchtokens:
        patch_mean = outputs[-1][:, vit.num_prefix_tokens:].mean(dim=1)
        features = torch.stack([features, patch_mean], dim=-1).flatten(1)
    return features


def swin_features(swin, x, n_last_blocks):
    """Token means of the outputs of the last n blocks (counted across stages), concatenated; the
    blocks of the last stage through the final norm, earlier blocks without (EsViT)."""
    tokens = swin.patch_embed(x)  # [B, h, w, C]
    n_blocks = sum(len(stage.blocks) for stage in swin.layers)
    outputs = []
    i = 0  # blocks seen, counted across stages
    for s, stage in enumerate(swin.layers):
        tokens = stage.downsample(tokens)
        for block in stage.blocks:
            tokens = block(tokens)
            i += 1
            if i > n_blocks - n_last_blocks:
                last_stage = s == len(swin.layers) - 1
                outputs.append((swin.norm(tokens) if last_stage else tokens).mean(dim=(1, 2)))
    return torch.cat(outputs, dim=-1)


def probe_features(model, x, args):
    if isinstance(model, common.ViT):
        return vit_features(model, x, args.n_last_blocks, args.avgpool_patchtokens)
    if isinstance(model, common.Swin):
        return swin_features(model, x, args.n_last_blocks)
    return model(x)  # SelfPatch: the aggregation head's image token


def check_feature_args(model, args):
    if isinstance(model, common.ViT):
        n_max = len(model.blocks)
        if args.avgpool_patchtokens and args.n_last_blocks != 1:
            common.die("--avgpool_patchtokens true needs --n_last_blocks 1 (the authors' layout "
                       "interleaves one CLS token with the patch mean)")
    elif isinstance(model, common.Swin):
        n_max = sum(len(stage.blocks) for stage in model.layers)
        if args.avgpool_patchtokens:
            common.die("--avgpool_patchtokens applies to ViT CLS features; a Swin feature is "
                       "already a token mean")
    else:
        if args.avgpool_patchtokens:
            common.die("--avgpool_patchtokens applies to ViT CLS features; SelfPatch's is its "
                       "aggregation head's image token")
        common.log("SelfPatch: the feature is the aggregation head's image token (--n_last_blocks "
                   "does not apply)")
        return
    if not 1 <= args.n_last_blocks <= n_max:
        common.die(f"--n_last_blocks {args.n_last_blocks} is out of range: this backbone has "
                   f"{n_max} blocks")


@torch.no_grad()
def extract_features(model, dataset, args, device):
    """Collective: the probe features and labels of every readable image of `dataset`, in dataset
    order, on every process (each process extracts its share; the rows are exchanged), and how many
    were unreadable. In host memory: a GPU holds only the batches (ImageNet's ViT-S features are 7.9
    GB, once per process)."""
    indexed = eval_knn.IndexedDataset(dataset, common.eval_transform(args.resize, args.crop))
    loader, _ = common.make_loader(indexed, args.batch_size_per_gpu, args.num_workers,
                                   train=False)
    features = labels = None
    for images, batch_labels, index in common.progress(loader, desc="features"):
        rows = probe_features(model, images.to(device), args).float()
        rows, batch_labels, index = eval_knn.all_gather_rows(rows, batch_labels.to(device),
                                                             index.to(device))
        if features is None:
            features = torch.zeros(len(dataset), rows.shape[1])
            labels = torch.full((len(dataset),), eval_knn.SKIPPED, dtype=torch.long)
        # the distributed sampler's padding rows repeat real images
        features[index.cpu()], labels[index.cpu()] = rows.cpu(), batch_labels.cpu()
    if features is None:
        common.die("the train split has no images: there is nothing to train a linear probe on")
    readable = labels != eval_knn.SKIPPED
    return features[readable], labels[readable], int((~readable).sum())


class CachedFeatures:
    """Batches of precomputed (features, labels) for one epoch: a new shuffle per (seed, epoch), an
    equal share per process, the last incomplete batch dropped (as `common.make_loader` does)."""

    def __init__(self, features, labels, batch_size, seed):
        self.features = features
        self.labels = labels
        self.batch_size = batch_size
        self.seed = seed
        self.steps = len(features) // common.get_world_size() // batch_size  # of an epoch
        if len(features) < batch_size * common.get_world_size():
            common.die(f"the train split has {len(features)} readable images, fewer than one batch "
                       f"({batch_size} per process x {common.get_world_size()} processes); lower "
                       "--batch_size_per_gpu")

    def batches(self, epoch):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(len(self.features), generator=generator)
        share = len(order) // common.get_world_size()
        order = order[common.get_rank() * share:(common.get_rank() + 1) * share]
        order = order.to(self.features.device)
        return [(self.features[order[i:i + self.batch_size]],
                 self.labels[order[i:i + self.batch_size]])
                for i in range(0, share - self.batch_size + 1, self.batch_size)]


class LinearClassifier(nn.Module):
    """Linear(dim, num_labels), weights N(0, 0.01), bias 0."""

    def __init__(self, dim, num_labels):
        super().__init__()
        self.linear = nn.Linear(dim, num_labels)
        nn.init.normal_(self.linear.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return self.linear(x.flatten(1))


# ================================================================================================
# One epoch, validation
# ================================================================================================
def train_one_epoch(model, classifier, batches, optimizer, epoch, steps, args, device, save):
    """Steps `steps` (a range) of `epoch` on `batches` (from the range's start). On a preemption
    signal (in any process) `save(epoch, step)` before the epoch's end, then exit 0."""
    classifier.train()
    total_loss = 0.0
    bar = common.progress(batches, desc=f"epoch {epoch}", total=len(steps))
    for it, (images, labels) in zip(steps, bar):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.no_grad():
            features = probe_features(model, images, args)
        loss = F.cross_entropy(classifier(features), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        stats, preempted = common.average_step_stats({"loss": loss})  # the mean over processes
        total_loss += stats["loss"]
        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
        if preempted and it + 1 < steps.stop:  # at the epoch's end main() saves
            save(epoch, it + 1)
            common.exit_after_preemption(args.output_dir, "linear_checkpoint.pth")
    return {"train_loss": total_loss / max(len(steps), 1), "lr": optimizer.param_groups[0]["lr"]}


@torch.no_grad()
def validate(model, classifier, loader, n_images, num_labels, args, device):
    """Collective: loss, top-1 and top-5 (with at least 5 classes) over every validation image
    exactly once."""
    classifier.eval()
    # per image: loss, top-1 correct, top-5 correct, readable
    per_image = torch.zeros(n_images, 4, device=device)
    for images, labels, index in common.progress(loader, desc="validation"):
        images, labels, index = images.to(device), labels.to(device), index.to(device)
        logits = classifier(probe_features(model, images, args))
        readable = labels != eval_knn.SKIPPED                       # unreadable images are left out
        labels = labels.clamp_min(0)
        ranked = logits.topk(min(5, num_labels), dim=1).indices == labels[:, None]
        rows = torch.stack([F.cross_entropy(logits, labels, reduction="none"),
                            ranked[:, 0].float(), ranked.any(dim=1).float(), readable.float()],
                           dim=1)
        rows, index = eval_knn.all_gather_rows(rows, index)
        per_image[index] = rows  # the distributed sampler's padding rows repeat real images
    kept = per_image[:, 3] > 0
    if not kept.any():               # an accuracy over no image is none (not 0%, not NaN)
        common.die(f"none of the {n_images} validation images could be read (--skip_bad_images "
                   f"left them all out): there is no accuracy to report")
    loss, top1, top5 = per_image[kept, :3].mean(dim=0).tolist()
    return {"val_loss": loss, "val_top1": 100 * top1,
            **({"val_top5": 100 * top5} if num_labels >= 5 else {}),
            "val_images": int(kept.sum()), "val_skipped_images": int((~kept).sum())}


def train_transform(crop):
    return transforms.Compose([transforms.RandomResizedCrop(crop),
                               transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(),
                               transforms.Normalize(common.IMAGENET_MEAN, common.IMAGENET_STD)])


def weights_identity(model, args):
    """What the probe is trained on: the weights file, the network taken from it and a checksum of
    the loaded weights (float64 sum of every tensor: it does not change if the file is moved)."""
    tensors = [t.double().sum() for t in model.state_dict().values() if t.is_floating_point()]
    weights = str(Path(args.pretrained_weights).resolve()) if args.pretrained_weights else ""
    return {"weights": weights, "checkpoint_key": args.checkpoint_key,
            "random_init": args.random_init,
            "weights_checksum": float(torch.stack(tensors).sum()) if tensors else 0.0}


def check_same_weights(ckpt, identity, ckpt_path):
    """A probe trained on other weights must not be resumed, nor its accuracy reported."""
    old = ckpt.get("backbone", {})
    if "weights_checksum" not in old:
        common.die(f"{ckpt_path} does not record which weights its probe was trained on; delete it "
                   f"or use another --output_dir")
    same = (old["checkpoint_key"] == identity["checkpoint_key"]
            and old["random_init"] == identity["random_init"]
            and math.isclose(old["weights_checksum"], identity["weights_checksum"], rel_tol=1e-9,
                             abs_tol=1e-9))
    if not same:
        common.die(f"{ckpt_path} holds a linear probe trained on other weights "
                   f"({old['weights'] or 'random init'} [{old['checkpoint_key']}]), not "
                   f"{identity['weights'] or 'random init'} [{identity['checkpoint_key']}]: "
                   "refusing to resume it; use another --output_dir or delete it")


# What a resumed probe may change: where and how it runs; the weights are checked by
# `check_same_weights`.
NOT_TRAINED_ARGS = {"output_dir", "device", "num_workers", "data_path", "skip_bad_images",
                    "val_freq", "epochs", "pretrained_weights", "arch", "patch_size", "window_size"}


def check_same_setup(ckpt, args, ckpt_path):
    """A probe resumed with other arguments would report a best top-1 of two setups: refused,
    naming each."""
    changed = common.changed_args(ckpt.get("args", {}), args, NOT_TRAINED_ARGS)
    if changed:
        common.die(f"{ckpt_path} holds a probe trained with other arguments: {', '.join(changed)}; "
                   f"run with its values, or use another --output_dir")
    if ckpt["epoch"] + bool(ckpt["step"]) > args.epochs:
        steps = f" and {ckpt['step']} steps" if ckpt["step"] else ""
        common.die(f"{ckpt_path} has already trained {ckpt['epoch']} epochs{steps}, more than "
                   f"--epochs {args.epochs}")


def count_labels(dataset, args):
    """The classifier's outputs: one per class of the train split. --num_labels must agree (fewer
    outputs than labels fail inside the loss, more would be classes that never occur)."""
    classes = getattr(dataset, "classes", None)
    if classes is None:
        labels = getattr(dataset, "targets", None)
        labels = getattr(dataset, "labels", None) if labels is None else labels
        if not args.num_labels:
            common.die(f"cannot tell the number of classes of --dataset {args.dataset}; pass "
                       "--num_labels")
        if labels is not None and len(labels) and int(max(labels)) >= args.num_labels:
            common.die(f"--num_labels {args.num_labels} is too few: the train split has label "
                       f"{int(max(labels))}")
        return args.num_labels
    if args.num_labels and args.num_labels != len(classes):
        common.die(f"--num_labels {args.num_labels} does not match the {len(classes)} classes of "
                   f"the train split; leave it out (the classes are counted)")
    return len(classes)


def check_own_folder(args):
    """eval_linear.py writes args.json, log.txt and linear_checkpoint.pth into --output_dir: never
    into a training run's folder (its checkpoint.pth; `common.claim_output_dir` refuses a folder
    whose args.json names another script)."""
    folder = Path(args.output_dir)
    if (folder / "checkpoint.pth").exists():
        common.die(f"--output_dir {folder} holds a training run (checkpoint.pth), whose args.json "
                   f"and log.txt eval_linear.py would overwrite; give the probe its own folder")


# ================================================================================================
# main
# ================================================================================================
@checks.one_line_exits  # checks
def main(args):
    """Returns the best validation top-1 (%)."""
    device = common.init_distributed(args.device)
    common.install_preemption_handler()
    common.fix_random_seeds(args.seed)
    # recorded: with --batch_size_per_gpu, the total batch and lr
    args.world_size = common.get_world_size()
    check_own_folder(args)

    # ---- frozen backbone; the linear probe's input size from one dry run
    model, info = eval_knn.load_backbone(args.pretrained_weights, args.checkpoint_key, args.arch,
                                         args.patch_size, args.window_size, args.random_init,
                                         args.crop)
    identity = weights_identity(model, args)
    # the weights are readable: the folder becomes this run's (a refused command makes none)
    checks.claim_output_dir(args.output_dir, "eval_linear.py", "linear_checkpoint.pth")  # checks

    # ---- a probe to resume from output_dir/linear_checkpoint.pth: refused before any data work if
    # it is another's
    ckpt_path = Path(args.output_dir) / "linear_checkpoint.pth"
    ckpt = common.load_checkpoint(ckpt_path) if ckpt_path.exists() else None
    ckpt = common.agree_on_resume(ckpt_path, ckpt)         # rank 0 decides, for every node
    if ckpt is not None:
        ckpt.setdefault("step", 0)  # a probe saved only at epoch ends
        check_same_weights(ckpt, identity, ckpt_path)
        if ckpt.get("args", {}).get("precomputed_features", False) != args.precomputed_features:
            common.die(f"{ckpt_path} holds a probe trained with --precomputed_features "
                       f"{str(not args.precomputed_features).lower()}: resume it with that "
                       "setting, or use another --output_dir")
        check_same_setup(ckpt, args, ckpt_path)
    model.to(device)
    check_feature_args(model, args)
    with torch.no_grad():
        dim = probe_features(model, torch.zeros(1, 3, args.crop, args.crop, device=device),
                             args).shape[1]

    # ---- data: augmentations depend only on (seed, epoch, index)
    checks.check_data_path(args)  # checks
    train_set, val_set = common.build_eval_splits(args)  # val labels numbered as train's classes
    num_labels = count_labels(train_set, args)
    data = {"train": common.dataset_record(train_set), "validation": common.dataset_record(val_set)}
    # (probes written before the record: unchecked)
    for split in data if ckpt is not None and "data" in ckpt else ():
        old, new = ckpt["data"][split]["images"], data[split]["images"]
        if ckpt["data"][split] != data[split]:
            change = (f"{old} images, now {new}" if old != new
                      else f"{new} images as now, but other files or labels")
            common.die(f"{ckpt_path} was trained on another {split} split ({change}): refusing to "
                       f"resume it; resume with the same data, or use another --output_dir")
    if args.precomputed_features:  # the backbone's one pass over the train split
        features, labels, unreadable = extract_features(model, train_set, args, device)
        cached = CachedFeatures(features, labels, args.batch_size_per_gpu, args.seed)
        common.log(f"precomputed {len(features)} train features "
                   f"({features.numel() * 4 / 2**20:.0f} MB)")
    else:
        train_data = common.SeededDataset(train_set, train_transform(args.crop), seed=args.seed)
        train_loader, sampler = common.make_loader(train_data, args.batch_size_per_gpu,
                                                   args.num_workers, train=True, seed=args.seed)
    val_indexed = eval_knn.IndexedDataset(val_set, common.eval_transform(args.resize, args.crop))
    val_loader, _ = common.make_loader(val_indexed, args.batch_size_per_gpu, args.num_workers,
                                       train=False)
    common.log(f"data: {len(train_set)} train and {len(val_set)} val images, {num_labels} classes; "
               f"linear probe on {dim}-dimensional features")

    classifier = LinearClassifier(dim, num_labels).to(device)
    if common.is_dist():
        classifier = nn.parallel.DistributedDataParallel(
            classifier, device_ids=[device] if device.type == "cuda" else None)
    total_batch = args.batch_size_per_gpu * common.get_world_size()
    optimizer = torch.optim.SGD(classifier.parameters(), lr=0, momentum=0.9, weight_decay=0)
    # one value per epoch
    lr_schedule = common.cosine_scheduler(args.lr * total_batch / 256, 0, args.epochs, 1)

    # ---- resume (log.txt kept to the epochs that the checkpoint holds)
    start_epoch, start_step = common.resume_position(ckpt, args.output_dir)
    best_top1 = 0.0
    validated = {}  # the image counts of the last validation
    if ckpt is not None:
        common.restore(ckpt, linear=classifier, optimizer=optimizer)
        best_top1 = ckpt["best_top1"]
        validated = ckpt.get("validated", {})
        common.log(f"resumed from {ckpt_path} at epoch {start_epoch}, step {start_step} (best "
                   f"top-1 so far {best_top1:.2f}%)")

    def save(epoch, step):
        """linear_checkpoint.pth: the probe at batch `step` of `epoch` (rank 0 writes)."""
        if common.is_main_process():
            common.save_checkpoint({"linear": common.unwrap(classifier).state_dict(),
                                    "optimizer": optimizer.state_dict(), "epoch": epoch,
                                    "step": step, "best_top1": best_top1, "args": vars(args),
                                    "backbone": {**info, **identity}, "data": data,
                                    "validated": validated}, ckpt_path)

    n_steps = cached.steps if args.precomputed_features else len(train_loader)
    n_steps = min(n_steps, args.max_steps_per_epoch or n_steps)
    common.save_args(args, "eval_linear.py")  # every start-up check passed
    for epoch in range(start_epoch, args.epochs):
        for group in optimizer.param_groups:
            group["lr"] = float(lr_schedule[epoch])
        steps = range(start_step, n_steps)
        if args.precomputed_features:   # the features are the input: the "backbone" is the identity
            record = train_one_epoch(nn.Identity(), classifier, cached.batches(epoch)[start_step:],
                                     optimizer, epoch, steps, args, device, save)
        else:
            sampler.set_epoch(epoch, start_batch=start_step)  # mid-epoch resume: skips seen ones
            record = train_one_epoch(model, classifier, train_loader, optimizer, epoch, steps,
                                     args, device, save)
        start_step = 0
        if not math.isfinite(record["train_loss"]):     # a diverged probe's accuracy is no result
            common.die(f"the probe's train loss is {record['train_loss']} at epoch {epoch} (this "
                       f"epoch is not saved): lower --lr (now {args.lr:g}), or check the features")
        if epoch % args.val_freq == 0 or epoch == args.epochs - 1:
            record.update(validate(model, classifier, val_loader, len(val_set), num_labels, args,
                                   device))
            best_top1 = max(best_top1, record["val_top1"])
            validated = {k: record[k] for k in ("val_images", "val_skipped_images")}
        skipped = (unreadable if args.precomputed_features
                   else common.skipped_images_all_ranks(train_data, device))
        record.update(epoch=epoch, best_top1=best_top1, skipped_images=skipped)
        common.append_log(args.output_dir, record)  # before the checkpoint that marks it done
        save(epoch + 1, 0)
        common.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items()))
        if any(common.all_gather_objects(common.preemption_requested(device))):  # any signal
            common.exit_after_preemption(args.output_dir, "linear_checkpoint.pth")
    skipped = validated.get("val_skipped_images", 0)
    common.log(f"linear probe: best top-1 {best_top1:.2f}% on "
               f"{validated.get('val_images', len(val_set))} validation images"
               + (f" ({skipped} unreadable, left out)" if skipped else ""))
    return best_top1


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
