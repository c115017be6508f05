"""extras/tools/eval_correspondence.py and extras/tools/visualize.py: the ground-truth mapping of
the three protocols on hand-made geometries, a backbone that reads its tokens' positions from the
pixels (perfect scores) and a constant one (chance), both scripts end to end on `synthetic` (one
process and two), and the per-epoch monitor on tiny backbones, SelfPatch's CLS-free ViT included."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torchvision.io import decode_png, read_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "extras" / "tools")]
import common  # noqa: E402
import eval_correspondence as ec  # noqa: E402
import glsd  # noqa: E402
import visualize  # noqa: E402
from conftest import finish, one_thread, start  # noqa: E402

TINY = ["--random_init", "--arch", "vit_pico", "--patch_size", "8", "--dataset", "synthetic",
        "--synthetic_images", "96", "--synthetic_image_size", "32", "--crop_size", "32",
        "--batch_size_per_gpu", "8", "--num_workers", "0"]


def geometry(*crops, image_size=(64.0, 48.0)):
    """A batch of crop geometries from (x0, y0, w, h, flip) tuples (fractions of the image)."""
    return {"box": torch.tensor([c[:4] for c in crops]), "flip": torch.tensor([c[4] for c in crops]),
            "image_size": torch.tensor([image_size] * len(crops))}


# ================================================================================================
# Ground truth of the three protocols
# ================================================================================================
@pytest.mark.parametrize("grid", [(4, 4), (7, 7), (3, 5)])
def test_flip_maps_column_to_its_mirror(grid):
    h, w = grid
    box = (0.1, 0.2, 0.7, 0.6)
    target, valid = ec.ground_truth(geometry((*box, False), (*box, True)), geometry((*box, True), (*box, False)),
                                    grid, grid)
    rows, cols = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
    assert valid.all()
    assert torch.equal(target, (rows * w + (w - 1 - cols))[None].expand(2, -1))


def test_identical_crops_map_to_themselves():
    crops = [(0.0, 0.0, 1.0, 1.0, False), (0.13, 0.31, 0.55, 0.42, True), (0.5, 0.1, 0.37, 0.9, False)]
    target, valid = ec.ground_truth(geometry(*crops), geometry(*crops), (7, 7), (7, 7))
    assert valid.all() and torch.equal(target, torch.arange(49).expand(3, -1))


def test_overlap_mask_and_nearest_token():
    # view 1: the whole image (4x4 tokens); view 2: its right half, mirrored (4x2 tokens)
    target, valid = ec.ground_truth(geometry((0, 0, 1, 1, False)), geometry((0.5, 0, 0.5, 1, True)), (4, 4), (4, 2))
    cols = torch.arange(4).repeat(4)
    assert torch.equal(valid[0], cols >= 2)                          # only the right half overlaps
    rows = torch.arange(4).repeat_interleave(4)
    expected = rows * 2 + torch.where(cols == 2, 1, 0)                # mirrored: column 2 -> 1, column 3 -> 0
    assert torch.equal(target[0][valid[0]], expected[valid[0]])

    # random crops: the truth is the nearest view-2 centre, and "inside" means inside view 2's box
    g = torch.Generator().manual_seed(0)
    x0, y0 = torch.rand(2, 20, generator=g) * 0.5
    w, h = 0.2 + torch.rand(2, 20, generator=g) * 0.5
    crops = [(float(a), float(b), float(c), float(d), bool(f)) for a, b, c, d, f in
             zip(x0, y0, w, h, torch.rand(20, generator=g) < 0.5)]
    g1, g2 = geometry(*crops[:10]), geometry(*crops[10:])
    target, valid = ec.ground_truth(g1, g2, (5, 6), (4, 3))
    c1, c2 = common.grid_centers(g1, (5, 6)), common.grid_centers(g2, (4, 3))
    nearest = torch.cdist(c1.double(), c2.double()).argmin(-1)
    assert torch.equal(target[valid], nearest[valid]) and 0 < valid.float().mean() < 1
    rel = (c1 / g2["image_size"][:, None] - g2["box"][:, None, :2]) / g2["box"][:, None, 2:]
    assert torch.equal(valid, ((rel >= 0) & (rel < 1)).all(-1))


# ================================================================================================
# A backbone that reads positions from the pixels, and a constant one
# ================================================================================================
def coordinate_images(n=6, size=64):
    """Images whose red / green values are 4 x (the pixel centre's x / y in the original image)."""
    ramp = (4 * np.arange(size) + 2).astype(np.uint8)
    rgb = np.stack([np.broadcast_to(ramp[None], (size, size)), np.broadcast_to(ramp[:, None], (size, size)),
                    np.zeros((size, size), np.uint8)], -1)
    return [(Image.fromarray(np.ascontiguousarray(rgb)), 0)] * n


class PositionBackbone(nn.Module):
    """Dense feature of a token = a Gaussian bump (sigma 2 px) at its centre in original-image
    pixels, decoded from the patch's mean colour: the cosine similarity of two tokens falls with the
    distance of their centres, so the most similar token is the nearest one."""

    def __init__(self, patch=8, size=64):
        super().__init__()
        self.patch = patch
        ticks = torch.arange(size + 1.0)
        self.register_buffer("points", torch.stack(torch.meshgrid(ticks, ticks, indexing="xy"), -1).view(-1, 2))

    def forward_dense(self, x, norm=True):
        mean, std = (torch.tensor(v)[:, None, None] for v in (common.IMAGENET_MEAN, common.IMAGENET_STD))
        xy = F.avg_pool2d(x * std + mean, self.patch)[:, :2] * 255 / 4     # [B, 2, h, w] original pixels
        d2 = (xy.permute(0, 2, 3, 1)[..., None, :] - self.points).pow(2).sum(-1)
        return None, torch.exp(-d2 / 8)


class ConstantBackbone(nn.Module):
    def forward_dense(self, x, norm=True):
        return None, torch.ones(len(x), x.shape[2] // 8, x.shape[3] // 8, 4)


def run_protocol(backbone, protocol, images, photometric=False):
    pairs = ec.PairDataset(images, ec.PairViews(protocol, 64, photometric=photometric), seed=3)
    return ec.evaluate(backbone, pairs, batch_size=4, num_workers=0, device=torch.device("cpu"), name=protocol)


@pytest.mark.parametrize("protocol", ["esvit", "glsd"])
def test_position_features_score_perfectly(protocol):
    m = run_protocol(PositionBackbone(), protocol, coordinate_images())
    assert m["pairs"] == 6
    assert m["accuracy"] == 100.0 and m["top10_accuracy"] == 100.0
    assert m["distance"] == 0.0 and m["top10_distance"] == 0.0


def test_position_features_find_the_overlap():
    """Different crops: tokens of view 1 fall between view-2 centres, a few near a cell border may
    go to the neighbour (pixel values are rounded to 8 bits), never farther."""
    m = run_protocol(PositionBackbone(), "overlap", coordinate_images(12))
    assert m["pairs"] == 12 and m["accuracy"] > 95.0 and m["distance"] < 0.05


@pytest.mark.parametrize("protocol", ["esvit", "glsd"])
def test_constant_features_score_chance(protocol):
    m = run_protocol(ConstantBackbone(), protocol, coordinate_images(), photometric=True)
    assert m["chance_accuracy"] == pytest.approx(100 / 64)
    assert m["accuracy"] == pytest.approx(100 / 64)      # one token (the first) is every prediction
    assert m["top10_accuracy"] <= 10.0 and m["distance"] > 2.0


# ================================================================================================
# The scripts end to end
# ================================================================================================
def parse_results(stdout):
    pattern = (r"(\w+): top-10 accuracy ([\d.]+)%, distance ([\d.]+) cells \| all tokens: accuracy ([\d.]+)% "
               r"\(chance ([\d.]+)%\), distance ([\d.]+) cells \| (\d+) pairs")
    return {m[0]: [float(v) for v in m[1:]] for m in re.findall(pattern, stdout)}


def test_eval_correspondence_end_to_end(tmp_path):
    """Two processes (torchrun, gloo) score the same pairs as one, and write the pictures."""
    proc = start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "extras/tools/eval_correspondence.py", *TINY, "--save_pictures", str(tmp_path), "--num_pictures", "3")
    with one_thread():
        one = ec.main(ec.get_args_parser().parse_args(TINY))      # one process, while the two run
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = parse_results(proc.stdout)
    assert set(two) == set(one) == set(ec.PROTOCOLS)
    for protocol, m in one.items():
        expected = [m[k] for k in ("top10_accuracy", "top10_distance", "accuracy", "chance_accuracy", "distance",
                                   "pairs")]
        assert two[protocol] == pytest.approx(expected, abs=0.006), protocol
        assert m["pairs"] == 24 and m["chance_accuracy"] == pytest.approx(100 / 16)
        assert m["accuracy"] > m["chance_accuracy"]       # random ViT features still carry position
    pictures = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pictures == [f"{p}_{i:04d}.png" for p in sorted(ec.PROTOCOLS) for i in range(3)]
    image = decode_png(read_file(str(tmp_path / "esvit_0000.png")))
    assert image.shape == (3, 224, 2 * 224 + 16) and image.float().std() > 10


def test_visualize_attention_and_matchings(tmp_path):
    common_args = ["--random_init", "--arch", "vit_pico", "--patch_size", "8", "--dataset", "synthetic",
                   "--synthetic_images", "40", "--synthetic_image_size", "32", "--picture_size", "64"]
    parser = visualize.get_args_parser()
    attention = visualize.main(parser.parse_args(["attention", *common_args, "--image_size", "32",
                                                  "--output", str(tmp_path / "a.png")]))
    assert attention.shape == (3, 2 * 64 + 3 * 4, 3 * 64 + 4 * 4)            # 2 rows x (image + 2 heads)
    assert torch.equal(decode_png(read_file(str(tmp_path / "a.png"))), attention)
    matchings = visualize.main(parser.parse_args(["matchings", *common_args, "--global_crop_size", "32",
                                                  "--local_crop_size", "16", "--student_crop", "2",
                                                  "--output", str(tmp_path / "m.png")]))
    assert matchings.shape == (3, 2 * 64 + 3 * 4, 2 * 64 + 16 + 2 * 4)       # similarity row, geometric row
    with pytest.raises(SystemExit, match="ViT backbone with a CLS token"):
        visualize.cls_attention(common.build_backbone("swin_pico"), torch.zeros(3, 64, 64))


def test_visualize_crops_are_the_crops_training_sees(tmp_path):
    """Each row: the image, then its crops as the training loader's `SeededDataset` draws them at
    epoch 0 with the same seed (checked pixel for pixel on the drawn views)."""
    args = visualize.get_args_parser().parse_args(
        ["crops", "--dataset", "synthetic", "--synthetic_images", "20", "--synthetic_image_size", "32",
         "--global_crop_size", "32", "--local_crop_size", "16", "--local_crops_number", "2", "--seed", "3",
         "--indices", "4", "7", "--picture_size", "40", "--output", str(tmp_path / "c.png")])
    picture = visualize.main(args)
    assert picture.shape == (3, 2 * 40 + 3 * 4, 5 * 40 + 6 * 4)               # 2 rows x (image + 4 crops)
    augment = common.MultiCropAugmentation(local_crops_number=2, global_crop_size=32, local_crop_size=16)
    dataset = common.SeededDataset(common.build_dataset(args, train=True), augment, seed=3)
    crops, _ = dataset[(7, 0)][0]
    second_row_third_view = picture[:, 4 + 40 + 4:4 + 80 + 4, 4 + 2 * 44:4 + 2 * 44 + 40]
    assert torch.equal(second_row_third_view, visualize.to_uint8(crops[1], 40))
    assert not torch.equal(visualize.to_uint8(dataset[(7, 1)][0][0][1], 40), second_row_third_view)
    with pytest.raises(SystemExit, match="outside the 20 images"):
        visualize.main(visualize.get_args_parser().parse_args(["crops", "--dataset", "synthetic",
                                                               "--synthetic_images", "20", "--indices", "20"]))


def test_visualized_matchings_are_glsds():
    """extras/tools/visualize.py draws the matchings of a GLSD step without importing glsd.py: its
    similarity and geometric matches (with GLSD's keep rule) equal glsd.py's on random crops."""
    torch.manual_seed(0)
    augment = common.MultiCropAugmentation((0.4, 1.0), (0.05, 0.4), 2, 64, 32)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 255, (60, 90, 3), dtype=np.uint8))
    for _ in range(5):
        _, geometry = augment(image)
        for student_crop, s_hw in ((1, (4, 4)), (2, (2, 2))):
            s_tokens, t_tokens = torch.randn(s_hw[0] * s_hw[1], 8), torch.randn(16, 8)
            similar = glsd.GLSDLoss.match_similarity(s_tokens[None, None], t_tokens[None, None])[0, 0, 0]
            assert torch.equal(visualize.similarity_matches(s_tokens, t_tokens), similar)

            def place(g, hw):
                return glsd.token_geometry([{k: v[None] for k, v in g.items()}], hw, 1)
            nearest, kept = glsd.GLSDLoss.match_geometric(place(geometry[student_crop], s_hw),
                                                          place(geometry[0], (4, 4)))
            mine, mine_kept = visualize.geometric_matches(geometry[student_crop], s_hw, geometry[0], (4, 4))
            assert torch.equal(mine, nearest[0, 0, 0]) and torch.equal(mine_kept, kept[0, 0, 0])


def test_attention_weights_and_mass_threshold():
    """The recomputed CLS attention equals timm's unfused attention weights; the mask keeps the
    fewest largest patches holding 60% of each head's mass."""
    torch.manual_seed(0)
    vit = common.build_backbone("vit_pico", patch_size=8).eval()
    image = torch.randn(3, 32, 32)
    seen = {}
    vit.blocks[-1].attn.fused_attn = False
    vit.blocks[-1].attn.attn_drop.register_forward_hook(lambda m, i, out: seen.update(weights=out))
    attention = visualize.cls_attention(vit, image)
    torch.testing.assert_close(attention.flatten(1), seen["weights"][0, :, 0, 1:])
    mask = visualize.keep_mass(attention, 0.6)
    for a, m in zip(attention.flatten(1), mask.flatten(1)):
        share = a / a.sum()
        assert share[m].sum() >= 0.6 and share[m].sum() - share[m].min() < 0.6 and share[m].min() >= share[~m].max()
