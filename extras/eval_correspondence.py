"""Correspondence of local features between two views with known geometry (EsViT, Li et al., ICLR
2022, supplementary B.5 and Fig. 6/8/9; GLSD, Lebailly & Tuytelaars, WACV 2023, Section 4.7 and
Fig. 4/5).

Idea. A backbone whose local features describe *what is where* finds the same place of an image in
two augmented views of it by feature similarity alone. Every view here is cropped from the original
image with a recorded geometry (box, flip; `common.grid_centers`), so the true correspondence of
every token is known, and the similarity matching can be scored. The views, the matching and the
metrics live in common.py (section 10), which the training scripts' --monitor_correspondence
shares; this script runs them over a whole split, under torchrun too, and draws pictures.

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

`common.CorrespondenceMonitor` computes the same metrics on a few fixed images once per epoch
during self-supervised training (`--monitor_correspondence N`): collapse of local features shows
as accuracy falling to chance.

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

# Run as `python extras/eval_correspondence.py` from anywhere: the project's modules sit one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

import visualize  # noqa: E402  (this file's folder is on sys.path when it runs as a script)

PROTOCOLS = common.CORRESPONDENCE_PROTOCOLS


# ================================================================================================
# Arguments
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("eval_correspondence.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_weights_args(p)
    g = p.add_argument_group("correspondence")
    g.add_argument("--protocols", default=list(PROTOCOLS), nargs="+", choices=PROTOCOLS,
                   help="esvit (centre crop vs its flipped, jittered copy), glsd (one random crop seen "
                        "twice), overlap (two random crops, scored inside their overlap)")
    g.add_argument("--crop_size", default=224, type=int,
                   help="side of both views in pixels; a multiple of the token stride (ViT patch; 32 for Swin-T, 8 for swin_pico3)")
    g.add_argument("--crops_scale", default=(0.4, 1.0), type=float, nargs=2,
                   help="area range of the random crops of the glsd and overlap protocols (DINO's global crops)")
    g.add_argument("--photometric", default=True, type=common.bool_flag,
                   help="colour jitter and random grayscale on the augmented views (false: geometry only)")
    g.add_argument("--split", default="test", choices=["train", "test"], help="which split's images to pair")
    g.add_argument("--max_images", default=0, type=int, help="use the first N images of the split (0 = all)")
    g.add_argument("--save_pictures", default=None, type=str,
                   help="write the top-10 matches of the first --num_pictures pairs of every protocol as PNGs here")
    g.add_argument("--num_pictures", default=8, type=int, help="pairs drawn per protocol with --save_pictures")
    common.add_data_args(p).add_argument("--batch_size_per_gpu", default=64, type=int, help="pairs per process")
    common.add_eval_run_args(p)
    return p


# ================================================================================================
# Scoring a split
# ================================================================================================
def format_metrics(name, m):
    return (f"{name}: top-10 accuracy {m['top10_accuracy']:.2f}%, distance {m['top10_distance']:.3f} cells | "
            f"all tokens: accuracy {m['accuracy']:.2f}% (chance {m['chance_accuracy']:.2f}%), "
            f"distance {m['distance']:.3f} cells | {m['pairs']} pairs")


@torch.no_grad()
def evaluate(backbone, pairs, batch_size, num_workers, device, picture_dir=None, num_pictures=0, name="pairs"):
    """Metrics over `pairs` (a `common.PairDataset`). Every process scores pairs rank, rank + world,
    ...; the sums are all-reduced, so every process returns the same dict. Pictures: pairs whose
    index is below `num_pictures`, written by the process that scored them."""
    rank, world = common.get_rank(), common.get_world_size()
    shard = torch.utils.data.Subset(pairs, range(rank, len(pairs), world))
    loader = torch.utils.data.DataLoader(shard, batch_size=batch_size, num_workers=num_workers,
                                         pin_memory=device.type == "cuda")
    sums = torch.zeros(len(common.CORRESPONDENCE_METRICS) + 1, dtype=torch.float64, device=device)
    for v1, v2, g1, g2, index in common.progress(loader, desc=name):
        v1, v2 = v1.to(device, non_blocking=True), v2.to(device, non_blocking=True)
        prediction, score, target, valid, grid2 = common.match_pairs(backbone, v1, v2, g1, g2)
        common.add_correspondence_sums(sums, common.pair_metrics(prediction, score, target, valid, grid2))
        if picture_dir and num_pictures:
            for b in (index < num_pictures).nonzero().flatten().tolist():
                visualize.save_top_matches(Path(picture_dir) / f"{name}_{int(index[b]):04d}.png", v1[b], v2[b],
                                           prediction[b], score[b], target[b], valid[b], grid2)
    return common.correspondence_means(common.all_reduce_sum(sums))


# ================================================================================================
# main
# ================================================================================================
def main(args):
    """Returns {protocol: metrics} (the same on every process)."""
    device = common.init_distributed(args.device)
    common.fix_random_seeds(args.seed)
    common.check_scale_range("--crops_scale", args.crops_scale)
    if args.save_pictures:         # before any work: a file of that name is one line, not a late traceback
        common.make_folder(args.save_pictures, "--save_pictures")
    model, info = common.load_backbone(args.pretrained_weights, args.checkpoint_key, args.arch, args.patch_size,
                                       args.window_size, args.random_init, args.crop_size)
    backbone = common.dense_backbone(model).to(device)
    stride = common.token_stride(info["arch"], info["patch_size"])
    if args.crop_size % stride:
        common.die(f"--crop_size {args.crop_size} is not a multiple of the {info['arch']} token stride ({stride} px); "
                   f"use e.g. {max(stride, args.crop_size // stride * stride)}")
    images = common.build_dataset(args, train=args.split == "train")
    if args.max_images:
        images = torch.utils.data.Subset(images, range(min(args.max_images, len(images))))
    common.log(f"data: {len(images)} {args.split} images, {args.crop_size} px views, "
               f"{args.crop_size // stride}x{args.crop_size // stride} tokens")
    results = {}
    for protocol in args.protocols:
        views = common.PairViews(protocol, args.crop_size, args.crops_scale, args.photometric)
        pairs = common.PairDataset(images, views, args.seed)
        results[protocol] = evaluate(backbone, pairs, args.batch_size_per_gpu, args.num_workers, device,
                                     args.save_pictures, args.num_pictures, name=protocol)
        common.log(format_metrics(protocol, results[protocol]))
    if args.save_pictures:
        common.log(f"pictures of the top-10 matches in {args.save_pictures}")
    return results


if __name__ == "__main__":
    with common.user_errors():
        main(get_args_parser().parse_args())
