"""DRLoc: targets, sampler and every loss variant against naive loops and the authors' numbers, a
tiny Swin end to end against the authors' Swin, where the gradients go, the lambda schedule, and
real runs: with and without the DRLoc loss, and their reliability (resume after SIGTERM or a crash
equal to an uninterrupted run, 2 processes equal to 1, bad images)."""
import json
import math
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import common  # noqa: E402
import eval_knn  # noqa: E402
import drloc  # noqa: E402
from conftest import (ENV, assert_same_state, assert_same_trajectory, finish, load,  # noqa: E402
                      make_folder, run, run_here, start)

# Inputs and outputs of the authors' code, yhlleo/VTs-Drloc @ 6ac2c447 (drloc/aux_modules.py
# DenseRelativeLoc, drloc/losses.py relative_constraint_l1/ce/cbr and cal_selfsupervised_loss,
# models/swin.py SwinTransformer(use_drloc=True), main.py _weight_decay), copied from the
# project's reference file drloc.pt. Positions are stored as int8 to keep the files small.
CASES = torch.load(ROOT / "tests/data/drloc_cases.pt", weights_only=True)
SWIN = torch.load(ROOT / "tests/data/drloc_swin.pt", weights_only=True)["swin"]
MODES = {"l1": "l1", "ce": "ce", "cbr": "reg"}   # the code's names -> this file's


def args_for(*extra):
    return drloc.get_args_parser().parse_args(["--arch", "swin_pico", "--input_size", "64", *extra])


# ------------------------------------------------------------------------------------------------
# Targets and pairs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signed,normalize,expected", [
    (False, False, [[0, 0], [6, 6], [6, 6], [6, 6], [1, 2]]),
    (True, False, [[6, 6], [0, 0], [12, 12], [12, 0], [7, 4]]),
    (False, True, [[0, 0], [1, 1], [1, 1], [1, 1], [1 / 6, 2 / 6]]),
    (True, True, [[0.5, 0.5], [0, 0], [1, 1], [1, 0], [7 / 12, 4 / 12]]),
])
def test_targets_on_hand_picked_positions(signed, normalize, expected):
    # self-pair, (0,0)-(6,6), (6,6)-(0,0), (6,0)-(0,6), (3,2)-(2,4) on a 7 x 7 grid; (row, col)
    pos_a = torch.tensor([[[3, 3], [0, 0], [6, 6], [6, 0], [3, 2]]])
    pos_b = torch.tensor([[[3, 3], [6, 6], [0, 0], [0, 6], [2, 4]]])
    target = drloc.relative_targets(pos_a, pos_b, 7, signed, normalize)
    torch.testing.assert_close(target, torch.tensor(expected, dtype=torch.float32))


def test_sampler_shapes_range_and_independence():
    torch.manual_seed(0)
    pos_a, pos_b = drloc.sample_pairs(5, 7, 64)
    assert pos_a.shape == pos_b.shape == (5, 64, 2) and pos_a.dtype == torch.int64
    assert pos_a.min() == 0 and pos_a.max() == 6 and pos_b.min() == 0 and pos_b.max() == 6
    assert not torch.equal(pos_a, pos_b)                  # two independent draws
    a, b = drloc.sample_pairs(5, 7, 64)
    assert not torch.equal(a, pos_a)                      # fresh every step


def test_sampler_makes_the_authors_rng_calls():
    demo = CASES["sampler_demo"]
    torch.manual_seed(demo["seed"])
    pos_a, pos_b = drloc.sample_pairs(demo["B"], demo["k"], demo["m"])
    assert torch.equal(pos_a, demo["pos_a"].long()) and torch.equal(pos_b, demo["pos_b"].long())
    # training draws from a generator of its own (drloc.pair_generator): the same calls on it
    pos_a, pos_b = drloc.sample_pairs(demo["B"], demo["k"], demo["m"], torch.Generator().manual_seed(demo["seed"]))
    assert torch.equal(pos_a, demo["pos_a"].long()) and torch.equal(pos_b, demo["pos_b"].long())


def test_exhaustive_pairs_cover_every_token_once_with_a_permuted_partner():
    pos_a, pos_b = drloc.exhaustive_pairs(3, 5)
    assert pos_a.shape == pos_b.shape == (3, 25, 2)
    raster = torch.tensor([[i, j] for i in range(5) for j in range(5)])
    for b in range(3):
        assert torch.equal(pos_a[b], raster)
        assert sorted(map(tuple, pos_b[b].tolist())) == sorted(map(tuple, raster.tolist()))
    assert not torch.equal(pos_b[0], pos_b[1])


def test_gather_keeps_gradients_at_the_sampled_tokens_only():
    grid = torch.randn(2, 4, 4, 3, requires_grad=True)
    pos_a = torch.tensor([[[0, 1], [2, 3]], [[3, 3], [3, 3]]])
    pos_b = torch.tensor([[[1, 0], [0, 1]], [[0, 0], [1, 2]]])
    pairs = drloc.gather_pairs(grid, pos_a, pos_b)
    for b in range(2):
        for s in range(2):
            expected = torch.cat([grid[b, pos_a[b, s, 0], pos_a[b, s, 1]], grid[b, pos_b[b, s, 0], pos_b[b, s, 1]]])
            assert torch.equal(pairs[b, s], expected)       # first-drawn embedding first
    pairs.sum().backward()
    touched = grid.grad.abs().sum(-1) > 0
    expected = torch.zeros(2, 4, 4, dtype=torch.bool)
    for b in range(2):
        for i, j in pos_a[b].tolist() + pos_b[b].tolist():
            expected[b, i, j] = True
    assert torch.equal(touched, expected)


# ------------------------------------------------------------------------------------------------
# Losses against naive loops
# ------------------------------------------------------------------------------------------------
def naive_localization_loss(criterion, pred, target):
    """Each term of the code's criterion, one pair and one axis at a time, in float64."""
    pred, target = pred.double(), target.double()
    total = 0.0
    n = len(pred)
    for axis in range(2):
        for i in range(n):
            t = target[i, axis].item()
            if criterion == "l1":
                total += abs(t - pred[i, axis].item()) / (2 * n)
                continue
            logits = pred[i, :, axis].tolist()
            top = max(logits)
            z = sum(math.exp(v - top) for v in logits)
            beta = [math.exp(v - top) / z for v in logits]
            if criterion == "ce":
                total += -math.log(beta[int(t)]) / n
            else:
                mu = sum(b * c for c, b in enumerate(beta))
                var = sum(b * (c - mu) ** 2 for c, b in enumerate(beta)) + 1e-8
                total += ((t - mu) ** 2 / var + 0.001 * math.log(var)) / n
    return total


@pytest.mark.parametrize("criterion,classes", [("l1", None), ("ce", 7), ("ce", 13), ("reg", 7), ("reg", 9)])
def test_loss_variants_match_naive_loops(criterion, classes):
    torch.manual_seed(len(criterion) * 10 + (classes or 0))
    n = 40
    if criterion == "l1":
        pred, target = torch.randn(n, 2) * 3, torch.randint(0, 7, (n, 2)).float()
    else:
        pred, target = torch.randn(n, classes, 2) * 2, torch.randint(0, classes, (n, 2)).float()
    got = drloc.DRLocLoss(criterion).localization_loss(pred, target)
    assert got.item() == pytest.approx(naive_localization_loss(criterion, pred, target), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode,signed,normalize", [("l1", False, False), ("l1", True, True), ("ce", True, False),
                                                   ("reg", False, False), ("exh", False, False)])
def test_drloc_loss_on_a_grid_matches_a_naive_loop_over_images_and_pairs(mode, signed, normalize):
    """L = L_ce + lambda * mean over images and pairs of the per-pair loss, written from the
    equation: gather e_a, e_b, run f on one pair, build the target from python ints."""
    torch.manual_seed(3)
    B, k, D, m, lam = 3, 5, 8, 6, 0.5
    classes = (2 * k - 1 if signed else k) if mode in ("ce", "reg") else None
    mlp = drloc.LocalizationMLP(D, classes)
    grid = torch.randn(B, k, k, D)
    pos_a, pos_b = drloc.exhaustive_pairs(B, k) if mode == "exh" else drloc.sample_pairs(B, k, m)
    head = {"pred": mlp(drloc.gather_pairs(grid, pos_a, pos_b)).flatten(0, 1), "pos_a": pos_a, "pos_b": pos_b, "k": k}
    logits, labels = torch.randn(B, 4), torch.tensor([0, 3, 1])
    criterion = drloc.DRLocLoss(mode, signed, normalize, smoothing=0.0)
    got = criterion({"logits": logits, "drloc": [head]}, labels, lam)

    per_pair, n_pairs = 0.0, pos_a.shape[1]
    for b in range(B):
        for s in range(n_pairs):
            (i, j), (p, h) = pos_a[b, s].tolist(), pos_b[b, s].tolist()
            pred = mlp(torch.cat([grid[b, i, j], grid[b, p, h]])[None])
            offsets = [i - p, j - h]
            target = [d + k - 1 for d in offsets] if signed else [abs(d) for d in offsets]
            if normalize:
                target = [t / ((2 if signed else 1) * (k - 1)) for t in target]
            per_pair += naive_localization_loss(criterion.criterion, pred, torch.tensor([target]))
    expected_drloc = per_pair / (B * n_pairs)
    expected_ce = sum(-F.log_softmax(logits[b], 0)[labels[b]].item() for b in range(B)) / B
    assert got["L_drloc"].item() == pytest.approx(expected_drloc, rel=1e-5)
    assert got["L_ce"].item() == pytest.approx(expected_ce, rel=1e-5)
    assert got["loss"].item() == pytest.approx(expected_ce + lam * expected_drloc, rel=1e-5)


def test_soft_labels_use_the_soft_target_cross_entropy():
    logits, soft = torch.randn(4, 5), torch.softmax(torch.randn(4, 5), -1)
    got = drloc.DRLocLoss()({"logits": logits, "drloc": []}, soft, 0.5)
    expected = -(soft * F.log_softmax(logits, -1)).sum(-1).mean()
    torch.testing.assert_close(got["L_ce"], expected)
    assert got["L_drloc"].item() == 0.0 and torch.equal(got["loss"], got["L_ce"])


# ------------------------------------------------------------------------------------------------
# Against the authors' code
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES["cases"]))
def test_targets_and_loss_match_authors_code(name):
    c = CASES["cases"][name]
    pos_a, pos_b = c["pos_a"].long(), c["pos_b"].long()
    signed = not c["use_abs"]
    target = drloc.relative_targets(pos_a, pos_b, c["k"], signed, c["normalize"])
    assert torch.equal(target, c["target"])
    if "x" in c:   # the pair gather, on the code's [B, D, k, k] layout
        torch.testing.assert_close(drloc.gather_pairs(c["x"].permute(0, 2, 3, 1), pos_a, pos_b), c["mlp_input"],
                                   rtol=0, atol=0)
    criterion = drloc.DRLocLoss("exh" if c["exhaustive"] else MODES[c["mode"]], signed, c["normalize"])
    head = {"pred": c["pred"], "pos_a": pos_a, "pos_b": pos_b, "k": c["k"]}
    losses = criterion({"logits": torch.zeros(1, 2), "drloc": [head]}, torch.zeros(1, dtype=torch.long),
                       c["lambda_drloc"])
    torch.testing.assert_close(losses["L_drloc"], c["loss"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses["loss"] - losses["L_ce"], c["loss_weighted"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["swin_e2e", "swin_e2e_multiscale"])
def test_tiny_swin_end_to_end_matches_authors_swin(name):
    """The authors' SwinTransformer(use_drloc=True), keys mapped to timm's: the pre-norm grid(s)
    fed to DRLoc (multiscale: stage 1 after its patch merging, and the last stage), the logits,
    and the loss on the code's own predictions (its 512-wide MLPs are too large to store here)."""
    c = SWIN[name]
    images = SWIN["swin_e2e"]["images"]
    backbone = common.build_backbone("swin_pico", window_size=7, img_size=56, layer_norm_eps=1e-5,
                                     embed_dim=8, depths=(2, 2), num_heads=(1, 2))
    state = c["timm_state_dict"]
    common.load_state_dict_strict(backbone, {k: v for k, v in state.items() if not k.startswith("head.")})
    model = drloc.DRLoc(backbone, 5, "all" if c["n_scales"] == 2 else "l1", 6, [(16, None)] * c["n_scales"])
    model.head.load_state_dict({"weight": state["head.fc.weight"], "bias": state["head.fc.bias"]})
    positions = [(a.long(), b.long()) for a, b in zip(c["pos_a"], c["pos_b"])]
    with torch.no_grad():
        _, grids = model.features(images)
        outputs = model(images, positions=positions)
    assert len(grids) == len(c["grids"]) == len(outputs["drloc"])
    for grid, expected in zip(grids, c["grids"]):
        torch.testing.assert_close(grid.permute(0, 3, 1, 2), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outputs["logits"], c["sup"], rtol=1e-4, atol=1e-5)
    for head, pred, target in zip(outputs["drloc"], c["pred"], c["target"]):
        assert head["k"] == 7 and torch.equal(drloc.relative_targets(head["pos_a"], head["pos_b"], 7), target)
        head["pred"] = pred
    criterion = drloc.DRLocLoss(model.mode, smoothing=0.0)
    losses = criterion(outputs, c["labels"], c["lambda_drloc"])
    torch.testing.assert_close(losses["L_ce"], c["loss_ce"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c["lambda_drloc"] * losses["L_drloc"], c["loss_drloc_weighted"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses["loss"], c["loss_total"], rtol=1e-4, atol=1e-5)


def test_lambda_schedule_matches_authors_code_and_spans_the_epochs_run():
    ref = CASES["lambda_schedule"]
    for lam in (0.5, 0.1):
        got = drloc.lambda_schedule(lam, ref["total_epochs"], ref["warmup_epochs"])
        np.testing.assert_allclose(got, ref[f"lambda_{lam}"][:ref["total_epochs"]].numpy(), rtol=0, atol=1e-12)
    got = drloc.lambda_schedule(0.5, 100, 20)
    assert len(got) == 100 and got[0] == 0 and got[20] == 0.5 and got[-1] == pytest.approx(0.5 / 80)
    assert np.all(np.diff(got[:21]) > 0) and np.all(np.diff(got[20:]) < 0)
    assert np.all(drloc.lambda_schedule(0.5, 7, kind="constant") == 0.5)
    assert drloc.lambda_schedule(0.5, 5, 0)[0] == 0.5     # no warmup: full weight from epoch 0


# ------------------------------------------------------------------------------------------------
# Model wiring
# ------------------------------------------------------------------------------------------------
def test_drloc_gradient_reaches_the_backbone_before_the_final_norm_only():
    torch.manual_seed(0)
    model = drloc.build_model(args_for("--drop_path_rate", "0"), num_classes=4)
    out = model(torch.randn(2, 3, 64, 64))
    assert len(out["drloc"]) == 1 and out["drloc"][0]["k"] == 2 and out["drloc"][0]["pred"].shape == (2 * 64, 2)
    losses = drloc.DRLocLoss()(out, torch.tensor([0, 1]), 0.5)
    losses["L_drloc"].backward(retain_graph=True)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["backbone.layers.3.blocks.1.mlp.fc2.weight"].abs().sum() > 0     # the grid keeps its gradient
    assert grads["backbone.layers.0.blocks.0.attn.qkv.weight"].abs().sum() > 0
    assert grads["drloc.0.mlp.0.weight"].abs().sum() > 0
    assert grads["backbone.norm.weight"] is None and grads["head.weight"] is None  # the grid is pre-norm
    model.zero_grad(set_to_none=True)
    losses["L_ce"].backward()
    assert all(p.grad is None for p in model.drloc.parameters())                  # CE never trains f
    assert model.backbone.norm.weight.grad.abs().sum() > 0


def test_all_mode_has_one_head_per_stage_and_eval_mode_none():
    model = drloc.build_model(args_for("--drloc_mode", "all"), num_classes=3)
    assert [m.mlp[0].in_features for m in model.drloc] == [2 * 64, 2 * 128, 2 * 256, 2 * 256]
    out = model(torch.randn(2, 3, 64, 64))
    assert [h["k"] for h in out["drloc"]] == [8, 4, 2, 2]
    assert model.eval()(torch.randn(2, 3, 64, 64))["drloc"] == []


def test_ce_heads_classify_k_or_2k_minus_1_offsets_and_baseline_has_no_head():
    assert model_classes("--drloc_mode", "ce") == [2]
    assert model_classes("--drloc_mode", "reg", "--drloc_targets", "signed") == [3]
    assert len(drloc.build_model(args_for("--lambda_drloc", "0"), num_classes=3).drloc) == 0
    torch.manual_seed(1)
    baseline = drloc.build_model(args_for("--lambda_drloc", "0"), num_classes=3).state_dict()
    torch.manual_seed(1)
    with_drloc = drloc.build_model(args_for(), num_classes=3).state_dict()
    assert all(torch.equal(v, with_drloc[k]) for k, v in baseline.items())          # same initial network


def model_classes(*extra):
    return [m.axis_heads[0].out_features for m in drloc.build_model(args_for(*extra), num_classes=3).drloc]


def test_vit_grid_is_average_pooled_before_the_final_norm():
    args = drloc.get_args_parser().parse_args(["--arch", "vit_pico", "--input_size", "112", "--drop_path_rate", "0"])
    model = drloc.build_model(args, num_classes=3).eval()
    images = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        feature, grids = model.features(images)
        cls, grid = model.backbone.forward_dense(images, norm=False)
        pooled = F.avg_pool2d(grid.permute(0, 3, 1, 2), 3, 2, 1, count_include_pad=False).permute(0, 2, 3, 1)
        assert grids[0].shape == (2, 4, 4, 64)
        torch.testing.assert_close(grids[0], pooled)
        torch.testing.assert_close(feature, model.backbone.forward_dense(images)[0])   # final-norm CLS


def test_too_small_grid_and_bad_flags_fail_with_one_line():
    with pytest.raises(SystemExit, match="--input_size"):
        drloc.build_model(drloc.get_args_parser().parse_args(["--arch", "swin_pico", "--input_size", "32"]), 3)
    with pytest.raises(SystemExit, match="needs a Swin"):
        drloc.check_args(drloc.get_args_parser().parse_args(["--arch", "vit_pico", "--drloc_mode", "all"]))
    with pytest.raises(SystemExit, match="--drloc_normalize"):
        drloc.check_args(args_for("--drloc_mode", "ce", "--drloc_normalize", "true"))
    for arch, size, patch in ("vit_pico", "40", 16), ("swin_pico", "42", 4):   # the flag it names is --input_size
        with pytest.raises(SystemExit, match=f"^error: --input_size {size} is not a multiple of the patch size {patch}$"):
            drloc.check_args(args_for("--arch", arch, "--input_size", size))


def test_position_tables_norms_and_biases_are_not_decayed():
    model = drloc.build_model(args_for(), num_classes=3)
    decayed, not_decayed = (set(map(id, g["params"])) for g in common.get_params_groups(model, drloc.NO_WEIGHT_DECAY))
    named = dict(model.named_parameters())
    assert id(named["backbone.layers.0.blocks.0.attn.relative_position_bias_table"]) in not_decayed
    assert id(named["backbone.norm.weight"]) in not_decayed and id(named["head.bias"]) in not_decayed
    assert id(named["backbone.layers.0.blocks.0.attn.qkv.weight"]) in decayed
    assert id(named["drloc.0.mlp.2.weight"]) in decayed and id(named["head.weight"]) in decayed


def test_timm_augmentation_is_reproducible_per_sample_and_leaves_global_rngs_alone():
    def transform(img):
        return (random.random(), float(np.random.rand()), torch.rand(1).item())
    dataset = common.SeededDataset([(None, 0)] * 3, transform, seed=5)
    random.seed(1)
    np.random.seed(1)
    py_before, np_before = random.random(), np.random.rand()
    random.seed(1)
    np.random.seed(1)
    first, again, other = dataset[0][0], dataset[0][0], dataset[1][0]
    assert first == again and first != other
    assert (random.random(), np.random.rand()) == (py_before, np_before)


def test_randaugment_posterize_keeps_zero_bits_as_a_black_image():
    """timm asks for posterize(bits=0) at magnitude 10; Pillow >= 12 raises, older Pillow gave black."""
    from PIL import Image
    img = Image.new("RGB", (4, 4), (200, 100, 50))
    assert drloc.posterize(img, 0).getpixel((0, 0)) == (0, 0, 0)
    assert drloc.posterize(img, 1).getpixel((0, 0)) == (128, 0, 0)
    assert drloc.posterize(img, 8) is img
    transform = drloc.train_transform(args_for("--input_size", "32"))
    ops = [op for t in transform.transforms for op in getattr(t, "ops", [])]
    assert [op.aug_fn for op in ops if op.name.startswith("Posterize")] == [drloc.posterize]
    augmix = drloc.train_transform(args_for("--input_size", "32", "--aa", "augmix-m10-w3"))   # its posterize too
    ops = [op for t in augmix.transforms for op in getattr(t, "ops", [])]
    assert {op.aug_fn for op in ops if op.name.startswith("Posterize")} == {drloc.posterize}


def test_an_unknown_augmentation_policy_is_one_line():
    """timm checks --aa with an assert deep in its transform factory: the user sees one line naming the flag."""
    with pytest.raises(SystemExit, match=r"^error: --aa 'garbage': Unknown AA policy garbage; give a timm policy"):
        drloc.train_transform(args_for("--aa", "garbage"))


def test_pretrained_loads_official_swin_keys_and_this_repos_checkpoints(tmp_path):
    """Official layout (patch merging at the end of a stage, `head.*`, buffers, DRLoc MLPs) and
    this file's checkpoint.pth both give the same timm backbone."""
    timm_state = SWIN["swin_e2e"]["timm_state_dict"]
    official = {"drloc.0.layers.0.weight": torch.zeros(3), "layers.0.blocks.0.attn.relative_position_index": torch.zeros(3)}
    for k, v in timm_state.items():
        if ".downsample." in k:                          # timm layers.{i+1}.downsample -> official layers.{i}
            i = int(k.split(".")[1])
            k = k.replace(f"layers.{i}.downsample", f"layers.{i - 1}.downsample")
        official[k.replace("head.fc.", "head.")] = v
    torch.save({"model": official}, tmp_path / "official.pth")
    torch.save({"model": {"backbone." + k: v for k, v in timm_state.items() if not k.startswith("head.")}},
               tmp_path / "checkpoint.pth")
    for name in ("official.pth", "checkpoint.pth"):
        backbone = common.build_backbone("swin_pico", window_size=7, img_size=56, layer_norm_eps=1e-5,
                                         embed_dim=8, depths=(2, 2), num_heads=(1, 2))
        drloc.load_pretrained(backbone, tmp_path / name)
        assert all(torch.equal(v, timm_state[k]) for k, v in backbone.state_dict().items())


# ------------------------------------------------------------------------------------------------
# Real runs (subprocess, CPU) and reliability: exact resume, preemption, a crash mid-write,
# 1 vs 2 processes, bad images (the DINO versions: test_preemption_and_resume.py, test_refusals.py)
# ------------------------------------------------------------------------------------------------
TINY = ["--dataset", "synthetic", "--synthetic_images", "32", "--synthetic_image_size", "64", "--arch", "swin_pico",
        "--input_size", "64", "--batch_size_per_gpu", "8", "--max_steps_per_epoch", "2", "--num_workers", "0",
        "--warmup_epochs", "0", "--lr", "0.05",
        "--precision", "fp32"]  # not auto: runs are compared to the digit, on every CPU
# 2 epochs of 2 steps with the DRLoc loss at full weight, mixup / cutmix and drop path on (defaults)
RUN = ["--epochs", "2", "--lambda_schedule", "constant"]


def run_drloc(*extra, driver=None):
    return run("drloc.py", *TINY, *extra, driver=driver)


def run_drloc_here(*extra):
    """run_drloc through drloc.py's entry point in this process (no interpreter start-up)."""
    return run_here("drloc.py", *TINY, *extra)


def records(out):
    return [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]


@pytest.fixture(scope="module")
def drloc_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("drloc_full")
    result = run_drloc_here(*RUN, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_run_with_drloc_logs_and_checkpoints(drloc_uninterrupted):
    log = records(drloc_uninterrupted)
    assert [r["epoch"] for r in log] == [0, 1] and all(r["lambda_drloc"] == 0.5 for r in log)
    assert all(r["L_drloc"] > 0 and math.isfinite(r["L_ce"]) and 0 <= r["val_acc1"] <= 100 for r in log)
    ckpt = load(drloc_uninterrupted / "checkpoint.pth")
    assert ckpt["method"] == "drloc" and ckpt["epoch"] == 2 and ckpt["step"] == 0
    assert set(ckpt) >= {"model", "optimizer", "scaler", "drloc_loss", "args", "rng"}
    assert "drloc.0.mlp.0.weight" in ckpt["model"]
    common.load_state_dict_strict(common.build_backbone("swin_pico", img_size=64),    # timm key names
                                  load(drloc_uninterrupted / "backbone.pth"))


def test_drloc_checkpoint_is_evaluated_by_eval_knn_at_its_training_size(drloc_uninterrupted):
    """At 64 px the later Swin stages are smaller than the window: their relative-position tables
    shrink, so the backbone must be built at the checkpoint's --input_size (and DRLoc's eps)."""
    model, info = eval_knn.load_backbone(str(drloc_uninterrupted / "checkpoint.pth"))
    assert info["method"] == "drloc"
    state = load(drloc_uninterrupted / "checkpoint.pth")["model"]
    for k, v in model.state_dict().items():
        if not k.endswith((".relative_position_index", ".attn_mask")):
            assert torch.equal(v, state[f"backbone.{k}"]), k
    assert model.norm.eps == 1e-5
    assert model(torch.zeros(2, 3, 64, 64)).shape == (2, model.num_features)
    # backbone.pth alone: the windows come from its tables, the image size from the evaluation crop;
    # a plain state dict cannot record DRLoc's LayerNorm eps (1e-5, timm's default here 1e-6), so the
    # features are close, not equal (checkpoint.pth, above, is exact)
    plain, _ = eval_knn.load_backbone(str(drloc_uninterrupted / "backbone.pth"), arch="swin_pico", crop=64)
    x = torch.randn(2, 3, 64, 64)
    assert plain.norm.eps == 1e-6
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=1e-3)


# Runs a training script that, at its n-th preemption check, waits (up to a minute) for a real
# signal: the test sends SIGTERM at a known step, so the stopped run can be compared exactly.
WAIT_FOR_SIGNAL_AT_CHECK = """
import runpy, sys, time
import common
n, real, calls = N_CHECK, common.preemption_requested, [0]
def preemption_requested(device):
    calls[0] += 1
    if calls[0] == n:
        print("waiting for a signal", flush=True)
        deadline = time.time() + 60
        while common.preemption.signal is None and time.time() < deadline:
            time.sleep(0.05)
    return real(device)
common.preemption_requested = preemption_requested
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_run_with_drloc_and_mid_epoch_resume_equal_to_uninterrupted(drloc_uninterrupted, tmp_path):
    """A real SIGTERM during the first step of epoch 1 (the 4th preemption check: 2 per epoch in
    the loop, 1 after each epoch in main): the run finishes the step, saves and exits 0; the same
    command resumes at the next unseen batch and ends bit-identical to the uninterrupted run
    (weights, AdamW moments, and the mixup / drop path draws that come from the restored RNGs)."""
    proc = subprocess.Popen([sys.executable, "-c", WAIT_FOR_SIGNAL_AT_CHECK.replace("N_CHECK", "4"), "drloc.py",
                             *TINY, *RUN, "--output_dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    for line in proc.stdout:
        if line.startswith("waiting for a signal"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert line.startswith("waiting for a signal") and proc.returncode == 0, err[-3000:]
    assert "received SIGTERM: checkpoint written" in out and "run the same command again to resume" in out
    middle = load(tmp_path / "checkpoint.pth")
    assert (middle["epoch"], middle["step"]) == (1, 1)
    second = run_drloc_here(*RUN, "--output_dir", str(tmp_path))
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resumed from {tmp_path / 'checkpoint.pth'} at epoch 1, step 1" in second.stdout
    assert [r["epoch"] for r in records(tmp_path)] == [0, 1]
    assert_same_state(load(drloc_uninterrupted / "checkpoint.pth"), load(tmp_path / "checkpoint.pth"))


# Runs a training script and kills it (SIGKILL, as a node failure would) in the middle of its n-th
# write of checkpoint.pth, when half of the serialised bytes are on disk.
KILL_DURING_WRITE = """
import io, os, runpy, signal, sys
from pathlib import Path
import torch
import common
n, real_save, real_checkpoint, writes = N_WRITE, torch.save, common.save_checkpoint, []
def save_checkpoint(state, path):
    writes.append(Path(path).name)
    real_checkpoint(state, path)
def save(obj, f, *args, **kwargs):
    if writes.count("checkpoint.pth") == n and writes[-1] == "checkpoint.pth":
        data = io.BytesIO()
        real_save(obj, data)
        f.write(data.getvalue()[: len(data.getvalue()) // 2])
        f.flush()
        print("killed while writing checkpoint.pth", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, f, *args, **kwargs)
common.save_checkpoint, torch.save = save_checkpoint, save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_crash_while_writing_keeps_the_last_checkpoint_and_resume_at_epoch_boundary_is_exact(drloc_uninterrupted,
                                                                                             tmp_path):
    """Killed halfway through writing the final checkpoint.pth: checkpoint.pth still holds the end
    of epoch 0 and loads; the same command resumes at that epoch boundary and ends bit-identical
    to the uninterrupted run, with every epoch logged once."""
    crashed = run_drloc(*RUN, "--output_dir", str(tmp_path), driver=KILL_DURING_WRITE.replace("N_WRITE", "2"))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert "killed while writing checkpoint.pth" in crashed.stdout
    partial = [p for p in tmp_path.iterdir() if p.name not in ("checkpoint.pth", "args.json", "log.txt", ".lock")]
    assert len(partial) == 1                             # the half-written file is a temporary one
    assert (tmp_path / ".lock").exists()                 # the killed run's lock: the kernel freed it
    with pytest.raises(Exception):
        torch.load(partial[0], weights_only=True)
    last = load(tmp_path / "checkpoint.pth")
    assert (last["epoch"], last["step"]) == (1, 0)
    resumed = run_drloc_here(*RUN, "--output_dir", str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {tmp_path / 'checkpoint.pth'} at epoch 1, step 0" in resumed.stdout
    assert "1 line(s) dropped" in resumed.stdout         # epoch 1's line: its checkpoint was cut
    assert [r["epoch"] for r in records(tmp_path)] == [0, 1]
    assert_same_state(load(drloc_uninterrupted / "checkpoint.pth"), load(tmp_path / "checkpoint.pth"))


def test_pairs_of_a_step_do_not_depend_on_the_number_of_processes(monkeypatch):
    """Process r of n keeps rows r, r + n, ... of the draw for the global batch: the rows of its
    images in one process with the whole batch. With one process the draw is the authors' calls."""
    model = drloc.build_model(args_for(), num_classes=3)
    for mode in ("l1", "exh"):
        model.mode = mode
        whole = model.sample(8, 7, drloc.pair_generator(0, 1, 2))
        expected = (drloc.sample_pairs(8, 7, 64, drloc.pair_generator(0, 1, 2)) if mode == "l1"
                    else drloc.exhaustive_pairs(8, 7, drloc.pair_generator(0, 1, 2)))
        assert all(torch.equal(a, b) for a, b in zip(whole, expected))
        monkeypatch.setattr(common, "get_world_size", lambda: 2)
        for rank in range(2):
            monkeypatch.setattr(common, "get_rank", lambda: rank)
            shard = model.sample(4, 7, drloc.pair_generator(0, 1, 2))
            assert torch.equal(shard[0], whole[0][rank::2]) and torch.equal(shard[1], whole[1][rank::2])
        monkeypatch.undo()
    pairs = [drloc.sample_pairs(2, 7, 64, drloc.pair_generator(0, *step))[0] for step in ((0, 0), (0, 1), (1, 0))]
    assert not torch.equal(pairs[0], pairs[1]) and not torch.equal(pairs[0], pairs[2])   # fresh every step


def test_two_processes_equal_one_process(tmp_path):
    """torchrun --nproc_per_node=2 (gloo) with batch 4 per process == one process with batch 8,
    over 4 steps: same images and crops, same DRLoc pairs per image, averaged gradients. Drop path
    off. Mixup / CutMix off: timm's Mixup draws its lambda from each process's NumPy RNG and mixes
    each image with its mirror in the process's own batch, so two processes mix other image pairs
    than one; making it process-invariant would need a mixup over the global batch, not timm's.
    Validation on 9 images: the sampler pads the second process with a repeat, counted once. Each
    process seeds its generators with seed + rank, as Swin's code: with mixup and drop path on, the two
    would draw the same lambda, box and masks (their saved RNG states differ; one process's is seed's)."""
    args = [*TINY, *RUN, "--drop_path_rate", "0", "--mixup", "0", "--cutmix", "0", "--val_subset", "9"]
    two = start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "drloc.py", *args,
                "--batch_size_per_gpu", "4", "--output_dir", str(tmp_path / "two"))
    one = run_here("drloc.py", *args, "--batch_size_per_gpu", "8", "--output_dir", str(tmp_path / "one"))  # meanwhile
    two = finish(two)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load(tmp_path / "one" / "checkpoint.pth"), load(tmp_path / "two" / "checkpoint.pth")
    assert len(a["rng"]) == 1 and len(b["rng"]) == 2 and records(tmp_path / "two")[-1]["L_drloc"] > 0
    assert_same_trajectory({k: a[k] for k in ("model", "optimizer")}, {k: b[k] for k in ("model", "optimizer")})
    for generator in ("torch", "numpy"):
        rank0, rank1 = (state[generator] if generator == "torch" else state[generator][1] for state in b["rng"])
        assert torch.equal(a["rng"][0][generator] if generator == "torch" else a["rng"][0][generator][1], rank0)
        assert not torch.equal(rank0, rank1)
    assert [r["val_images"] for r in records(tmp_path / "one")] == [r["val_images"] for r in records(tmp_path / "two")] \
        == [9, 9]


def test_folder_with_a_truncated_jpeg_and_unusual_images(tmp_path):
    """Train split: 12 JPEGs, a grayscale, an RGBA, a palette and a 16-bit PNG, a 5 x 3 pixel image
    and a truncated JPEG; val split: the same without the truncated one. Without
    --skip_bad_images the run stops with one line naming the file; with it, the run skips and
    counts that file and trains and validates on all the others (batches of 6: every image)."""
    make_folder(tmp_path / "data" / "train")
    make_folder(tmp_path / "data" / "val", bad=False)
    args = ["--dataset", "folder", "--data_path", str(tmp_path / "data"), "--batch_size_per_gpu", "6",
            "--max_steps_per_epoch", "0", "--epochs", "1"]
    stopped = start("drloc.py", *TINY, *args, "--output_dir", str(tmp_path / "out1"))    # a real process: stderr, status
    skipped = run_drloc_here(*args, "--skip_bad_images", "--output_dir", str(tmp_path / "out2"))   # meanwhile
    stopped = finish(stopped)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read image") and "truncated.jpg" in last and "--skip_bad_images" in last
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "data: 18 train / 17 val images, 2 classes, 3 steps per epoch" in skipped.stdout
    assert "warning: skipping cannot read image" in skipped.stderr and "truncated.jpg" in skipped.stderr
    record = records(tmp_path / "out2")[0]
    assert record["skipped_images"] == 1 and record["L_drloc"] > 0 and math.isfinite(record["loss"])


def test_plain_baseline_run_without_drloc(tmp_path):
    result = run_drloc_here("--epochs", "1", "--lambda_drloc", "0", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    record = records(tmp_path)[0]
    assert record["L_drloc"] == 0 and record["lambda_drloc"] == 0 and math.isfinite(record["L_ce"])
    assert not any(k.startswith("drloc.") for k in load(tmp_path / "checkpoint.pth")["model"])
