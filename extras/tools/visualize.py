"""Pictures of what local features learn, as PNG files (torchvision's image grids and masks, and
Pillow's ImageDraw for lines, dots and numbers; no plotting library):

    matches     two views side by side, the top-10 most similar token matches as numbered lines
                (EsViT Fig. 6/9); written by
                `extras/tools/eval_correspondence.py --save_pictures DIR`
    attention   the last ViT block's attention of the CLS query, per head, and the smallest set of
                patches holding 60% of its mass (DINO Fig. 3, EsViT Fig. 7)
    matchings   the token matchings of one training step on one image, teacher crop left, student
                crop right, every student token linked to its matched teacher token: top row by
                backbone similarity (EsViT, GLSD's Similarity), bottom row by geometry (GLSD's
                Geometric; rejected matches are not drawn) (GLSD Fig. 3 and 8-11)
    crops       what a training run sees: per image, the image and its 2 global and N local crops,
                exactly as epoch 0 of a run with the same --seed and crop flags draws them (look at
                them before tuning a recipe: is the object still there after crop, blur, solarize?)

    python extras/tools/visualize.py attention --pretrained_weights runs/dino/checkpoint.pth \
        --image photo.jpg --output attention.png
    python extras/tools/visualize.py matchings --pretrained_weights runs/glsd/checkpoint.pth \
        --dataset synthetic --synthetic_image_size 64 --global_crop_size 64 --local_crop_size 32 \
        --output matchings.png
    python extras/tools/visualize.py crops --dataset fashion_mnist --global_crop_size 32 \
        --local_crop_size 16 --local_crops_number 4 --indices 0 1 2 3 --output crops.png

(The comparison's learning curves: extras/experiments/curves.py.)

The 60% threshold: per head, sort the patches by attention, keep the largest ones until their sum
reaches 60% of the total (the patch that crosses the line is kept), as DINO's visualisation does.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torchvision.io import encode_png
from torchvision.transforms.functional import pil_to_tensor, to_pil_image
from torchvision.utils import draw_segmentation_masks, make_grid

# Run as `python extras/tools/visualize.py` from anywhere: the project's modules sit two
# folders up.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import eval_knn  # noqa: E402
try:  # the optional files beside common.py: a fork may have left them out
    import checks
    import device_crops
except ModuleNotFoundError as e:
    raise SystemExit(f"error: visualize.py needs {e.name}.py beside common.py") from None

GREEN, RED = (40, 220, 60), (240, 40, 40)
PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
           (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
           (0, 128, 128), (170, 110, 40)]


# ================================================================================================
# Drawing helpers
# ================================================================================================
def to_uint8(view, size):
    """A normalised view [3, H, W] -> uint8 [3, size, size] (ImageNet normalisation undone)."""
    mean, std = (torch.tensor(v, device=view.device)[:, None, None]
                 for v in (common.IMAGENET_MEAN, common.IMAGENET_STD))
    image = F.interpolate((view.float() * std + mean)[None], size=(size, size), mode="bilinear",
                          align_corners=False, antialias=True)[0]
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def token_xy(index, grid, size, x_offset=0):
    """Pixel centres [N, 2] (x, y) of flat token indices of an (h, w) grid over a size x size
    picture."""
    h, w = grid
    index = torch.as_tensor(index).cpu()
    x = (index % w + 0.5) * size / w + x_offset
    y = (index // w + 0.5) * size / h
    return torch.stack([x, y], -1).float()


def side_by_side(left, right, gap):
    canvas = torch.full((3, left.shape[1], left.shape[2] + gap + right.shape[2]), 255,
                        dtype=torch.uint8)
    canvas[:, :, :left.shape[2]], canvas[:, :, left.shape[2] + gap:] = left, right
    return canvas


def draw_links(canvas, starts, ends, colours, width=1, radius=2, labels=None):
    """Lines starts[i] -> ends[i] with a dot at both ends, each in colours[i]; with `labels`,
    labels[i] written next to starts[i], outlined in black so that it reads on any background."""
    picture = to_pil_image(canvas)
    draw = ImageDraw.Draw(picture)
    for i, (start, end, colour) in enumerate(zip(starts.tolist(), ends.tolist(), colours)):
        draw.line([tuple(start), tuple(end)], fill=colour, width=width)
        for x, y in (start, end):
            draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=colour)
        if labels is not None:
            draw.text((start[0] - 14, start[1] - 16), str(labels[i]), fill=colour, stroke_width=1,
                      stroke_fill="black")
    return pil_to_tensor(picture)


def save_top_matches(path, view1, view2, prediction, score, target, valid, grid, top=10, size=224,
                     gap=16):
    """EsViT Fig. 6: view 1 | view 2, the `top` most similar view-1 tokens (with a ground truth)
    linked to their match in view 2, numbered by rank, green when the match is the true token and
    red otherwise. Both views share the token grid (same crop size)."""
    shown = min(top, int(valid.sum()))
    ranked = score.masked_fill(~valid, float("-inf")).argsort(descending=True)[:shown].cpu()
    starts = token_xy(ranked, grid, size)
    ends = token_xy(prediction.cpu()[ranked], grid, size, x_offset=size + gap)
    correct = (prediction.cpu()[ranked] == target.cpu()[ranked]).tolist()
    colours = [GREEN if ok else RED for ok in correct]
    canvas = draw_links(side_by_side(to_uint8(view1, size), to_uint8(view2, size), gap), starts,
                        ends, colours, 2, 3, labels=range(1, len(ranked) + 1))
    write_png(canvas, path)


def heatmap(values):
    """[h, w] values -> uint8 [3, h, w], black -> red -> yellow -> white over [min, max]."""
    v = (values - values.min()) / (values.max() - values.min()).clamp_min(1e-12)
    rgb = torch.stack([(3 * v).clamp(0, 1), (3 * v - 1).clamp(0, 1), (3 * v - 2).clamp(0, 1)])
    return (rgb * 255).round().to(torch.uint8)


# ================================================================================================
# Attention maps of the last ViT block
# ================================================================================================
@torch.no_grad()
def cls_attention(vit, image):
    """[heads, h, w] softmax attention of the CLS query over the patches in the last block, for one
    normalised image [3, H, W]; recomputed from the block's attention input (timm's fused kernel
    does not return the weights)."""
    if not hasattr(vit, "blocks") or getattr(vit, "cls_token", None) is None:
        common.die("attention maps need a ViT backbone with a CLS token (not Swin, not SelfPatch's "
                   "CLS-free ViT)")
    attn = vit.blocks[-1].attn
    seen = {}  # the attention's input, caught by a hook
    hook = attn.register_forward_pre_hook(lambda module, inputs: seen.update(x=inputs[0]))
    try:
        _, grid = vit.forward_dense(image[None])
    finally:
        hook.remove()
    x = seen["x"]
    q, k, _v = attn.qkv(x).reshape(1, x.shape[1], 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(q), attn.k_norm(k)
    # [1, heads, 1, N]: the CLS query's attention
    weights = ((q[:, :, :1] * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
    return weights[0, :, 0, vit.num_prefix_tokens:].reshape(attn.num_heads, *grid.shape[1:3])


def keep_mass(attention, mass=0.6):
    """Boolean mask [heads, h, w]: per head, the largest values whose sum reaches `mass` of the
    total."""
    flat = attention.flatten(1)
    values, order = flat.sort(dim=1, descending=True)
    before = (values.cumsum(1) - values) / values.sum(1, keepdim=True)  # mass of the larger values
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter(1, order, before < mass)
    return mask.view_as(attention)


def attention_picture(vit, view, mass=0.6, size=224):
    """Top row: the image and every head's attention map; bottom row: the image and every head's
    thresholded map over it."""
    attention = cls_attention(vit, view)
    image = to_uint8(view, size)

    def upsample(a):
        return F.interpolate(a[None, None].float(), size=(size, size), mode="nearest")[0, 0]

    maps = [heatmap(upsample(a)) for a in attention]
    masks = [draw_segmentation_masks(image, upsample(m) > 0.5, alpha=0.6, colors="cyan")
             for m in keep_mass(attention, mass)]
    return make_grid([image, *maps, image, *masks], nrow=len(maps) + 1, padding=4, pad_value=255)


# ================================================================================================
# The matchings of one training step (EsViT / GLSD)
# ================================================================================================
def similarity_matches(student_tokens, teacher_tokens):
    """For every student token [T_s, D], the teacher token [T_t, D] of highest cosine similarity of
    the backbone tokens (EsViT's matching, GLSD's Similarity setting)."""
    similarity = F.normalize(student_tokens, dim=-1) @ F.normalize(teacher_tokens, dim=-1).T
    return similarity.argmax(dim=-1)


def geometric_matches(student_geometry, student_grid, teacher_geometry, teacher_grid):
    """For every student token, the teacher token whose centre is nearest in the original image,
    and whether the squared distance is below the larger squared half-diagonal of a token cell of
    the two crops: GLSD's Geometric setting, written again here because no script imports a method
    file (tests/test_correspondence.py checks that it equals glsd.py's)."""
    def centres(geometry, grid):  # [T, 2] and the squared half-diagonal of a cell, original pixels
        geometry = {k: v[None] for k, v in geometry.items()}
        cell = geometry["box"][0, 2:].float() * geometry["image_size"][0].float() / torch.tensor(
            [grid[1], grid[0]], device=geometry["box"].device)
        return common.grid_centers(geometry, grid)[0], (cell / 2).pow(2).sum()

    s_xy, s_hd2 = centres(student_geometry, student_grid)
    t_xy, t_hd2 = centres(teacher_geometry, teacher_grid)
    dist2, match = (t_xy[None] - s_xy[:, None]).pow(2).sum(-1).min(dim=-1)
    return match, dist2 < torch.maximum(s_hd2, t_hd2)


@torch.no_grad()
def matchings_picture(teacher, student, crops, geometry, student_crop=1, size=224, gap=16):
    """Teacher crop 0 (left) and student crop `student_crop` (right); every student token linked
    to its teacher token, top row by cosine similarity of the backbone tokens, bottom row by
    nearest centre in the original image (pairs over GLSD's distance threshold not drawn)."""
    t_view, s_view = crops[0], crops[student_crop]
    _, t_grid = teacher.forward_dense(t_view[None])
    _, s_grid = student.forward_dense(s_view[None])
    t_hw, s_hw = tuple(t_grid.shape[1:3]), tuple(s_grid.shape[1:3])
    similar = similarity_matches(s_grid.flatten(0, 2), t_grid.flatten(0, 2))
    nearest, kept = geometric_matches(geometry[student_crop], s_hw, geometry[0], t_hw)
    rows = []
    student_tokens = torch.arange(s_hw[0] * s_hw[1])
    for match, keep in ((similar, torch.ones_like(kept)), (nearest, kept)):
        tokens = student_tokens[keep.cpu()]
        canvas = side_by_side(to_uint8(t_view, size), to_uint8(s_view, size), gap)
        colours = [PALETTE[i % len(PALETTE)] for i in tokens.tolist()]
        rows.append(draw_links(canvas, token_xy(tokens, s_hw, size, x_offset=size + gap),
                               token_xy(match.cpu()[tokens], t_hw, size), colours))
    return make_grid(rows, nrow=1, padding=4, pad_value=255)


# ================================================================================================
# The crops a training run sees
# ================================================================================================
def crops_picture(dataset, augment, seed, indices, size=96, batched=False):
    """One row per image: the image, then its crops as training draws them at epoch 0
    (`common.SeededDataset` with the run's seed and --batched_crops), every view drawn size x
    size."""
    seeded = common.SeededDataset(dataset, augment, seed)
    if batched:  # device_crops
        seeded = device_crops.BatchedCrops(seeded, "cpu")
    views = []
    for index in indices:
        image = dataset[index][0].convert("RGB")
        if batched:
            batch, _labels = seeded.__getitems__([(index, 0)])
            crops = [c[0] for c in common.crops_on_device(batch, "cpu")[0]]
        else:
            crops, _ = seeded[(index, 0)][0]
        views += [pil_to_tensor(image.resize((size, size), Image.Resampling.BICUBIC)),
                  *[to_uint8(c, size) for c in crops]]
    return make_grid(views, nrow=len(views) // len(indices), padding=4, pad_value=255)


# ================================================================================================
# Command line
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("visualize.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = p.add_subparsers(dest="picture", required=True)
    for name, help_text in (("attention", "per-head CLS attention of the last ViT block"),
                            ("matchings", "token matchings of one EsViT / GLSD training step"),
                            ("crops", "the global and local crops a training run sees")):
        c = commands.add_parser(name, help=help_text,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        g = c.add_argument_group("image")
        if name == "crops":
            g.add_argument("--indices", default=[0, 1, 2, 3], type=int, nargs="+",
                           help="images of the train split")
        else:
            eval_knn.add_weights_args(c)
            g.add_argument("--image", default=None, type=str,
                           help="an image file (else image --index of --dataset)")
            g.add_argument("--index", default=0, type=int, help="which image of the dataset split")
            g.add_argument("--split", default="test", choices=["train", "test"],
                           help="dataset split")
        common.add_data_args(c)
        g = c.add_argument_group("picture")
        g.add_argument("--output", default=f"{name}.png", type=str, help="PNG file to write")
        g.add_argument("--picture_size", default=96 if name == "crops" else 224,
                       type=common.POSITIVE_INT, help="side of every drawn view in pixels")
        g.add_argument("--seed", default=0, type=common.COUNT,
                       help="seeds the crops (as training's --seed) and --random_init")
        g.add_argument("--device", default="auto",
                       help="auto (CUDA when present), cpu, cuda, cuda:N")
        if name == "crops":
            common.add_multicrop_args(c)
            device_crops.add_args(c)
        elif name == "attention":
            g.add_argument("--image_size", default=224, type=common.POSITIVE_INT,
                           help="the image is resized and centre-cropped to this (a multiple of "
                                "the patch)")
            g.add_argument("--threshold", default=0.6, type=common.FRACTION,
                           help="fraction of attention mass kept in the masks")
        else:
            common.add_multicrop_args(c)
            device_crops.add_args(c)
            g.add_argument("--student_crop", default=1, type=int,
                           help="the student's crop: 1 = the other global crop, 2.. = a local crop")
    return p


def load_image(args):
    if args.image:
        return common.load_image(args.image)
    dataset = common.build_dataset(args, train=args.split == "train")
    if not 0 <= args.index < len(dataset):
        common.die(f"--index {args.index} is outside the {len(dataset)} images of the {args.split} "
                   "split")
    folder = getattr(dataset, "dataset", dataset)
    index = getattr(dataset, "indices", range(len(dataset)))[args.index]
    if not hasattr(folder, "samples"):                # a named dataset's images are in memory
        return dataset[args.index][0]
    # the file itself: with --skip_bad_images the dataset would draw its neighbour instead
    try:
        return common.load_image(folder.samples[index][0])
    except common.BadImageError as e:
        common.die(f"image --index {args.index} of the {args.split} split: {e}; choose another "
                   "--index")


def main(args):
    # before any work: one line, not a traceback once the picture is drawn
    if Path(args.output).is_dir():
        common.die(f"--output {args.output} is a folder; name the PNG file to write (e.g. "
                   f"{args.picture}.png in it)")
    device = common.init_distributed(args.device)
    common.fix_random_seeds(args.seed)
    if args.picture == "crops":
        augment = multicrop(args)  # the flags before the data
        dataset = common.build_dataset(args, train=True)
        bad = [i for i in args.indices if not 0 <= i < len(dataset)]
        if bad:
            common.die(f"--indices {bad} outside the {len(dataset)} images of the train split")
        return save(crops_picture(dataset, augment, args.seed, args.indices, args.picture_size,
                                  args.batched_crops), args)
    image = load_image(args)

    def load(key):
        crop = getattr(args, "image_size", None) or args.global_crop_size
        crop_flag = "--image_size" if args.picture == "attention" else "--global_crop_size"
        return eval_knn.load_backbone(args.pretrained_weights, key, args.arch, args.patch_size,
                                      args.window_size, args.random_init, crop, crop_flag)

    model, info = load(args.checkpoint_key)
    backbone = eval_knn.dense_backbone(model).to(device)
    if args.picture == "attention":
        view = common.eval_transform(args.image_size, args.image_size)(image).to(device)
        picture = attention_picture(backbone, view, args.threshold, args.picture_size)
    else:
        augment = multicrop(args, {"arch": info["arch"], "patch_size": info["patch_size"]})
        if not 1 <= args.student_crop < 2 + args.local_crops_number:
            common.die(f"--student_crop {args.student_crop}: choose 1 (the other global crop) to "
                       f"{1 + args.local_crops_number} (the local crops)")
        # one network: teacher = student
        same = args.random_init or info["method"] in ("random", "external")
        student = eval_knn.dense_backbone(model if same else load("student")[0]).to(device)
        with torch.random.fork_rng(devices=[]):
            seed = common.sample_seed(args.seed, 0, args.index)
            if args.batched_crops:
                pixels = pil_to_tensor(image.convert("RGB"))
                batch = device_crops.draw_multicrop(augment, [pixels], [seed])
                crops, geometry = common.crops_on_device(batch, "cpu")
                crops = [c[0] for c in crops]
                geometry = [{k: v[0] for k, v in g.items()} for g in geometry]
            else:
                torch.manual_seed(seed)
                crops, geometry = augment(image)
        picture = matchings_picture(backbone, student, [c.to(device) for c in crops],
                                    [{k: v.to(device) for k, v in g.items()} for g in geometry],
                                    args.student_crop, args.picture_size)
    return save(picture, args)


def multicrop(args, network=None):
    """A training run's multi-crop, its flags refused as the run refuses them (tiled by
    `network`'s tokens, if any)."""
    run = argparse.Namespace(**{**vars(args), "epochs": 0, "warmup_epochs": 0, **(network or {})})
    checks.check_start_args(run, stride=None if network else 1)
    return common.MultiCropAugmentation(args.global_crops_scale, args.local_crops_scale,
                                        args.local_crops_number, args.global_crop_size,
                                        args.local_crop_size)


def write_png(picture, path):
    """`picture` as a PNG file: never through a symbolic link, never into a FIFO."""
    with common.open_for_writing(path, "wb") as f:
        f.write(encode_png(picture).numpy().tobytes())


def save(picture, args):
    write_png(picture, args.output)
    common.log(f"{args.picture} picture written to {args.output}")
    return picture


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
