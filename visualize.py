"""Pictures of what local features learn, as PNG files (torchvision's drawing utilities, plus two
small pixel routines for coloured lines and digits; no plotting library):

    matches     two views side by side, the top-10 most similar token matches as numbered lines
                (EsViT Fig. 6/9); written by `eval_correspondence.py --save_pictures DIR`
    attention   the last ViT block's attention of the CLS query, per head, and the smallest set of
                patches holding 60% of its mass (DINO Fig. 3, EsViT Fig. 7)
    matchings   the token matchings of one training step on one image, teacher crop left, student
                crop right, every student token linked to its matched teacher token: top row by
                backbone similarity (EsViT, GLSD's Similarity), bottom row by geometry (GLSD's
                Geometric; rejected matches are not drawn) (GLSD Fig. 3 and 8-11)

    python visualize.py attention --pretrained_weights runs/dino/checkpoint.pth --image photo.jpg --output attention.png
    python visualize.py matchings --pretrained_weights runs/glsd/checkpoint.pth --dataset synthetic \
        --synthetic_image_size 64 --global_crop_size 64 --local_crop_size 32 --output matchings.png

The 60% threshold: per head, sort the patches by attention, keep the largest ones until their sum
reaches 60% of the total (the patch that crosses the line is kept), as DINO's visualisation does.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision.io import write_png
from torchvision.utils import draw_keypoints, draw_segmentation_masks, make_grid

import common
import eval_knn
import glsd

GREEN, RED = (40, 220, 60), (240, 40, 40)
DIGITS = ["111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
          "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111"]  # 3x5 bitmaps
PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128), (170, 110, 40)]


# ================================================================================================
# Drawing helpers
# ================================================================================================
def to_uint8(view, size):
    """A normalised view [3, H, W] -> uint8 [3, size, size] (ImageNet normalisation undone)."""
    mean = torch.tensor(common.IMAGENET_MEAN, device=view.device)[:, None, None]
    std = torch.tensor(common.IMAGENET_STD, device=view.device)[:, None, None]
    image = F.interpolate((view.float() * std + mean)[None], size=(size, size), mode="bilinear",
                          align_corners=False, antialias=True)[0]
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def token_xy(index, grid, size, x_offset=0):
    """Pixel centres [N, 2] (x, y) of flat token indices of an (h, w) grid over a size x size picture."""
    h, w = grid
    index = torch.as_tensor(index).cpu()
    return torch.stack([(index % w + 0.5) * size / w + x_offset, (index // w + 0.5) * size / h], -1).float()


def draw_line(canvas, start, end, colour, width=1):
    """Rasterise a straight segment in place (torchvision's draw_keypoints draws its lines in white)."""
    steps = int(2 * max(abs(end[0] - start[0]), abs(end[1] - start[1]))) + 2
    t = torch.linspace(0, 1, steps)
    xs, ys = start[0] + t * (end[0] - start[0]), start[1] + t * (end[1] - start[1])
    colour = torch.tensor(colour, dtype=torch.uint8)[:, None]
    for dx in range(-(width // 2), width - width // 2):
        for dy in range(-(width // 2), width - width // 2):
            x = (xs + dx).round().long().clamp(0, canvas.shape[2] - 1)
            y = (ys + dy).round().long().clamp(0, canvas.shape[1] - 1)
            canvas[:, y, x] = colour


def side_by_side(left, right, gap):
    canvas = torch.full((3, left.shape[1], left.shape[2] + gap + right.shape[2]), 255, dtype=torch.uint8)
    canvas[:, :, :left.shape[2]], canvas[:, :, left.shape[2] + gap:] = left, right
    return canvas


def draw_number(canvas, number, x, y, colour, scale=2):
    """Write the digits of `number` in place, top-left corner at (x, y), in a 3x5 pixel font scaled
    by `scale`, outlined in black so that it reads on any background."""
    glyphs = [torch.tensor([int(b) for b in DIGITS[int(d)]]).view(5, 3) for d in str(number)]
    mask = torch.cat([torch.cat([g, torch.zeros(5, 1, dtype=g.dtype)], 1) for g in glyphs], 1)[:, :-1].float()
    mask = mask.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    outline = F.max_pool2d(F.pad(mask, (1, 1, 1, 1))[None], 3, stride=1, padding=1)[0]
    x, y = int(x) - 1, int(y) - 1                                          # the outline's corner
    h, w = min(outline.shape[0], canvas.shape[1] - y), min(outline.shape[1], canvas.shape[2] - x)
    if x < 0 or y < 0 or h <= 0 or w <= 0:
        return
    region = canvas[:, y:y + h, x:x + w]
    region[:, outline[:h, :w] > 0] = 0
    region[:, F.pad(mask, (1, 1, 1, 1))[:h, :w] > 0] = torch.tensor(colour, dtype=torch.uint8)[:, None]


def draw_links(canvas, starts, ends, colours, width=1, radius=2):
    """Lines starts[i] -> ends[i] with a dot at both ends, each in colours[i]."""
    for start, end, colour in zip(starts.tolist(), ends.tolist(), colours):
        draw_line(canvas, start, end, colour, width)
        canvas = draw_keypoints(canvas, torch.tensor([[start, end]]), colors=colour, radius=radius)
    return canvas


def save_top_matches(path, view1, view2, prediction, score, target, valid, grid, top=10, size=224, gap=16):
    """EsViT Fig. 6: view 1 | view 2, the `top` most similar view-1 tokens (with a ground truth)
    linked to their match in view 2, numbered by rank, green when the match is the true token and
    red otherwise. Both views share the token grid (same crop size)."""
    ranked = score.masked_fill(~valid, float("-inf")).argsort(descending=True)[:min(top, int(valid.sum()))].cpu()
    starts = token_xy(ranked, grid, size)
    ends = token_xy(prediction.cpu()[ranked], grid, size, x_offset=size + gap)
    colours = [GREEN if ok else RED for ok in (prediction.cpu()[ranked] == target.cpu()[ranked]).tolist()]
    canvas = draw_links(side_by_side(to_uint8(view1, size), to_uint8(view2, size), gap), starts, ends, colours, 2, 3)
    for rank, ((x, y), colour) in enumerate(zip(starts.tolist(), colours)):
        draw_number(canvas, rank + 1, x - 14, y - 14, colour)
    write_png(canvas, str(path))


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
        common.die("attention maps need a ViT backbone with a CLS token (not Swin, not SelfPatch's CLS-free ViT)")
    attn, seen = vit.blocks[-1].attn, {}
    hook = attn.register_forward_pre_hook(lambda module, inputs: seen.update(x=inputs[0]))
    try:
        _, grid = vit.forward_dense(image[None])
    finally:
        hook.remove()
    x = seen["x"]
    q, k, _v = attn.qkv(x).reshape(1, x.shape[1], 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(q), attn.k_norm(k)
    weights = ((q[:, :, :1] * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)   # [1, heads, 1, N]
    return weights[0, :, 0, vit.num_prefix_tokens:].reshape(attn.num_heads, *grid.shape[1:3])


def keep_mass(attention, mass=0.6):
    """Boolean mask [heads, h, w]: per head, the largest values whose sum reaches `mass` of the total."""
    flat = attention.flatten(1)
    values, order = flat.sort(dim=1, descending=True)
    before = (values.cumsum(1) - values) / values.sum(1, keepdim=True)  # mass of the larger values
    return torch.zeros_like(flat, dtype=torch.bool).scatter(1, order, before < mass).view_as(attention)


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
@torch.no_grad()
def matchings_picture(teacher, student, crops, geometry, student_crop=1, size=224, gap=16):
    """Teacher crop 0 (left) and student crop `student_crop` (right); every student token linked
    to its teacher token, top row by cosine similarity of the backbone tokens, bottom row by
    nearest centre in the original image (pairs over GLSD's distance threshold not drawn)."""
    t_view, s_view = crops[0], crops[student_crop]
    _, t_grid = teacher.forward_dense(t_view[None])
    _, s_grid = student.forward_dense(s_view[None])
    t_hw, s_hw = tuple(t_grid.shape[1:3]), tuple(s_grid.shape[1:3])
    similar = glsd.GLSDLoss.match_similarity(s_grid.flatten(1, 2)[None], t_grid.flatten(1, 2)[None])[0, 0, 0]

    def place(g, hw):  # token centres and half-diagonals of one crop, as glsd.py computes them
        return glsd.token_geometry([{k: v[None] for k, v in g.items()}], hw, 1)

    nearest, kept = glsd.GLSDLoss.match_geometric(place(geometry[student_crop], s_hw), place(geometry[0], t_hw))
    nearest, kept = nearest[0, 0, 0], kept[0, 0, 0]
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
# Command line
# ================================================================================================
def get_args_parser():
    p = argparse.ArgumentParser("visualize.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = p.add_subparsers(dest="picture", required=True)
    for name, help_text in (("attention", "per-head CLS attention of the last ViT block"),
                            ("matchings", "token matchings of one EsViT / GLSD training step")):
        c = commands.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        eval_knn.add_weights_args(c)
        g = c.add_argument_group("image")
        g.add_argument("--image", default=None, type=str, help="an image file (else image --index of --dataset)")
        g.add_argument("--index", default=0, type=int, help="which image of the dataset split")
        g.add_argument("--split", default="test", choices=["train", "test"], help="dataset split")
        common.add_data_args(c)
        g = c.add_argument_group("picture")
        g.add_argument("--output", default=f"{name}.png", type=str, help="PNG file to write")
        g.add_argument("--picture_size", default=224, type=int, help="side of every drawn view in pixels")
        g.add_argument("--seed", default=0, type=int, help="seeds the crops (matchings) and --random_init")
        g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
        if name == "attention":
            g.add_argument("--image_size", default=224, type=int,
                           help="the image is resized and centre-cropped to this (a multiple of the patch)")
            g.add_argument("--threshold", default=0.6, type=float, help="fraction of attention mass kept in the masks")
        else:
            common.add_multicrop_args(c)
            g.add_argument("--student_crop", default=1, type=int,
                           help="the student's crop: 1 = the other global crop, 2.. = a local crop")
    return p


def load_image(args):
    if args.image:
        return common.load_image(args.image)
    dataset = common.build_dataset(args, train=args.split == "train")
    if not 0 <= args.index < len(dataset):
        common.die(f"--index {args.index} is outside the {len(dataset)} images of the {args.split} split")
    return dataset[args.index][0]


def main(args):
    device = common.init_distributed(args.device)
    common.fix_random_seeds(args.seed)
    image = load_image(args)
    def load(key):
        return eval_knn.load_backbone(args.pretrained_weights, key, args.arch, args.patch_size, args.window_size,
                                      args.random_init)

    model, info = load(args.checkpoint_key)
    import eval_correspondence  # here: eval_correspondence imports this module
    backbone = eval_correspondence.dense_backbone(model).to(device)
    if args.picture == "attention":
        view = common.eval_transform(args.image_size, args.image_size)(image).to(device)
        picture = attention_picture(backbone, view, args.threshold, args.picture_size)
    else:
        stride = eval_correspondence.token_stride(info["arch"], info["patch_size"])
        for flag in ("global_crop_size", "local_crop_size"):
            if getattr(args, flag) % stride:
                common.die(f"--{flag} {getattr(args, flag)} is not a multiple of the token stride ({stride} px)")
        if not 1 <= args.student_crop < 2 + args.local_crops_number:
            common.die(f"--student_crop {args.student_crop}: choose 1 (the other global crop) to "
                       f"{1 + args.local_crops_number} (the local crops)")
        same = args.random_init or info["method"] in ("random", "external")  # one network: teacher = student
        student = eval_correspondence.dense_backbone(model if same else load("student")[0]).to(device)
        augment = common.MultiCropAugmentation(args.global_crops_scale, args.local_crops_scale, args.local_crops_number,
                                               args.global_crop_size, args.local_crop_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(common.sample_seed(args.seed, 0, args.index))
            crops, geometry = augment(image)
        picture = matchings_picture(backbone, student, [c.to(device) for c in crops],
                                    [{k: v.to(device) for k, v in g.items()} for g in geometry],
                                    args.student_crop, args.picture_size)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    write_png(picture, args.output)
    common.log(f"{args.picture} picture written to {args.output}")
    return picture


if __name__ == "__main__":
    with common.user_errors():
        main(get_args_parser().parse_args())
