"""GLSD: geometric matching on hand-built crops (identical, flipped, disjoint, nested, the strict
threshold, non-square images), the three settings against a naive loop-based statement and the
authors' numbers, Similarity = esvit.py, Vanilla = dino.py, and a real run with resume."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import checks  # noqa: E402
import dino  # noqa: E402
import esvit  # noqa: E402
import glsd  # noqa: E402
from conftest import run_here  # noqa: E402

# Inputs and outputs of the authors' GLSD DINOLoss / DDINOLoss (tileb1/global-local-self-distillation
# @ 7de2526c; 'distance' = geometric), copied from the reference file esvit_glsd.pt (see "meta"/"source").
REFERENCE = torch.load(ROOT / "tests/data/glsd_reference.pt", weights_only=True)


def crop(image_wh, box_px, flip=False):
    """Geometry of one crop of one image, batched as the loader gives it: box (x0, y0, w, h) in pixels."""
    (W, H), (x0, y0, w, h) = image_wh, box_px
    return {"box": torch.tensor([[x0 / W, y0 / H, w / W, h / H]]), "flip": torch.tensor([flip]),
            "image_size": torch.tensor([[float(W), float(H)]])}


def geometric_match(student_crop, student_grid, teacher_crop, teacher_grid):
    """Index and keep mask [T_s] of one student crop against one teacher crop (batch of 1)."""
    s = glsd.token_geometry([student_crop], student_grid, 1)
    t = glsd.token_geometry([teacher_crop], teacher_grid, 1)
    match, keep = glsd.GLSDLoss.match_geometric(s, t)
    return match[0, 0, 0], keep[0, 0, 0]


# ------------------------------------------------------------------------------------------------
# Geometric matching on hand-built geometries
# ------------------------------------------------------------------------------------------------
def test_identical_crops_match_the_same_token():
    c = crop((500, 375), (40, 30, 300, 280))
    match, keep = geometric_match(c, (7, 7), c, (7, 7))
    assert torch.equal(match, torch.arange(49)) and keep.all()


def test_flipped_copy_matches_the_mirrored_token():
    match, keep = geometric_match(crop((500, 375), (40, 30, 300, 280), flip=True), (7, 7),
                                  crop((500, 375), (40, 30, 300, 280)), (7, 7))
    rows, cols = torch.arange(49) // 7, torch.arange(49) % 7
    assert torch.equal(match, rows * 7 + (6 - cols)) and keep.all()


def test_disjoint_crops_keep_no_match():
    match, keep = geometric_match(crop((400, 100), (300, 0, 100, 100)), (3, 3), crop((400, 100), (0, 0, 100, 100)), (7, 7))
    assert not keep.any()
    assert set((match % 7).tolist()) == {6}          # still the nearest teacher tokens: the right-most column


def test_local_crop_inside_global_crop_keeps_the_tokens_below_it():
    """A 96 px local crop aligned with the 32 px cells of a full-image 7x7 global crop (224 x 224)."""
    match, keep = geometric_match(crop((224, 224), (64, 96, 96, 96)), (3, 3), crop((224, 224), (0, 0, 224, 224)), (7, 7))
    rows, cols = torch.arange(9) // 3, torch.arange(9) % 3
    assert torch.equal(match, (3 + rows) * 7 + 2 + cols) and keep.all()
    # a smaller local crop (3 cells of 16 px) over the same place: each token falls in one global cell
    match, keep = geometric_match(crop((224, 224), (64, 96, 48, 48)), (3, 3), crop((224, 224), (0, 0, 224, 224)), (7, 7))
    assert keep.all() and torch.equal(match, torch.tensor([23, 23, 24, 23, 23, 24, 30, 30, 31]))


def test_threshold_is_strict():
    """Teacher: 2x2 tokens of 32 px (hd^2 = 16^2 + 16^2 = 512) over (0, 0, 64, 64) of a 128 px image.
    A student copy shifted by (16, 16) px has every nearest centre at distance^2 exactly 512: rejected;
    shifted by (15, 16) px: 481 < 512, kept. All values are exact in float32."""
    teacher = crop((128, 128), (0, 0, 64, 64))
    _, keep = geometric_match(crop((128, 128), (16, 16, 64, 64)), (2, 2), teacher, (2, 2))
    assert not keep.any()
    match, keep = geometric_match(crop((128, 128), (15, 16, 64, 64)), (2, 2), teacher, (2, 2))
    assert keep.all() and torch.equal(match, torch.arange(4))
    # the larger of the two half-diagonals counts: a student with 64 px tokens (hd^2 = 2048) keeps it
    _, keep = geometric_match(crop((128, 128), (0, 0, 128, 128)), (2, 2), teacher, (2, 2))
    assert keep.tolist() == [True, False, False, False]   # (32, 32) vs (16, 16): 512 < 2048; others farther


def test_distances_are_in_pixels_on_both_axes():
    """A 400 x 100 image: one pixel is one unit on both axes (no per-axis normalisation)."""
    centres, half_diag2 = glsd.token_geometry([crop((400, 100), (0, 0, 400, 100))], (2, 2), 1)
    assert centres[0, 0].tolist() == [[100, 25], [300, 25], [100, 75], [300, 75]]
    assert half_diag2.item() == 100 ** 2 + 25 ** 2


# ------------------------------------------------------------------------------------------------
# The loss against a naive statement: one pair, one sample, one token at a time
# ------------------------------------------------------------------------------------------------
def naive_centres(geometry, b, g):
    """Centres (x, y) in pixels of the g x g tokens of sample b of one crop, and hd^2, from the box."""
    W, H = geometry["image_size"][b].tolist()
    x0, y0, w, h = (geometry["box"][b] * torch.tensor([W, H, W, H])).tolist()
    centres = []
    for t in range(g * g):
        r, c = divmod(t, g)
        c = g - 1 - c if geometry["flip"][b] else c          # the model sees the mirrored crop
        centres.append((x0 + (c + 0.5) * w / g, y0 + (r + 0.5) * h / g))
    return centres, (w / g / 2) ** 2 + (h / g / 2) ** 2


def naive_glsd_loss(s_view, s_region, s_tokens, t_view, t_region, t_tokens, geometry, center, center_grid, temp,
                    matching, threshold=True, student_temp=0.1):
    """Returns (loss, view term, region term, mean distinct teacher tokens, mean kept fraction)."""
    ncrops, batch = len(s_region), len(t_region[0])
    view_total, region_total, distinct, kept, n_pairs = 0.0, 0.0, 0.0, 0.0, 0
    for iq in range(2):
        for v in range(ncrops):
            if v == iq:
                continue
            view, region = 0.0, 0.0
            for b in range(batch):
                q = F.softmax((t_view[iq * batch + b] - center[0]) / temp, dim=-1)
                view = view + -(q * F.log_softmax(s_view[v * batch + b] / student_temp, dim=-1)).sum() / batch
                n_s, n_t = s_tokens[v].shape[1], t_tokens[iq].shape[1]
                s_xy, s_hd2 = naive_centres(geometry[v], b, math.isqrt(n_s))
                t_xy, t_hd2 = naive_centres(geometry[iq], b, math.isqrt(n_t))
                matched = set()
                for i in range(n_s):
                    if matching == "similarity":
                        j = int(F.cosine_similarity(s_tokens[v][b, i][None], t_tokens[iq][b], dim=-1).argmax())
                        keep = 1.0
                    else:
                        d2 = [(s_xy[i][0] - x) ** 2 + (s_xy[i][1] - y) ** 2 for x, y in t_xy]
                        j = min(range(n_t), key=lambda k: d2[k])
                        keep = float(d2[j] < max(t_hd2, s_hd2))
                    matched.add(j)
                    kept += keep / n_s / batch
                    q_j = F.softmax((t_region[iq][b, j] - center_grid[0]) / temp, dim=-1)
                    ce = -(q_j * F.log_softmax(s_region[v][b, i] / student_temp, dim=-1)).sum()
                    region = region + (keep if threshold else 1.0) * ce / n_s / batch
                distinct += len(matched) / batch
            view_total, region_total, n_pairs = view_total + view, region_total + region, n_pairs + 1
    view_total, region_total = view_total / n_pairs, region_total / n_pairs
    loss = view_total if matching == "none" else 0.5 * view_total + 0.5 * region_total
    return loss, view_total, region_total, distinct / n_pairs, kept / n_pairs


def random_case(batch=2, out_dim=11, dim=6, n_local=3, seed=0):
    """Per-crop inputs (2 global crops at 7x7 tokens, n_local crops at 3x3), random crop geometry on
    non-square images, and the same values in the model's layout."""
    g = torch.Generator().manual_seed(seed)
    ncrops, per_crop_tokens = 2 + n_local, [49] * 2 + [9] * n_local
    s_view = torch.randn(ncrops * batch, out_dim, generator=g)
    s_region = [torch.randn(batch, t, out_dim, generator=g) * 2 for t in per_crop_tokens]
    s_tokens = [torch.randn(batch, t, dim, generator=g) for t in per_crop_tokens]
    t_view = torch.randn(2 * batch, out_dim, generator=g)
    t_region = [torch.randn(batch, 49, out_dim, generator=g) * 2 for _ in range(2)]
    t_tokens = [torch.randn(batch, 49, dim, generator=g) for _ in range(2)]
    image_size = torch.randint(200, 600, (batch, 2), generator=g).float()
    geometry = []
    for c in range(ncrops):
        side = torch.rand(batch, 2, generator=g) * (0.6 if c < 2 else 0.3) + (0.4 if c < 2 else 0.1)
        corner = torch.rand(batch, 2, generator=g) * (1 - side)
        geometry.append({"box": torch.cat([corner, side], 1), "flip": torch.rand(batch, generator=g) < 0.5,
                         "image_size": image_size})
    groups = [(0, 2), (2, ncrops)]
    student = glsd.Outputs(s_view, [torch.cat(s_region[s:e]) for s, e in groups],
                           [torch.cat(s_tokens[s:e]) for s, e in groups], [(7, 7), (3, 3)])
    teacher = glsd.Outputs(t_view, [torch.cat(t_region)], [torch.cat(t_tokens)], [(7, 7)])
    return (s_view, s_region, s_tokens, t_view, t_region, t_tokens, geometry), student, teacher


@pytest.mark.parametrize("matching,threshold,epoch", [("geometric", True, 0), ("geometric", False, 12),
                                                      ("similarity", True, 45), ("none", True, 3)])
def test_loss_matches_naive_loop(matching, threshold, epoch):
    per_crop, student, teacher = random_case(seed=epoch + 7)
    loss_fn = glsd.GLSDLoss(11, 5, 0.04, 0.07, 30, 100, local_matching=matching, match_threshold=threshold)
    loss_fn.center.normal_()
    loss_fn.center_grid.normal_()
    center, center_grid = loss_fn.center.clone(), loss_fn.center_grid.clone()
    temp = loss_fn.teacher_temp_schedule[epoch]
    loss, view, region, distinct, kept = naive_glsd_loss(*per_crop, center, center_grid, temp, matching, threshold)
    out = loss_fn(student, teacher, epoch, per_crop[-1])
    torch.testing.assert_close(out["loss"], loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["view_loss"], view, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_fn.center, 0.9 * center + 0.1 * teacher.view.mean(0, keepdim=True))
    if matching == "none":
        assert set(out) == {"loss", "view_loss", "teacher_entropy", "center_norm", "center_grid_norm"}
        assert torch.equal(loss_fn.center_grid, center_grid)
        return
    torch.testing.assert_close(out["region_loss"], region, rtol=1e-5, atol=1e-6)
    assert out["matched_teacher_tokens"].item() == pytest.approx(distinct, rel=1e-5)
    if matching == "geometric":
        assert out["kept_fraction"].item() == pytest.approx(kept, rel=1e-5) and 0 < kept < 1
    else:
        assert "kept_fraction" not in out
    rows = teacher.region[0].flatten(0, 1)
    torch.testing.assert_close(loss_fn.center_grid, 0.9 * center_grid + 0.1 * rows.mean(0, keepdim=True))


def test_geometric_gradients_reach_kept_student_tokens_only():
    per_crop, student, teacher = random_case(seed=3)
    geometry = per_crop[-1]
    geometry[3]["box"][0] = torch.tensor([0.0, 0.0, 0.1, 0.1])    # a local crop far from both global crops
    for g in geometry[:2]:
        g["box"][0] = torch.tensor([0.5, 0.5, 0.5, 0.5])
    region = [r.clone().requires_grad_() for r in student.region]
    student = glsd.Outputs(student.view, region, [t.clone().requires_grad_() for t in student.tokens], student.grids)
    glsd.GLSDLoss(11, 5, 0.04, 0.07, 30, 100)(student, teacher, 0, geometry)["loss"].backward()
    assert region[1].grad[2].abs().sum() == 0        # crop 3, sample 0: every match rejected
    assert region[0].grad[0].abs().sum(-1).gt(0).all()   # crop 0, sample 0: same box as crop 1, all kept
    assert all(t.grad is None for t in student.tokens)


def test_similarity_equals_esvit_and_vanilla_equals_dino():
    per_crop, student, teacher = random_case(seed=11)
    g, e, d = (glsd.GLSDLoss(11, 5, 0.04, 0.07, 30, 100, local_matching="similarity"),
               esvit.EsViTLoss(11, 5, 0.04, 0.07, 30, 100), dino.DINOLoss(11, 5, 0.04, 0.07, 30, 100))
    for loss_fn in (g, e, d):
        loss_fn.center.fill_(0.3)
    g.center_grid.fill_(-0.2)
    e.center_grid.fill_(-0.2)
    torch.testing.assert_close(g(student, teacher, 20)["loss"], e(student, teacher, 20)["loss"], rtol=0, atol=0)
    assert torch.equal(g.center, e.center) and torch.equal(g.center_grid, e.center_grid)
    vanilla = glsd.GLSDLoss(11, 5, 0.04, 0.07, 30, 100, local_matching="none")
    vanilla.center.fill_(0.3)
    torch.testing.assert_close(vanilla(student, teacher, 20, per_crop[-1])["loss"],
                               d(student.view, teacher.view, 20)["loss"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# The authors' numbers
# ------------------------------------------------------------------------------------------------
def reference_outputs(inp, batch=2):
    """The authors' row layout (crop-major, then sample, then token) as `glsd.Outputs`."""
    n_global = 2 * batch * 49
    split = lambda rows: [rows[:n_global].view(2 * batch, 49, -1), rows[n_global:].view(3 * batch, 9, -1)]  # noqa: E731
    student = glsd.Outputs(inp["s_cls"], split(inp["s_region"]), split(inp["s_fea"]), [(7, 7), (3, 3)])
    teacher = glsd.Outputs(inp["t_cls"], [inp["t_region"].view(2 * batch, 49, -1)],
                           [inp["t_fea"].view(2 * batch, 49, -1)], [(7, 7)])
    return student, teacher


def reference_loss(**kwargs):
    inp = REFERENCE["inputs"]
    loss_fn = glsd.GLSDLoss(48, 5, **REFERENCE["meta"]["schedule"], **kwargs)
    loss_fn.center.copy_(inp["center_init"])
    loss_fn.center_grid.copy_(inp["center_grid_init"])
    return loss_fn


def close(a, b):
    torch.testing.assert_close(torch.as_tensor(a).float().reshape(-1), torch.as_tensor(b).float().reshape(-1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", REFERENCE["vanilla_cases"], ids=lambda c: f"epoch{c['epoch']}")
def test_vanilla_matches_authors_code(case):
    student, teacher = reference_outputs(REFERENCE["inputs"])
    loss_fn = reference_loss(local_matching="none")
    out = loss_fn(student, teacher, case["epoch"])
    close(out["loss"], case["expected_loss_view"])                  # weight 1, no 0.5
    close(loss_fn.center, case["expected_center"])


@pytest.mark.parametrize("case", REFERENCE["similarity_cases"], ids=lambda c: f"epoch{c['epoch']}")
def test_similarity_matches_authors_code(case):
    student, teacher = reference_outputs(REFERENCE["inputs"])
    loss_fn = reference_loss(local_matching="similarity")
    out = loss_fn(student, teacher, case["epoch"])
    close(0.5 * out["view_loss"], case["expected_loss_view"])
    close(0.5 * out["region_loss"], case["expected_loss_region"])
    close(out["loss"], case["expected_loss_total"])
    close(loss_fn.center, case["expected_center"])
    close(loss_fn.center_grid, case["expected_center_grid"])


def reference_geometry(d):
    """Per-crop geometry dicts from the authors' RandomResizedCrop parameters (i, j, h, w) in pixels."""
    image_size = torch.tensor(d["img_sizes_wh"], dtype=torch.float32)           # [B, 2] = W, H
    scale = torch.cat([image_size, image_size], 1)
    return [{"box": box[:, [1, 0, 3, 2]].float() / scale, "flip": flip.bool(), "image_size": image_size}
            for box, flip in zip(d["boxes_ijhw"], d["flips"])]


@pytest.mark.parametrize("kind,index", [(k, i) for k in ("distance_analytic", "distance_pipeline") for i in range(4)])
def test_geometric_matches_authors_code(kind, index):
    """Centres from the crop boxes (not the authors' resized coordinate maps): same indices, same
    keep masks, same losses."""
    d = REFERENCE[kind]
    case, geometry = d["cases"][index], reference_geometry(d)
    student, teacher = reference_outputs(REFERENCE["inputs"])
    loss_fn = reference_loss(local_matching="geometric", match_threshold=case["hinge_bool"])
    out = loss_fn(student, teacher, case["epoch"], geometry)
    close(0.5 * out["view_loss"], case["expected_loss_view"])
    close(0.5 * out["region_loss"], case["expected_loss_region"])
    close(out["loss"], case["expected_loss_total"])
    close(loss_fn.center, case["expected_center"])
    close(loss_fn.center_grid, case["expected_center_grid"])
    t = glsd.token_geometry(geometry[:2], (7, 7), 2)
    groups = [loss_fn.match_geometric(glsd.token_geometry(geometry[:2], (7, 7), 2), t),
              loss_fn.match_geometric(glsd.token_geometry(geometry[2:], (3, 3), 2), t)]
    for (iq, v), index_, keep in zip(REFERENCE["meta"]["pairs_iq_v"], case["matched_teacher_idx"], case["derived_keep_mask"]):
        (match, within), k = groups[v >= 2], v if v < 2 else v - 2
        assert torch.equal(match[iq, k], index_), (iq, v)
        if case["hinge_bool"]:
            assert torch.equal(within[iq, k].float(), keep), (iq, v)


# ------------------------------------------------------------------------------------------------
# Real run
# ------------------------------------------------------------------------------------------------
TINY = ["--arch", "swin_pico", "--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "64",
        "--global_crop_size", "64", "--local_crop_size", "32", "--local_crops_number", "2", "--out_dim", "64",
        "--batch_size_per_gpu", "8", "--num_workers", "0", "--warmup_epochs", "0", "--max_steps_per_epoch", "2",
        "--device", "cpu",
        "--precision", "fp32"]  # not auto: runs are compared to the digit, on every CPU


def run_glsd(*extra):
    return subprocess.run([sys.executable, "glsd.py", *TINY, *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_step_run_then_resume(tmp_path):
    """The first run a real process, the resumed one glsd.py's entry point in this process."""
    first = run_glsd("--epochs", "1", "--output_dir", str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["method"] == "glsd" and ckpt["args"]["local_matching"] == "geometric"
    assert set(ckpt) >= {"student", "teacher", "optimizer", "scaler", "glsd_loss", "args", "rng"}
    assert ckpt["glsd_loss"]["center_grid"].abs().sum() > 0
    second = run_here("glsd.py", *TINY, "--epochs", "2", "--output_dir", str(tmp_path))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout
    log = [json.loads(line) for line in (tmp_path / "log.txt").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1]
    for key in ("loss", "view_loss", "region_loss", "matched_teacher_tokens", "center_grid_norm"):
        assert all(math.isfinite(r[key]) for r in log), key
    assert all(0 < r["kept_fraction"] <= 1 for r in log)


@pytest.mark.parametrize("glsd_flags, esvit_flags", [(["--local_matching", "similarity"], []),
                                                      (["--local_matching", "none"], ["--use_region_loss", "false"])])
def test_similarity_and_vanilla_train_exactly_like_esvit(tmp_path, glsd_flags, esvit_flags):
    """Two steps with drop path from the same seed: glsd.py's Similarity setting trains bit-identically
    to esvit.py, Vanilla to esvit.py without the region loss (both scripts' entry points in this process)."""
    flags = ["--epochs", "1", "--drop_path_rate", "0.1", "--seed", "3", "--saveckp_freq", "0"]
    runs = {"glsd": run_here("glsd.py", *TINY, *flags, *glsd_flags, "--output_dir", str(tmp_path / "glsd")),
            "esvit": run_here("esvit.py", *TINY, *flags, *esvit_flags, "--output_dir", str(tmp_path / "esvit"))}
    ckpts = {}
    for name, proc in runs.items():
        assert proc.returncode == 0, proc.stderr[-2000:]
        ckpts[name] = torch.load(tmp_path / name / "checkpoint.pth", weights_only=True)
    for part in ("student", "teacher"):
        g, e = ckpts["glsd"][part], ckpts["esvit"][part]
        assert g.keys() == e.keys()
        for key in g:
            assert torch.equal(g[key], e[key]), (part, key)
    for key in ("center", "center_grid"):
        assert torch.equal(ckpts["glsd"]["glsd_loss"][key], ckpts["esvit"]["esvit_loss"][key])
    student, teacher = ckpts["glsd"]["student"], ckpts["glsd"]["teacher"]
    assert any(not torch.equal(student[k], teacher[k]) for k in teacher)   # the steps did train
    logs = [(tmp_path / name / "log.txt").read_text().splitlines() for name in runs]
    assert json.loads(logs[0][0])["loss"] == json.loads(logs[1][0])["loss"]


def test_crop_sizes_must_be_tiled_by_tokens():
    parse = glsd.get_args_parser().parse_args
    with pytest.raises(SystemExit, match="--local_crop_size 48 is not a multiple"):
        checks.check_start_args(parse(["--arch", "swin_pico", "--local_crop_size", "48"]))
    with pytest.raises(SystemExit, match=r"--global_crop_size 40 .*\(16 px\)"):
        checks.check_start_args(parse(["--arch", "vit_pico", "--global_crop_size", "40"]))
    with pytest.raises(SystemExit, match="--local_crop_size 48 is not a multiple"):   # one rule for every matching
        checks.check_start_args(parse(["--arch", "swin_pico", "--local_crop_size", "48", "--local_matching", "similarity"]))
    checks.check_start_args(parse([]))                 # the defaults: 224 and 96 px on Swin-T


def test_help_is_grouped():
    out = glsd.get_args_parser().format_help()
    for group in ("backbone:", "GLSD heads and loss:", "optimisation:", "multi-crop augmentation:", "data:", "run:"):
        assert group in out
    assert "--local_matching" in out and "--match_threshold" in out
