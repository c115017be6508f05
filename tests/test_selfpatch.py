"""Tests of selfpatch.py.

Reference cases: tests/data/selfpatch_*.pt hold small cases computed by running the authors' code
(alinlab/SelfPatch at commit 81aef149: `SelfPatchHead`, `DINOLoss` of main_selfpatch.py, the
official ViT), copied from the project's reference file selfpatch.pt (see the "source" entry of
each file). The other tests restate the method naively, with loops, on random inputs.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import eval_knn  # noqa: E402
import selfpatch as sp  # noqa: E402
from conftest import one_thread, run_here  # noqa: E402

DATA = ROOT / "tests" / "data"


def load(name):
    return torch.load(DATA / f"selfpatch_{name}.pt", weights_only=True)


def tiny_args(**overrides):
    args = sp.get_args_parser().parse_args(["--arch", "vit_pico", "--patch_size", "8", "--out_dim", "32",
                                            "--patch_out_dim", "16"])
    vars(args).update(overrides)
    return args


# ------------------------------------------------------------------------------------------------
# Neighbour tables and positive selection
# ------------------------------------------------------------------------------------------------
def candidates(h, w, wrap):
    """Sorted valid candidates of every patch, from `neighbor_table`."""
    index, valid = sp.neighbor_table(h, w, wrap)
    return [sorted(index[i][valid[i]].tolist()) for i in range(h * w)]


def test_neighbor_table_by_hand():
    # a 4 x 5 grid, flat index = row * 5 + col:
    #    0  1  2  3  4
    #    5  6  7  8  9
    #   10 11 12 13 14
    #   15 16 17 18 19
    wrap, flat = candidates(4, 5, True), candidates(4, 5, False)
    assert wrap[0] == [1, 4, 5, 6, 9, 15, 16, 19]        # top-left corner: wraps to row 3 and column 4
    assert flat[0] == [1, 5, 6]
    assert wrap[19] == [0, 3, 4, 10, 13, 14, 15, 18]     # bottom-right corner
    assert flat[19] == [13, 14, 18]
    assert wrap[2] == [1, 3, 6, 7, 8, 16, 17, 18]        # top edge
    assert flat[2] == [1, 3, 6, 7, 8]
    assert flat[10] == [5, 6, 11, 15, 16]                # left edge
    assert wrap[12] == flat[12] == [6, 7, 8, 11, 13, 16, 17, 18]   # interior: both the same
    # sides shorter than 3: with wrap-around a cell counts once and is never its own neighbour
    assert candidates(2, 2, True) == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    assert candidates(1, 4, True)[0] == [1, 3] and candidates(1, 4, False)[0] == [1]
    assert candidates(1, 1, True) == [[]]
    index, _ = sp.neighbor_table(4, 5, False)
    assert index.shape == (20, 8) and index.min() >= 0 and index.max() < 20     # always safe to index with


def test_neighbor_table_matches_authors():
    ref = load("selection")["neighbors"]
    for side in (14, 6):
        index, valid = sp.neighbor_table(side, side, True)
        assert valid.all()
        assert torch.equal(index, ref[f"grid{side}"])


@pytest.mark.parametrize("wrap", [True, False])
def test_select_positives_against_naive_loop(wrap):
    torch.manual_seed(0)
    B, h, w, k = 2, 5, 7, 3
    tokens = torch.randn(B, h * w, 8) * torch.rand(B, h * w, 1) * 10       # very different norms
    index, valid = sp.neighbor_table(h, w, wrap)
    got = sp.select_positives(tokens, index, valid, k)
    assert got.shape == (B, h * w, k)
    for b in range(B):
        for i in range(h * w):
            r, c = divmod(i, w)
            cands = set()
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    rr, cc = r + dr, c + dc
                    if wrap:
                        rr, cc = rr % h, cc % w
                    elif not (0 <= rr < h and 0 <= cc < w):
                        continue
                    if rr * w + cc != i:
                        cands.add(rr * w + cc)
            ranked = sorted(cands, key=lambda j: -F.cosine_similarity(tokens[b, i], tokens[b, j], dim=0).item())
            assert set(got[b, i].tolist()) == set(ranked[:k]), (b, i)


def test_select_positives_matches_authors():
    for name, case in load("selection")["selection"].items():
        index, valid = sp.neighbor_table(case["grid"], case["grid"], True)
        got = sp.select_positives(case["feats"], index, valid, case["k"])
        assert torch.equal(got.sort(-1).values, case["topk_abs"].sort(-1).values), name   # as sets


def test_too_few_candidates_is_a_clear_error():
    model = sp.build_model(tiny_args(k_num=4, neighbors_wrap=False), 0.0)
    with pytest.raises(SystemExit, match="--k_num 4 needs 1 to 3 positives on a 4x4 patch grid"):
        model.positives(torch.randn(1, 4, 4, 64))               # corners have 3 candidates
    model.k_num = 3
    assert model.positives(torch.randn(1, 4, 4, 64)).shape == (1, 16, 3)
    model.neighbors_wrap = True
    with pytest.raises(SystemExit, match="1x1 patch grid"):
        model.positives(torch.randn(1, 1, 1, 64))               # no neighbour at all
    with pytest.raises(SystemExit, match="--arch swin_pico"):
        sp.check_args(tiny_args(arch="swin_pico"))


# ------------------------------------------------------------------------------------------------
# Aggregation module
# ------------------------------------------------------------------------------------------------
def test_class_attention_block_against_naive_statement():
    torch.manual_seed(0)
    block = common.ClassAttentionBlock(8, num_heads=2)
    query, tokens = torch.randn(3, 1, 8), torch.randn(3, 5, 8)
    out = block(query, tokens)
    assert out.shape == (3, 1, 8)

    def naive(query_among_keys):
        result = torch.zeros(3, 1, 8)
        for m in range(3):
            keys = torch.cat([query[m], tokens[m]]) if query_among_keys else tokens[m]
            u = block.norm1(keys)
            q = block.attn.q(block.norm1(query[m]))[0]
            k, v = block.attn.k(u), block.attn.v(u)
            heads = []
            for head in range(2):
                part = slice(4 * head, 4 * head + 4)
                weights = torch.softmax(k[:, part] @ q[part] / 4 ** 0.5, dim=0)
                heads.append(weights @ v[:, part])
            x = query[m, 0] + block.attn.proj(torch.cat(heads))
            result[m, 0] = x + block.mlp(block.norm2(x))
        return result

    torch.testing.assert_close(out, naive(True))
    assert not torch.allclose(out, naive(False), atol=1e-3)     # the query attends to itself too


def test_aggregation_module_modes():
    torch.manual_seed(0)
    agg = sp.AggregationModule(8, num_heads=2)
    tokens = torch.randn(2, 9, 8)
    positives = torch.randint(0, 9, (2, 9, 3))
    student, teacher = agg(tokens), agg(tokens, positives)
    assert student.shape == teacher.shape == (2, 10, 8)
    torch.testing.assert_close(student[:, 0], teacher[:, 0], rtol=0, atol=0)   # same image token
    torch.testing.assert_close(student[:, 1:], agg.norm(tokens))                # student patch = LN(own token)
    for b in range(2):
        for i in range(9):
            alone = agg.summarize(tokens[b, positives[b, i]][None])            # only i's positives
            torch.testing.assert_close(teacher[b, 1 + i], agg.norm(alone)[0])


def test_aggregation_matches_authors():
    ref, sel = load("aggregation"), load("selection")["selection"]
    agg = sp.AggregationModule(16, num_heads=4)
    agg.load_state_dict(ref["state_dict"], strict=True)        # the authors' SelfPatchHead key names
    for name in ("grid14", "grid6"):
        x, positives = sel[name]["feats"], sel[name]["topk_abs"]
        with torch.no_grad():
            torch.testing.assert_close(agg(x, positives), ref[name]["out_loc"], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(agg(x), ref[name]["out_glob"], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------
def naive_loss(s_image, s_patches, t_image, t_patches, center, patch_center, temp, ncrops, batch, weight,
               center_crops="all", patch_temp=None):
    """The loss with one loop per crop pair, image and patch (per-crop lists, crop-major)."""
    patch_temp = temp if patch_temp is None else patch_temp
    s_img, t_img = s_image.chunk(ncrops), t_image.chunk(ncrops)
    s_pat = [crop for group in s_patches for crop in group.chunk(len(group) // batch)]
    t_pat = [crop for group in t_patches for crop in group.chunk(len(group) // batch)]

    def H(t, s, c, tau=temp):
        return -(F.softmax((t - c) / tau, dim=-1) * F.log_softmax(s / 0.1, dim=-1)).sum()

    pairs = []
    for t in range(2):
        for s in range(ncrops):
            if s != t:
                pairs.append(sum(H(t_img[t][b], s_img[s][b], center[0]) for b in range(batch)) / batch)
    cls_loss = sum(pairs) / len(pairs)
    crops = []
    for v in range(ncrops):
        n = t_pat[v].shape[1]
        crops.append(sum(H(t_pat[v][b, i], s_pat[v][b, i], patch_center[0], patch_temp)
                         for b in range(batch) for i in range(n)) / (batch * n))
    patch_loss = sum(crops) / ncrops
    centered = t_img if center_crops == "all" else t_img[:2]
    new_center = 0.9 * center + 0.1 * sum(crop.sum(0, keepdim=True) for crop in centered) / (len(centered) * batch)
    all_patches = torch.cat([t.flatten(0, 1) for t in t_patches])
    new_patch_center = 0.9 * patch_center + 0.1 * all_patches.mean(0, keepdim=True)
    return cls_loss + weight * patch_loss, cls_loss, patch_loss, new_center, new_patch_center


@pytest.mark.parametrize("center_crops, patch_temp", [("all", None), ("global", None), ("all", 0.02)])
def test_loss_against_naive_loop(center_crops, patch_temp):
    torch.manual_seed(0)
    B, V, K, Kp, epoch = 3, 4, 12, 7, 1
    crit = sp.SelfPatchLoss(K, Kp, V, 0.04, 0.07, warmup_teacher_temp_epochs=3, nepochs=5, patch_loss_weight=0.3,
                            center_crops=center_crops, patch_teacher_temp=patch_temp)
    crit.center.copy_(torch.randn(1, K))
    crit.patch_center.copy_(torch.randn(1, Kp))
    center, patch_center = crit.center.clone(), crit.patch_center.clone()
    shapes = [(2 * B, 9), (2 * B, 4)]                          # 2 global crops of 3x3, 2 local of 2x2
    s_image, t_image = torch.randn(V * B, K, requires_grad=True), torch.randn(V * B, K, requires_grad=True)
    s_patches = [torch.randn(n, N, Kp, requires_grad=True) for n, N in shapes]
    t_patches = [torch.randn(n, N, Kp, requires_grad=True) for n, N in shapes]
    out = crit((s_image, s_patches), (t_image, t_patches), epoch)
    out["loss"].backward()

    leaves = [x.detach().clone().requires_grad_(True) for x in [s_image, *s_patches]]
    ref = naive_loss(leaves[0], leaves[1:], t_image.detach(), [t.detach() for t in t_patches], center,
                     patch_center, crit.teacher_temp_schedule[epoch], V, B, 0.3, center_crops, patch_temp)
    ref[0].backward()
    for got, want in zip((out["loss"], out["cls_loss"], out["patch_loss"]), ref[:3]):
        torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(crit.center, ref[3])
    torch.testing.assert_close(crit.patch_center, ref[4])
    for mine, naive in zip([s_image, *s_patches], leaves):
        torch.testing.assert_close(mine.grad, naive.grad)
    assert t_image.grad is None and all(t.grad is None for t in t_patches)   # no gradient into the teacher


def test_loss_matches_authors():
    ref = load("loss")
    cfg = ref["config"]
    crit = sp.SelfPatchLoss(cfg["out_dim"], cfg["out_dim_selfpatch"], cfg["ncrops"], cfg["warmup_teacher_temp"],
                            cfg["teacher_temp"], cfg["warmup_teacher_temp_epochs"], cfg["nepochs"],
                            cfg["patch_loss_weight"])
    crit.center.copy_(ref["center_before"].reshape(1, -1))
    crit.patch_center.copy_(ref["patch_center_before"])

    def ours(groups):   # authors' [[cls (n,1,K), patches (n,N,K_p)] per resolution] -> ours
        return torch.cat([g[0][:, 0] for g in groups]), [g[1] for g in groups]

    s_image, s_patches = ours(ref["student_output"])
    s_image.requires_grad_(True)
    for p in s_patches:
        p.requires_grad_(True)
    out = crit((s_image, s_patches), ours(ref["teacher_output"]), ref["epoch"])
    out["loss"].backward()
    for key, want in (("loss", "loss"), ("cls_loss", "c_loss"), ("patch_loss", "p_loss")):
        assert out[key].item() == pytest.approx(ref[want], rel=1e-5)
    torch.testing.assert_close(crit.center, ref["center_after"].reshape(1, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(crit.patch_center, ref["patch_center_after"], atol=1e-6, rtol=0)
    g_image, g_patches = ours(ref["grad_student_output"])
    torch.testing.assert_close(s_image.grad, g_image, rtol=1e-4, atol=1e-6)
    for mine, want in zip(s_patches, g_patches):
        torch.testing.assert_close(mine.grad, want, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def test_patch_loss_gives_no_gradient_to_aggregation_blocks():
    torch.manual_seed(0)
    args = tiny_args()
    student, teacher = sp.build_model(args, 0.0), sp.build_model(args, 0.0)
    crops = [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32), torch.randn(2, 3, 24, 24)]
    with torch.no_grad():
        t_out = teacher(crops, aggregate_positives=True)
    crit = sp.SelfPatchLoss(args.out_dim, args.patch_out_dim, 3, 0.04, 0.04, 0, 10)

    def grads(which):
        student.zero_grad(set_to_none=True)
        image, patches = student(crops)
        if which == "patch":
            image = image.detach()
        else:
            patches = [p.detach() for p in patches]
        crit((image, patches), t_out, 0)["loss"].backward()
        return {n: p.grad is not None and bool(p.grad.any()) for n, p in student.named_parameters() if p.requires_grad}

    patch, cls = grads("patch"), grads("cls")
    blocks = [n for n in patch if n == "ca_head.cls_token" or n.startswith("ca_head.cls_blocks.")]
    assert len(blocks) == 1 + 2 * 16
    assert not any(patch[n] for n in blocks) and not any(patch[n] for n in patch if n.startswith("c_head."))
    assert all(patch[n] for n in patch if n.startswith(("backbone.", "p_head.", "ca_head.norm.")))
    assert all(cls[n] for n in blocks) and not any(cls[n] for n in cls if n.startswith("p_head."))


class RecordedBackbone(nn.Module):
    """Stands in for the backbone: returns the authors' recorded raw tokens of a group of crops,
    found by the side of the (dummy) crops, which equals the side of their patch grid."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = {round(o.shape[1] ** 0.5): o for o in outputs}

    def forward_dense(self, x, norm=True):
        side = x.shape[-1]
        return None, self.outputs[side].unflatten(1, (side, side))


def test_pipeline_matches_authors():
    """Heads, positives, loss and head gradients of the authors' tiny model, from its recorded
    backbone outputs (global crops: 14x14 grid, local crops: 6x6, B=3, 5 crops)."""
    ref, ref_teacher = load("pipeline"), load("pipeline_teacher")
    cfg = ref["config"]

    def model(heads, backbone_out):
        dino_heads = [common.DINOHead(16, k, hidden_dim=32, bottleneck_dim=16)
                      for k in (cfg["out_dim"], cfg["out_dim_selfpatch"])]
        m = sp.SelfPatch(RecordedBackbone(backbone_out), sp.AggregationModule(16, 4), *dino_heads, cfg["k_num"])
        m.load_state_dict(heads, strict=True)
        return m

    student = model(ref["student_heads"], ref["student_backbone_out"])
    teacher = model(ref_teacher["teacher_heads"], ref_teacher["teacher_backbone_out"])
    B = cfg["batch"]
    crops = [torch.zeros(B, 1, 14, 14)] * 2 + [torch.zeros(B, 1, 6, 6)] * 3
    crit = sp.SelfPatchLoss(cfg["out_dim"], cfg["out_dim_selfpatch"], 5, cfg["teacher_temp"], cfg["teacher_temp"], 0, 1)
    crit.center.copy_(ref["center_before"].reshape(1, -1))
    crit.patch_center.copy_(ref["patch_center_before"])
    with torch.no_grad():
        t_out = teacher(crops, aggregate_positives=True)
    out = crit(student(crops), t_out, ref["epoch"])
    out["loss"].backward()
    for key, want in (("loss", "loss"), ("cls_loss", "c_loss"), ("patch_loss", "p_loss")):
        assert out[key].item() == pytest.approx(ref[want], rel=1e-5)
    torch.testing.assert_close(crit.center, ref["center_after"].reshape(1, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(crit.patch_center, ref["patch_center_after"], atol=1e-6, rtol=0)
    params = dict(student.named_parameters())
    assert len(ref["student_grads"]) == 25
    for name, grad in ref["student_grads"].items():
        torch.testing.assert_close(params[name].grad, grad, rtol=1e-4, atol=1e-6)


def test_backbone_matches_authors_on_a_local_crop():
    """The authors' ViT (no CLS token, no final norm) on a 48 px crop: its 6x6 grid needs the
    position-embedding interpolation with DINO's scale-factor formula (common.ViT)."""
    ref = load("backbone")
    backbone = common.build_backbone("vit_pico", 8, img_size=112, class_token=False, final_norm=False,
                                     embed_dim=16, depth=2, num_heads=4)
    backbone.load_state_dict(ref["backbone"], strict=True)
    with torch.no_grad():
        _, grid = backbone.forward_dense(ref["local_image"], norm=False)
    torch.testing.assert_close(grid.flatten(1, 2), ref["local_out"], atol=1e-5, rtol=1e-4)


def test_image_token_for_evaluation():
    """What eval_knn.py / eval_linear.py get from eval_knn.load_backbone: a PooledViT whose
    class-attention pooling (the module selfpatch.py trains, `common.ClassAttentionPool`) loads the
    aggregation module's weights strictly and gives the image token the image head sees."""
    torch.manual_seed(0)
    model = sp.build_model(tiny_args(), 0.0).eval()
    dim, heads = model.backbone.num_features, model.backbone.blocks[0].attn.num_heads
    pool = common.ClassAttentionPool(dim, heads)
    common.load_state_dict_strict(pool, model.ca_head.state_dict())
    x = torch.randn(2, 3, 40, 32)
    with torch.no_grad():
        feats = eval_knn.PooledViT(model.backbone, pool)(x)
        image_logits, _ = model([x])
    assert feats.shape == (2, 64)
    torch.testing.assert_close(model.c_head(feats), image_logits)


# ------------------------------------------------------------------------------------------------
# Training script
# ------------------------------------------------------------------------------------------------
def test_teacher_sees_every_crop_and_last_layers_frozen_in_epoch0(tmp_path):
    args = sp.get_args_parser().parse_args(smoke_argv(tmp_path, 2) + ["--synthetic_images", "16", "--lr", "0.01"])
    device = torch.device("cpu")
    student, teacher = sp.build_model(args, 0.0), sp.build_model(args, 0.0)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    seen = []
    teacher.backbone.patch_embed.register_forward_pre_hook(lambda m, inp: seen.append(tuple(inp[0].shape)))
    dataset = common.SeededDataset(common.build_dataset(args), common.MultiCropAugmentation(
        args.global_crops_scale, args.local_crops_scale, 2, 32, 24))
    loader, _ = common.make_loader(dataset, 8, 0)
    criterion = sp.SelfPatchLoss(64, 32, 4, 0.04, 0.04, 0, 2)
    optimizer = torch.optim.AdamW(common.get_params_groups(student))
    schedules = {"lr": [0.01] * 2, "wd": [0.04] * 2, "momentum": [0.996] * 2}
    before = {k: v.clone() for k, v in student.state_dict().items()}
    sp.train_one_epoch(student, teacher, criterion, loader, optimizer, common.make_grad_scaler(device, "fp32"),
                       schedules, 0, 0, args, device)
    assert seen == [(16, 3, 32, 32), (16, 3, 24, 24)]         # global and local crops, one call per resolution
    after = student.state_dict()
    for head in ("c_head", "p_head"):
        assert torch.equal(before[f"{head}.last_layer.weight_v"], after[f"{head}.last_layer.weight_v"])
        assert not torch.equal(before[f"{head}.mlp.0.weight"], after[f"{head}.mlp.0.weight"])
    sp.train_one_epoch(student, teacher, criterion, loader, optimizer, common.make_grad_scaler(device, "fp32"),
                       schedules, 1, 0, args, device)
    after = student.state_dict()
    for head in ("c_head", "p_head"):
        assert not torch.equal(before[f"{head}.last_layer.weight_v"], after[f"{head}.last_layer.weight_v"])


def smoke_argv(tmp_path, epochs):
    return ["--dataset", "synthetic", "--synthetic_images", "64", "--synthetic_image_size", "32", "--arch", "vit_pico",
            "--patch_size", "8", "--global_crop_size", "32", "--local_crop_size", "24", "--local_crops_number", "2",
            "--out_dim", "64", "--patch_out_dim", "32", "--batch_size_per_gpu", "8", "--epochs", str(epochs),
            "--warmup_epochs", "1", "--max_steps_per_epoch", "2", "--num_workers", "0", "--device", "cpu",
            "--output_dir", str(tmp_path)]


def test_training_runs_and_resumes(tmp_path):
    # a 2-step epoch through the command line, on 4x4 (global) and 3x3 (local) patch grids
    result = subprocess.run([sys.executable, str(ROOT / "selfpatch.py"), *smoke_argv(tmp_path, 1)], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    keys = {"student", "teacher", "optimizer", "scaler", "selfpatch_loss", "epoch", "args", "method", "rng"}
    assert keys <= set(ckpt)
    assert ckpt["method"] == "selfpatch" and ckpt["epoch"] == 1
    assert any(k.startswith("ca_head.cls_blocks.") for k in ckpt["teacher"])
    assert (tmp_path / "teacher_backbone.pth").exists()
    record = json.loads((tmp_path / "log.txt").read_text().splitlines()[0])
    for key in ("loss", "cls_loss", "patch_loss"):
        assert record[key] == record[key] and abs(record[key]) < 1e3    # finite
    assert record["loss"] == pytest.approx(record["cls_loss"] + 0.1 * record["patch_loss"], rel=1e-5)

    # resume for a second epoch (selfpatch.py's entry point in this process, to save the start-up time of another one)
    resumed = run_here("selfpatch.py", *smoke_argv(tmp_path, 2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1]
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 2

    # extras/tools/teacher_outputs.py reassembles the teacher's image path (aggregated image token -> c_head)
    # as SelfPatch's own model computes it
    sys.path.append(str(ROOT / "extras" / "tools"))
    import teacher_outputs
    data = ["--dataset", "synthetic", "--synthetic_images", "64", "--synthetic_image_size", "32",
            "--resize", "32", "--crop", "32", "--num_workers", "0"]
    args = teacher_outputs.get_args_parser().parse_args(
        ["--pretrained_weights", str(tmp_path / "checkpoint.pth"), "--max_images", "10", *data])
    with one_thread():
        got = teacher_outputs.main(args)
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    model = sp.build_model(argparse.Namespace(**ckpt["args"]), 0.0)
    model.load_state_dict(ckpt["teacher"])
    dataset = common.build_dataset(args, train=False)
    images = torch.stack([common.eval_transform(32, 32)(dataset[i][0]) for i in range(10)])
    with torch.no_grad(), one_thread():
        image_logits, _ = model.eval()([images])
    expected = teacher_outputs.head_statistics(image_logits, ckpt["selfpatch_loss"]["center"], ckpt["args"]["teacher_temp"])
    assert got[:2] == pytest.approx(expected[:2], abs=1e-4) and got[2] == expected[2]


def test_positives_under_bf16_autocast_are_the_float32_selection():
    """The teacher picks each patch's positives from cosine similarities of neighbouring tokens, which sit
    close together (here 0.999 +- 0.001, as the tokens of one object do): in bf16 (8 significant bits)
    they tie and reorder, and 99% of the patches got another set of positives. `select_positives`
    computes them in float32 under any autocast, as the DINO head does: the same selection."""
    torch.manual_seed(0)
    h = w = 14
    tokens = (torch.randn(4, 1, 64) + 0.05 * torch.randn(4, h * w, 64))      # one direction, small variations
    neighbors, valid = sp.neighbor_table(h, w, True)
    reference = sp.select_positives(tokens, neighbors, valid, 4)
    with common.autocast(torch.device("cpu"), "bf16"):
        assert torch.equal(sp.select_positives(tokens, neighbors, valid, 4), reference)
        assert torch.equal(sp.SelfPatch(None, None, None, None, k_num=4).positives(tokens.unflatten(1, (h, w))),
                           reference)
