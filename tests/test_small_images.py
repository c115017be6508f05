"""The small-image path (28-32 px images such as Fashion-MNIST): backbones built for the real crop
size, Swin windows that tile every crop, blur scaled with the crop, fractional-epoch schedules, a
validation split carved from the train split, and checkpoints of such runs evaluated as trained.
The 224 px path must stay exactly the authors' (the reference cases of the other files check it)."""
import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import eval_knn  # noqa: E402
from conftest import run_here  # noqa: E402


def run_args(**kw):
    base = dict(arch="swin_pico3", patch_size=16, window_size=7, global_crop_size=32, local_crop_size=16,
                local_crops_number=2, fit_window=True)
    return argparse.Namespace(**{**base, **kw})


# ------------------------------------------------------------------------------------------------
# Swin: how much of the attention goes to padding, per stage
# ------------------------------------------------------------------------------------------------
def window_padding(backbone, crop_size):
    """Per Swin stage, the share of the attended positions that are padding for a crop of this size
    (0 = every window holds real tokens only)."""
    shares, grid = [], crop_size // backbone.patch_embed.patch_size[0]
    for i, stage in enumerate(backbone.layers):
        grid = grid if i == 0 else (grid + 1) // 2
        w = stage.blocks[0].window_size[0]
        padded = -(-grid // w) * w            # timm pads the grid up to a multiple of the window
        shares.append(1 - grid ** 2 / padded ** 2)
    return shares


def test_swin_tiny_at_224_px_is_unchanged_and_pads_nothing():
    """The paper's Swin-T: window 7 in every stage, no padding at 224 px, shifted windows except in
    the last stage (7x7 grid = one window), with or without --fit_window (7 tiles 56, 28, 14, 7)."""
    for fit in (False, True):
        with torch.device("meta"):
            model = common.backbone_from_args(run_args(arch="swin_tiny", global_crop_size=224, local_crop_size=96,
                                                       fit_window=fit, local_crops_number=0), 0.0)
        assert window_padding(model, 224) == [0.0, 0.0, 0.0, 0.0]
        assert [s.blocks[0].window_size for s in model.layers] == [(7, 7)] * 4
        assert [s.blocks[1].shift_size for s in model.layers] == [(3, 3)] * 3 + [(0, 0)]


def test_unfitted_windows_attend_mostly_to_padding_at_32_px():
    """Window 7 on grids of 16, 8 and 4 tokens (swin_pico3 at 32 px): 42% and 67% padding in the
    first stages; on a 16 px local crop 67-75%."""
    model = common.backbone_from_args(run_args(fit_window=False), 0.0)
    assert window_padding(model, 32) == pytest.approx([1 - 16 ** 2 / 21 ** 2, 1 - 64 / 196, 0.0])
    assert window_padding(model, 16) == pytest.approx([1 - 64 / 196, 1 - 16 / 49, 1 - 4 / 16])


def test_fitted_windows_tile_global_and_local_crops_and_keep_a_4x4_grid():
    model = common.backbone_from_args(run_args(), 0.0)
    assert [s.blocks[0].window_size for s in model.layers] == [(4, 4), (4, 4), (2, 2)]
    assert window_padding(model, 32) == [0.0, 0.0, 0.0]
    assert window_padding(model, 16) == [0.0, 0.0, 0.0]
    _, grid = model.forward_dense(torch.randn(2, 3, 32, 32))
    assert grid.shape == (2, 4, 4, 128)                  # region losses have 16 tokens to match
    _, grid = model.forward_dense(torch.randn(2, 3, 16, 16))
    assert grid.shape == (2, 2, 2, 128)
    assert common.token_stride("swin_pico3") == 8 and common.token_stride("swin_tiny") == 32


def test_fitted_windows_choose_the_largest_divisor():
    assert common.fitted_windows("swin_tiny", 16, 7, [224, 96]) == (4, 4, 2, 1)      # grids 56/24, 28/12, 14/6, 7/3
    assert common.fitted_windows("swin_pico", 16, 7, [64, 32]) == (4, 4, 2, 1)
    assert common.fitted_windows("swin_pico3", 16, 7, [32]) == (4, 4, 4)


# ------------------------------------------------------------------------------------------------
# ViT: the position table of the real grid; any patch that divides the crop
# ------------------------------------------------------------------------------------------------
def test_vit_is_built_for_the_global_crop_and_interpolates_local_crops():
    model = common.backbone_from_args(run_args(arch="vit_pico", patch_size=4), 0.0)
    assert model.pos_embed.shape == (1, 1 + 8 * 8, 64)           # 32 px / patch 4: an 8x8 table, no resize
    cls, grid = model.forward_dense(torch.randn(2, 3, 32, 32))
    assert cls.shape == (2, 64) and grid.shape == (2, 8, 8, 64)
    _, grid = model.forward_dense(torch.randn(2, 3, 16, 16))     # local crop: DINO's interpolation to 4x4
    assert grid.shape == (2, 4, 4, 64)
    with pytest.raises(SystemExit, match="does not divide the 32 px global crop"):
        common.backbone_from_args(run_args(arch="vit_pico", patch_size=5), 0.0)


def test_vit_at_224_keeps_the_released_14x14_table():
    with torch.device("meta"):
        model = common.backbone_from_args(run_args(arch="vit_small", global_crop_size=224), 0.0)
    assert model.pos_embed.shape == (1, 1 + 14 * 14, 384)


# ------------------------------------------------------------------------------------------------
# Augmentation and schedules
# ------------------------------------------------------------------------------------------------
def test_blur_is_scaled_with_the_global_crop():
    def sigmas(size):
        aug = common.MultiCropAugmentation(global_crop_size=size, local_crop_size=size // 2, local_crops_number=1)
        blurs = [t for c in (aug.global1, aug.global2, aug.local) for t in c.transforms
                 if isinstance(t, common.RandomGaussianBlur)]
        assert len(blurs) == 3 and len({b.sigma for b in blurs}) == 1   # the same range for every crop, as DINO
        return blurs[0].sigma
    assert sigmas(224) == (0.1, 2.0)                           # DINO's, unchanged
    assert sigmas(32) == pytest.approx((0.1 / 7, 2.0 / 7))


def test_last_layer_frozen_for_a_fraction_of_an_epoch():
    head = common.DINOHead(8, 16, hidden_dim=8, bottleneck_dim=4, norm_last_layer=False)
    for progress, frozen in ((0.0, True), (0.24, True), (0.25, False), (1.5, False)):
        head.zero_grad()
        head(torch.randn(3, 8)).sum().backward()
        common.cancel_gradients_last_layer(progress, head, 0.25)
        assert (head.last_layer.weight_v.grad is None) == frozen
    assert len(common.cosine_scheduler(1.0, 0.0, 2, 10, warmup_epochs=0.5)) == 20
    assert common.cosine_scheduler(1.0, 0.0, 2, 10, warmup_epochs=0.5)[:6].tolist() == pytest.approx(
        [0, 0.25, 0.5, 0.75, 1.0, 1.0])


def test_holdout_carves_a_validation_split_off_the_train_split():
    args = argparse.Namespace(dataset="synthetic", synthetic_images=40, synthetic_image_size=16, synthetic_seed=0,
                              holdout=10)
    train, val = common.build_dataset(args, train=True), common.build_dataset(args, train=False)
    full = common.build_dataset(argparse.Namespace(**{**vars(args), "holdout": 0}), train=True)
    assert (len(train), len(val)) == (30, 10) and val.classes == full.classes
    assert [full[i][1] for i in range(30, 40)] == [val[i][1] for i in range(10)]
    assert list(val.indices) == list(range(30, 40)) and list(train.indices) == list(range(30))
    with pytest.raises(SystemExit, match="--holdout 40"):
        common.build_dataset(argparse.Namespace(**{**vars(args), "holdout": 40}), train=True)


# ------------------------------------------------------------------------------------------------
# A small-image run's checkpoint is evaluated with the backbone it trained
# ------------------------------------------------------------------------------------------------
SMALL = ["--dataset", "synthetic", "--synthetic_images", "32", "--synthetic_image_size", "32",
         "--global_crop_size", "32", "--local_crop_size", "16", "--local_crops_number", "2", "--out_dim", "32",
         "--head_hidden_dim", "32", "--head_bottleneck_dim", "16", "--batch_size_per_gpu", "8", "--num_workers", "0",
         "--epochs", "1", "--max_steps_per_epoch", "2", "--warmup_epochs", "0.5", "--freeze_last_layer", "0.5",
         "--device", "cpu"]


@pytest.mark.parametrize("script,flags", [("dino.py", ["--arch", "vit_pico", "--patch_size", "4"]),
                                          ("selfpatch.py", ["--arch", "vit_pico", "--patch_size", "4",
                                                            "--patch_out_dim", "32"]),
                                          ("esvit.py", ["--arch", "swin_pico3", "--fit_window", "true"]),
                                          ("glsd.py", ["--arch", "swin_pico3", "--fit_window", "true"])])
def test_small_image_checkpoints_load_for_evaluation(tmp_path, script, flags):
    result = run_here(script, *SMALL, *flags, "--output_dir", str(tmp_path))     # the script's entry point, in process
    assert result.returncode == 0, result.stderr[-3000:]
    model, info = eval_knn.load_backbone(str(tmp_path / "checkpoint.pth"), crop=32)
    assert model(torch.randn(2, 3, 32, 32)).shape[0] == 2
    if script == "selfpatch.py":   # its image token needs the aggregation head: checkpoint.pth only
        return
    plain, _ = eval_knn.load_backbone(str(tmp_path / "teacher_backbone.pth"), arch=info["arch"], patch_size=4,
                                      crop=32)   # plain state dict: table sizes read from the weights
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(plain(x), model(x))
