"""Correspondence of local features between two views with known geometry (EsViT, Li et al., ICLR
2022, supplementary B.5 and Fig. 6/8/9; GLSD, Lebailly & Tuytelaars, WACV 2023, Section 4.7 and
Fig. 4/5).

Idea. A backbone whose local features describe *what is where* finds the same place of an image in
two augmented views of it by feature similarity alone. Every view here is cropped from the original
image with a recorded geometry (box, flip; `common.grid_centers`), so the true correspondence of
every token is known, and the similarity matching can be scored. The views, the matching and the
metrics are below; this script runs them over a whole split, under torchrun too, and draws
pictures.

Protocols (`--protocols`; view 1 -> view 2):
    esvit    a centre crop (DINO's 224/256 of the shorter side) and its horizontally flipped,
             colour-jittered, randomly grayscaled copy: token (r, c) <-> (r, g-1-c)
    glsd     one random resized crop, seen twice with independent flips and colour augmentation
             (same box and scale, so an exact token-to-token mapping exists)
    overlap  two independent random resized crops (and flips): the truth of a token is the token of
             view 2 nearest in original-image pixels, kept only when it lies inside view 2's box

Metrics. With l2-normalised dense features z1 [T1, D], z2 [T2, D] (the backbone's final-norm
tokens, `forward_dense`), for every token i of view 1 with a ground truth g(i) (the set G):

    m(i) = argmax_j z1_i . z2_j,          s(i) = max_j z1_i . z2_j
    accuracy         = 1/|G| sum_{i in G} [m(i) = g(i)]                          (GLSD Fig. 4)
    distance error   = 1/|G| sum_{i in G} |pos(m(i)) - pos(g(i))|_2, in grid cells of view 2
    top-10 accuracy / distance error: the same over the 10 tokens of G with the highest s(i)
                                      (EsViT Fig. 8: "the top-10 correspondences")

averaged over the pairs (a pair of the overlap protocol without any token in the overlap is not
counted). Chance accuracy (a uniform guess) is 1/T2. Pairs are a pure function of (--seed, image
index), so results do not depend on the number of processes or loader workers.

A learning curve of these metrics comes from the checkpoints a run keeps (`--saveckp_freq`):
run this script on each. Collapse of local features shows as accuracy falling to chance.

Where this file differs from the papers: EsViT scores the top-10 correspondences only, GLSD all of
them; both are reported here. EsViT does not state the unit of its distance error; here it is grid
cells of view 2. GLSD's pipeline is "tweaked" so that "augmentations are always cropped and resized
in the same manner"; this file reads it as the same box (with DINO's global-crop scales) and
independent flips and colour augmentation. Blur and solarisation are not applied.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision import transforms
from torchvision.transforms import functional as TF

# Run as `python extras/tools/eval_correspondence.py` from anywhere: the modules sit two folders up.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import eval_knn  # noqa: E402
try:  # optional beside common.py: a fork may have left it out
    import checks
except ModuleNotFoundError as e:
    raise SystemExit(f"error: eval_correspondence.py needs {e.name}.py beside common.py") from None

import visualize  # noqa: E402  (this file's folder is on sys.path when it runs as a script)


# ================================================================================================
# Views with known geometry, token matching and its metrics
# ================================================================================================
# Every view is cropped with a recorded geometry, so the true match of every token of view 1 in
# view 2 is known, and the similarity matching of the backbone's dense tokens can be scored.
CORRESPONDENCE_PROTOCOLS = ("esvit", "glsd", "overlap")


CORRESPONDENCE_METRICS = ("top10_accuracy", "top10_distance", "accuracy", "distance",
                          "chance_accuracy")


def crop_view(img, box, size, flip):
    """img cropped to box = (left, top, width, height) in pixels, resized to size x size, maybe
    mirrored; and its geometry as `MultiCropAugmentation.crop_and_flip` records it."""
    left, top, w, h = box
    crop = TF.resized_crop(img, top, left, h, w, [size, size], TF.InterpolationMode.BICUBIC)
    crop = TF.hflip(crop) if flip else crop
    W, H = img.size
    return crop, {"box": torch.tensor([left / W, top / H, w / W, h / H]),
                  "flip": torch.tensor(flip), "image_size": torch.tensor([float(W), float(H)])}


class PairViews:
    """img -> (view 1, view 2, geometry 1, geometry 2) of one protocol. All randomness comes from
    torch's RNG (colour jitter too), so `common.SeededDataset` makes every pair reproducible."""
    CENTER_CROP_FRACTION = 224 / 256  # DINO's evaluation transform: Resize(256) -> CenterCrop(224)

    def __init__(self, protocol, crop_size=224, crops_scale=(0.4, 1.0), photometric=True):
        if protocol not in CORRESPONDENCE_PROTOCOLS:
            common.die(f"unknown correspondence protocol {protocol!r}; choose one of "
                       f"{', '.join(CORRESPONDENCE_PROTOCOLS)}")
        self.protocol = protocol
        self.size = crop_size
        self.scale = tuple(crops_scale)
        # DINO's colour augmentation
        colour = [transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                  transforms.RandomGrayscale(p=0.2)] if photometric else []
        normalize = transforms.Normalize(common.IMAGENET_MEAN, common.IMAGENET_STD)
        self.augmented = transforms.Compose(colour + [transforms.ToTensor(), normalize])
        self.clean = transforms.Compose(self.augmented.transforms[-2:])

    def random_box(self, img):
        top, left, h, w = transforms.RandomResizedCrop.get_params(img, list(self.scale),
                                                                  [3 / 4, 4 / 3])
        return left, top, w, h

    def __call__(self, img):
        if self.protocol == "esvit":  # a centre crop vs its flipped, colour-jittered copy
            side = max(1, round(self.CENTER_CROP_FRACTION * min(img.size)))
            box = ((img.size[0] - side) // 2, (img.size[1] - side) // 2, side, side)
            v1, g1 = crop_view(img, box, self.size, False)
            v2, g2 = crop_view(img, box, self.size, True)
            return self.clean(v1), self.augmented(v2), g1, g2
        # glsd: one random box seen twice; overlap: two random boxes
        boxes = ([self.random_box(img)] * 2 if self.protocol == "glsd"
                 else [self.random_box(img), self.random_box(img)])
        (v1, g1), (v2, g2) = (crop_view(img, box, self.size, bool(torch.rand(1).item() < 0.5))
                              for box in boxes)
        return self.augmented(v1), self.augmented(v2), g1, g2


class PairDataset(torch.utils.data.Dataset):
    """(view 1, view 2, geometry 1, geometry 2, index, readable); pair i depends only on (seed, i).
    An unreadable image (--skip_bad_images, evaluated: labelled SKIPPED) gives a pair that is not
    scored."""

    def __init__(self, base, views, seed=0):
        self.seeded = common.SeededDataset(base, views, seed)

    def __len__(self):
        return len(self.seeded)

    def __getitem__(self, index):
        (v1, v2, g1, g2), label = self.seeded[index]
        return v1, v2, g1, g2, index, label != eval_knn.SKIPPED


def ground_truth(geometry1, geometry2, grid1, grid2):
    """For every token of view 1 (an (h1, w1) grid), the flat index of the token of view 2 whose
    centre is nearest in the original image, and whether the token lies inside view 2's box:
    both [B, h1 * w1]. Token cells of a view tile its box in a regular grid, so the nearest centre
    is the centre of the cell that contains the point."""
    xy = common.grid_centers(geometry1, grid1).double()                # [B, T1, 2] original pixels
    box, size = geometry2["box"].double(), geometry2["image_size"].double()
    uv = (xy / size[:, None] - box[:, None, :2]) / box[:, None, 2:]  # in view 2: [0, 1) inside it
    u = torch.where(geometry2["flip"].bool()[:, None], 1 - uv[..., 0], uv[..., 0])
    v = uv[..., 1]
    inside = (u >= 0) & (u < 1) & (v >= 0) & (v < 1)
    h2, w2 = grid2
    col = (u * w2).floor().clamp(0, w2 - 1).long()
    row = (v * h2).floor().clamp(0, h2 - 1).long()
    return row * w2 + col, inside


@torch.no_grad()
def match_pairs(backbone, views1, views2, geometry1, geometry2):
    """Similarity matching of every view-1 token and its ground truth, all [B, T1]: (prediction,
    score, target, valid), and the grid of view 2."""
    _, z1 = backbone.forward_dense(views1)
    _, z2 = backbone.forward_dense(views2)
    grid1, grid2 = tuple(z1.shape[1:3]), tuple(z2.shape[1:3])
    z1 = F.normalize(z1.flatten(1, 2).float(), dim=-1)
    z2 = F.normalize(z2.flatten(1, 2).float(), dim=-1)
    score, prediction = torch.einsum("bsd,btd->bst", z1, z2).max(dim=-1)   # first index on ties
    target, valid = ground_truth({k: v.to(z1.device) for k, v in geometry1.items()},
                                 {k: v.to(z1.device) for k, v in geometry2.items()}, grid1, grid2)
    return prediction, score, target, valid, grid2


def pair_metrics(prediction, score, target, valid, grid2, top=10):
    """Per pair [B]: top-`top` accuracy and distance error, accuracy and distance error over all
    tokens with a ground truth, chance accuracy, and whether the pair has any such token."""
    def masked_mean(x, mask):
        return (x * mask).sum(1) / mask.sum(1).clamp_min(1)

    w2 = grid2[1]
    correct = (prediction == target).double()
    distance = torch.hypot((prediction // w2 - target // w2).double(),
                           (prediction % w2 - target % w2).double())
    # the `top` most similar tokens with a ground truth come first (the others score -inf)
    ranked = score.masked_fill(~valid, float("-inf")).topk(min(top, score.shape[1]), dim=1).indices
    in_top = torch.arange(ranked.shape[1], device=ranked.device) < valid.sum(1, keepdim=True)
    return {"top10_accuracy": 100 * masked_mean(correct.gather(1, ranked), in_top),
            "top10_distance": masked_mean(distance.gather(1, ranked), in_top),
            "accuracy": 100 * masked_mean(correct, valid), "distance": masked_mean(distance, valid),
            "chance_accuracy": torch.full_like(correct[:, 0], 100 / (grid2[0] * grid2[1])),
            "has_truth": valid.any(1)}


def add_correspondence_sums(sums, metrics):
    """sums [len(CORRESPONDENCE_METRICS) + 1] (float64): per-metric sums over the pairs with a
    ground truth, and their count."""
    keep = metrics["has_truth"].double()
    sums += torch.stack([(metrics[k].double() * keep).sum() for k in CORRESPONDENCE_METRICS]
                        + [keep.sum()]).to(sums.device)


def correspondence_means(sums):
    pairs = int(sums[-1].item())
    if not pairs:                              # a metric over no pair is none (not 0%)
        common.die("no pair has a token whose match is known (the overlap protocol scores tokens "
                   "inside both views only): there are no correspondence metrics; use more images "
                   "or larger --crops_scale")
    return {**{k: (sums[i] / max(pairs, 1)).item() for i, k in enumerate(CORRESPONDENCE_METRICS)},
            "pairs": pairs}


PROTOCOLS = CORRESPONDENCE_PROTOCOLS


# ================================================================================================
# Arguments
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("eval_correspondence.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    eval_knn.add_weights_args(p)
    g = p.add_argument_group("correspondence")
    g.add_argument("--protocols", default=list(PROTOCOLS), nargs="+", choices=PROTOCOLS,
                   help="esvit (centre crop vs its flipped, jittered copy), glsd (one random crop "
                        "seen twice), overlap (two random crops, scored inside their overlap)")
    g.add_argument("--crop_size", default=224, type=common.POSITIVE_INT,
                   help="side of both views in pixels; a multiple of the token stride (ViT patch; "
                        "32 for Swin-T, 8 for swin_pico3)")
    g.add_argument("--crops_scale", default=(0.4, 1.0), type=common.AREA_FRACTION, nargs=2,
                   help="area range of the random crops of the glsd and overlap protocols (DINO's "
                        "global crops)")
    g.add_argument("--photometric", default=True, type=common.bool_flag,
                   help="colour jitter and random grayscale on the augmented views (false: "
                        "geometry only)")
    g.add_argument("--split", default="test", choices=["train", "test"],
                   help="which split's images to pair")
    g.add_argument("--max_images", default=0, type=common.COUNT,
                   help="use the first N images of the split (0 = all)")
    g.add_argument("--save_pictures", default=None, type=str,
                   help="write the top-10 matches of the first --num_pictures pairs of every "
                        "protocol as PNGs here")
    g.add_argument("--num_pictures", default=8, type=common.COUNT,
                   help="pairs drawn per protocol with --save_pictures")
    common.add_data_args(p).add_argument("--batch_size_per_gpu", default=64,
                                         type=common.POSITIVE_INT, help="pairs per process")
    eval_knn.add_eval_run_args(p)
    return p


# ================================================================================================
# Scoring a split
# ================================================================================================
def format_metrics(name, m):
    return (f"{name}: top-10 accuracy {m['top10_accuracy']:.2f}%, distance "
            f"{m['top10_distance']:.3f} cells | all tokens: accuracy {m['accuracy']:.2f}% (chance "
            f"{m['chance_accuracy']:.2f}%), distance {m['distance']:.3f} cells | "
            f"{m['pairs']} pairs")


@torch.no_grad()
def evaluate(backbone, pairs, batch_size, num_workers, device, picture_dir=None, num_pictures=0,
             name="pairs"):
    """Metrics over `pairs` (a `PairDataset`). Every process scores pairs rank, rank + world,
    ...; the sums are all-reduced, so every process returns the same dict. Pictures: pairs whose
    index is below `num_pictures`, written by the process that scored them."""
    rank, world = common.get_rank(), common.get_world_size()
    shard = torch.utils.data.Subset(pairs, range(rank, len(pairs), world))
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, num_workers=num_workers,
                                         pin_memory=device.type == "cuda")
    sums = torch.zeros(len(CORRESPONDENCE_METRICS) + 1, dtype=torch.float64, device=device)
    for v1, v2, g1, g2, index, readable in common.progress(loader, desc=name):
        v1, v2 = v1.to(device, non_blocking=True), v2.to(device, non_blocking=True)
        prediction, score, target, valid, grid2 = match_pairs(backbone, v1, v2, g1, g2)
        valid &= readable.to(valid.device)[:, None]  # an unreadable image's pair is not scored
        add_correspondence_sums(sums, pair_metrics(prediction, score, target, valid, grid2))
        if picture_dir and num_pictures:
            for b in ((index < num_pictures) & readable).nonzero().flatten().tolist():
                visualize.save_top_matches(Path(picture_dir) / f"{name}_{int(index[b]):04d}.png",
                                           v1[b], v2[b], prediction[b], score[b], target[b],
                                           valid[b], grid2)
    return correspondence_means(common.all_reduce_sum(sums))


# ================================================================================================
# main
# ================================================================================================
def main(args):
    """Returns {protocol: metrics} (the same on every process)."""
    device = common.init_distributed(args.device)
    common.fix_random_seeds(args.seed)
    checks.check_scale_range("--crops_scale", args.crops_scale)
    if args.save_pictures:  # before any work: a file of that name is one line, not a late traceback
        common.make_folder(args.save_pictures, "--save_pictures")
    model, info = eval_knn.load_backbone(args.pretrained_weights, args.checkpoint_key, args.arch,
                                         args.patch_size, args.window_size, args.random_init,
                                         args.crop_size, "--crop_size")
    backbone = eval_knn.dense_backbone(model).to(device)
    stride = common.token_stride(info["arch"], info["patch_size"])
    if args.crop_size % stride:
        common.die(f"--crop_size {args.crop_size} is not a multiple of the {info['arch']} token "
                   f"stride ({stride} px); use e.g. "
                   f"{max(stride, args.crop_size // stride * stride)}")
    images = common.build_dataset(args, train=args.split == "train")
    # (a --holdout Subset's folder) unreadable images are left out, not their neighbour twice
    if isinstance(getattr(images, "dataset", images), common.ImageFolderSafe):
        getattr(images, "dataset", images).substitute = False
    if args.max_images:
        images = torch.utils.data.Subset(images, range(min(args.max_images, len(images))))
    common.log(f"data: {len(images)} {args.split} images, {args.crop_size} px views, "
               f"{args.crop_size // stride}x{args.crop_size // stride} tokens")
    results = {}
    for protocol in args.protocols:
        views = PairViews(protocol, args.crop_size, args.crops_scale, args.photometric)
        pairs = PairDataset(images, views, args.seed)
        results[protocol] = evaluate(backbone, pairs, args.batch_size_per_gpu, args.num_workers,
                                     device, args.save_pictures, args.num_pictures, name=protocol)
        common.log(format_metrics(protocol, results[protocol]))
    if args.save_pictures and args.num_pictures:
        common.log("pictures of the top-10 matches of the first "
                   f"{min(args.num_pictures, len(images))} pairs of each protocol in "
                   f"{args.save_pictures}")
    return results


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
