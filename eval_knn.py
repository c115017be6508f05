"""Weighted k-NN evaluation of frozen features (Caron et al., "Emerging Properties in Self-Supervised
Vision Transformers", ICCV 2021, appendix "k-NN classification"; Wu et al., CVPR 2018).

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

The backbone comes from `common.load_backbone`, which eval_linear.py uses too: one loader for this
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
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import common


# ================================================================================================
# Arguments (defaults: the authors' eval_knn.py)
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("eval_knn.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_weights_args(p)
    g = p.add_argument_group("k-NN")
    g.add_argument("--nb_knn", default=[10, 20, 100, 200], nargs="+", type=common.POSITIVE_INT,
                   help="numbers of neighbours k; the paper finds k=20 consistently best")
    g.add_argument("--temperature", default=0.07, type=common.POSITIVE,
                   help="T in the vote weight exp(similarity / T), from Wu et al. (not tuned)")
    g.add_argument("--dump_features", default=None,
                   help="save the features and labels to this folder (created; a folder that already holds "
                        "features is refused: they are never overwritten)")
    g.add_argument("--load_features", default=None,
                   help="load features and labels saved by --dump_features (no model, no images)")
    common.add_eval_data_args(p)
    common.add_eval_run_args(p)
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
    """l2-normalised features [N, D] and labels [N] in dataset order, on the main process (None on
    the others). Every process computes the rows of its share of the dataset."""
    loader, _ = common.make_loader(common.IndexedDataset(dataset, transform), args.batch_size_per_gpu,
                                   args.num_workers, train=False)
    features = labels = None
    for images, targets, index in common.progress(loader, desc="features"):
        feats = model(images.to(device, non_blocking=True)).float()
        feats, targets, index = common.all_gather_rows(feats, targets.to(device), index.to(device))
        if not common.is_main_process():
            continue
        if features is None:
            where = bank_device(len(dataset), feats.shape[1], device)
            features = torch.zeros(len(dataset), feats.shape[1], device=where)
            labels = torch.zeros(len(dataset), dtype=torch.long, device=where)
        features[index.to(features.device)] = feats.to(features.device)  # sampler padding: a repeated row
        labels[index.to(labels.device)] = targets.to(labels.device)
    if features is None:
        return None, None
    readable = labels != common.SKIPPED
    if not readable.all():
        common.log(f"skipped {int((~readable).sum())} unreadable images (--skip_bad_images): left out, "
                   f"image and label")
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
        similarity, neighbours = (features @ train_features.T).topk(k, dim=1)  # [n, k], most similar first
        weights = (similarity / T).exp()
        votes = (F.one_hot(train_labels[neighbours], num_classes) * weights[..., None]).sum(dim=1)  # [n, C]
        ranked = votes.argsort(dim=1, descending=True)[:, :min(5, k)]
        correct = ranked == targets[:, None]
        correct_top1 += correct[:, 0].sum().item()
        correct_top5 += correct.sum().item()
    top5 = 100.0 * correct_top5 / len(test_labels) if num_classes >= 5 else None
    return 100.0 * correct_top1 / len(test_labels), top5


# ================================================================================================
# main
# ================================================================================================
FEATURE_FILES = ("trainfeat.pth", "trainlabels.pth", "testfeat.pth", "testlabels.pth")  # the authors' names


def check_dump_folder(folder):
    """--dump_features names a folder to create or one without features in it: never overwrite."""
    common.make_folder(folder, "--dump_features")
    existing = [name for name in FEATURE_FILES if (Path(folder) / name).exists()]
    if existing:
        common.die(f"--dump_features {folder} already holds {', '.join(existing)}; choose another folder "
                   f"(or delete them)")


def main(args):
    """Returns {k: (top1, top5)} on the main process, None on the others."""
    device = common.init_distributed(args.device)
    common.fix_random_seeds(args.seed)
    if args.load_features:
        folder = Path(args.load_features)
        if not all((folder / name).is_file() for name in FEATURE_FILES):
            common.die(f"--load_features {folder} must hold {', '.join(FEATURE_FILES)} (written by --dump_features)")
        train_features, train_labels, test_features, test_labels = (
            torch.load(folder / name, map_location="cpu", weights_only=True) for name in FEATURE_FILES)
    else:
        if args.dump_features:      # checked before the features are extracted, not after
            check_dump_folder(args.dump_features)
        model, info = common.load_backbone(args.pretrained_weights, args.checkpoint_key, args.arch,
                                           args.patch_size, args.window_size, args.random_init, args.crop)
        common.check_eval_crop(args.crop, info["arch"], info["patch_size"])
        model.to(device)
        transform = common.eval_transform(args.resize, args.crop)
        train_set, test_set = common.build_eval_splits(args)    # test labels numbered as train's classes
        common.log(f"data: {len(train_set)} train and {len(test_set)} test images")
        train_features, train_labels = extract_features(model, train_set, transform, args, device)
        test_features, test_labels = extract_features(model, test_set, transform, args, device)
        if args.dump_features and common.is_main_process():
            for name, t in zip(FEATURE_FILES, (train_features, train_labels, test_features, test_labels)):
                torch.save(t.cpu(), Path(args.dump_features) / name)
            common.log(f"features saved to {args.dump_features}")
    if not common.is_main_process():
        return None

    common.log(f"k-NN over {len(train_labels)} train and {len(test_labels)} test images")
    if max(args.nb_knn) > len(train_labels):
        common.die(f"--nb_knn {max(args.nb_knn)} is more than the {len(train_labels)} train images; "
                   f"pass smaller values, e.g. --nb_knn {min(20, len(train_labels))}")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    results = {}
    for k in args.nb_knn:
        top1, top5 = knn_classifier(train_features, train_labels, test_features, test_labels,
                                    k, args.temperature, num_classes)
        results[k] = (top1, top5)
        common.log(f"{k}-NN classifier result: top-1 {top1:.2f}%" + (f", top-5 {top5:.2f}%" if top5 is not None else ""))
    return results


if __name__ == "__main__":
    with common.user_errors():
        main(get_args_parser().parse_args())
