"""EsViT: the view + region loss against a naive loop-based statement and the authors' numbers, the
matching (backbone-token cosine, not head outputs), gradients, both centres (also across two gloo
processes), the view-only mode (= DINO), the model's outputs, and real runs: view-only, continual
pre-training with the region loss (--init_from), and resume."""
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dino  # noqa: E402
import esvit  # noqa: E402
from conftest import one_thread, run_here  # noqa: E402

# Inputs and outputs of the authors' main_esvit.DDINOLoss / DINOLoss (microsoft/esvit @ 2d6becd9),
# copied from the reference file esvit_glsd.pt (see the file's "meta"/"source").
REFERENCE = torch.load(ROOT / "tests/data/esvit_reference.pt", weights_only=True)


# ------------------------------------------------------------------------------------------------
# A naive statement of the loss: one (teacher crop, student crop) pair, one sample, one token at a time
# ------------------------------------------------------------------------------------------------
def naive_esvit_loss(s_view, s_region, s_tokens, t_view, t_region, t_tokens, center, center_grid, temp,
                     use_region_loss=True, student_temp=0.1):
    """s_view [ncrops*B, K]; s_region / s_tokens: one [B, T_c, .] tensor per crop; t_*: the same for
    the 2 global crops. Returns (loss, view term, region term, matched teacher index per pair)."""
    ncrops, batch = len(s_region), len(t_region[0])
    view_total, region_total, n_pairs, matches = 0.0, 0.0, 0, {}
    for iq in range(2):
        for v in range(ncrops):
            if v == iq:
                continue
            view, region = 0.0, 0.0
            matches[iq, v] = torch.zeros(batch, s_tokens[v].shape[1], dtype=torch.long)
            for b in range(batch):
                q = F.softmax((t_view[iq * batch + b] - center[0]) / temp, dim=-1)
                view = view + -(q * F.log_softmax(s_view[v * batch + b] / student_temp, dim=-1)).sum() / batch
                n_tokens = s_tokens[v].shape[1]
                for i in range(n_tokens):
                    cosine = F.cosine_similarity(s_tokens[v][b, i][None], t_tokens[iq][b], dim=-1)
                    j = int(cosine.argmax())
                    matches[iq, v][b, i] = j
                    q_j = F.softmax((t_region[iq][b, j] - center_grid[0]) / temp, dim=-1)
                    log_p_i = F.log_softmax(s_region[v][b, i] / student_temp, dim=-1)
                    region = region + -(q_j * log_p_i).sum() / n_tokens / batch
            view_total, region_total, n_pairs = view_total + view, region_total + region, n_pairs + 1
    view_total, region_total = view_total / n_pairs, region_total / n_pairs
    loss = 0.5 * view_total + 0.5 * region_total if use_region_loss else view_total
    return loss, view_total, region_total, matches


def random_case(batch=2, out_dim=11, dim=6, n_local=3, global_grid=7, local_grid=3, seed=0):
    """Per-crop inputs (2 global crops at global_grid^2 tokens, n_local crops at local_grid^2) and the
    same values in the model's layout (`esvit.Outputs`)."""
    g = torch.Generator().manual_seed(seed)
    ncrops, tg, tl = 2 + n_local, global_grid ** 2, local_grid ** 2
    per_crop_tokens = [tg] * 2 + [tl] * n_local
    s_view = torch.randn(ncrops * batch, out_dim, generator=g)
    s_region = [torch.randn(batch, t, out_dim, generator=g) * 2 for t in per_crop_tokens]
    s_tokens = [torch.randn(batch, t, dim, generator=g) for t in per_crop_tokens]
    t_view = torch.randn(2 * batch, out_dim, generator=g)
    t_region = [torch.randn(batch, tg, out_dim, generator=g) * 2 for _ in range(2)]
    t_tokens = [torch.randn(batch, tg, dim, generator=g) for _ in range(2)]
    groups = [(0, 2), (2, ncrops)] if n_local else [(0, 2)]          # resolution groups of crops
    student = esvit.Outputs(s_view, [torch.cat(s_region[s:e]) for s, e in groups],
                            [torch.cat(s_tokens[s:e]) for s, e in groups],
                            [(global_grid, global_grid), (local_grid, local_grid)][:len(groups)])
    teacher = esvit.Outputs(t_view, [torch.cat(t_region)], [torch.cat(t_tokens)], [(global_grid, global_grid)])
    return (s_view, s_region, s_tokens, t_view, t_region, t_tokens), student, teacher


@pytest.mark.parametrize("epoch,batch,n_local", [(0, 2, 3), (12, 3, 4), (45, 1, 2)])
def test_loss_matches_naive_loop(epoch, batch, n_local):
    per_crop, student, teacher = random_case(batch=batch, n_local=n_local, seed=epoch)
    loss_fn = esvit.EsViTLoss(11, 2 + n_local, 0.04, 0.07, 30, 100)
    loss_fn.center.normal_()
    loss_fn.center_grid.normal_()
    center, center_grid = loss_fn.center.clone(), loss_fn.center_grid.clone()
    temp = loss_fn.teacher_temp_schedule[epoch]
    expected, view, region, _ = naive_esvit_loss(*per_crop, center, center_grid, temp)
    out = loss_fn(student, teacher, epoch)
    torch.testing.assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["view_loss"], view, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["region_loss"], region, rtol=1e-5, atol=1e-6)
    # both centres move after the loss, from the raw teacher outputs of both global crops
    torch.testing.assert_close(loss_fn.center, 0.9 * center + 0.1 * teacher.view.mean(0, keepdim=True))
    all_tokens = torch.cat(per_crop[4]).flatten(0, 1)
    torch.testing.assert_close(loss_fn.center_grid, 0.9 * center_grid + 0.1 * all_tokens.mean(0, keepdim=True))


def test_matching_uses_backbone_tokens_not_head_outputs():
    """Student tokens are a known permutation of the teacher's tokens; the region logits point to
    other teacher tokens. The loss must follow the backbone tokens."""
    per_crop, student, teacher = random_case(batch=2, n_local=0, seed=3)
    s_view, s_region, s_tokens, t_view, t_region, t_tokens = per_crop
    perm = torch.randperm(49, generator=torch.Generator().manual_seed(1))
    s_tokens = [t_tokens[1 - c][:, perm] * 2.5 for c in range(2)]    # scaled: cosine, not dot product
    s_region = [t_region[1 - c][:, torch.roll(perm, 1)] for c in range(2)]
    student = esvit.Outputs(s_view, [torch.cat(s_region)], [torch.cat(s_tokens)], [(7, 7)])
    matches = esvit.EsViTLoss.match_similarity(torch.stack(s_tokens), torch.stack(t_tokens))
    assert torch.equal(matches[0, 1], perm.expand(2, -1)) and torch.equal(matches[1, 0], perm.expand(2, -1))
    loss_fn = esvit.EsViTLoss(11, 2, 0.04, 0.07, 30, 100)
    got = loss_fn(student, teacher, 5)["loss"]
    expected = naive_esvit_loss(s_view, s_region, s_tokens, t_view, t_region, t_tokens,
                                torch.zeros(1, 11), torch.zeros(1, 11), loss_fn.teacher_temp_schedule[5])[0]
    by_heads = naive_esvit_loss(s_view, s_region, s_region, t_view, t_region, t_region,
                                torch.zeros(1, 11), torch.zeros(1, 11), loss_fn.teacher_temp_schedule[5])[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert abs(got.item() - by_heads.item()) > 1e-2


def test_gradients_reach_student_logits_only():
    _, student, teacher = random_case(seed=5)
    student = esvit.Outputs(student.view.requires_grad_(), [r.requires_grad_() for r in student.region],
                            [t.requires_grad_() for t in student.tokens], student.grids)
    teacher = esvit.Outputs(teacher.view.requires_grad_(), [r.requires_grad_() for r in teacher.region],
                            [t.requires_grad_() for t in teacher.tokens], teacher.grids)
    esvit.EsViTLoss(11, 5, 0.04, 0.07, 30, 100)(student, teacher, 0)["loss"].backward()
    assert student.view.grad.abs().sum() > 0
    assert all(r.grad.abs().sum(-1).gt(0).all() for r in student.region)   # every token of every crop
    assert all(t.grad is None for t in student.tokens)                      # the matching is not differentiated
    assert teacher.view.grad is None and teacher.region[0].grad is None and teacher.tokens[0].grad is None


@pytest.mark.parametrize("case", REFERENCE["ddino_cases"], ids=lambda c: f"epoch{c['epoch']}")
def test_loss_matches_authors_code(case):
    inp, meta = REFERENCE["inputs"], REFERENCE["meta"]
    student, teacher = reference_outputs(inp)
    loss_fn = esvit.EsViTLoss(48, 5, **meta["schedule"])
    loss_fn.center.copy_(inp["center_init"])
    loss_fn.center_grid.copy_(inp["center_grid_init"])
    out = loss_fn(student, teacher, case["epoch"])
    torch.testing.assert_close(out["loss"], case["expected_loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_fn.center, case["expected_center"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_fn.center_grid, case["expected_center_grid"], rtol=1e-5, atol=1e-5)
    t_tokens = teacher.tokens[0].unflatten(0, (2, 2))
    matches = [esvit.EsViTLoss.match_similarity(t.unflatten(0, (-1, 2)), t_tokens) for t in student.tokens]
    for (iq, v), expected in zip(meta["pairs_iq_v"], case["matched_teacher_idx"]):
        got = matches[0][iq, v] if v < 2 else matches[1][iq, v - 2]
        assert torch.equal(got, expected), (iq, v)


def reference_outputs(inp, batch=2):
    """The authors' row layout (crop-major, then sample, then token) as `esvit.Outputs`."""
    n_global = 2 * batch * 49
    split = lambda rows: [rows[:n_global].view(2 * batch, 49, -1), rows[n_global:].view(3 * batch, 9, -1)]  # noqa: E731
    student = esvit.Outputs(inp["s_cls"], split(inp["s_region"]), split(inp["s_fea"]), [(7, 7), (3, 3)])
    teacher = esvit.Outputs(inp["t_cls"], [inp["t_region"].view(2 * batch, 49, -1)],
                            [inp["t_fea"].view(2 * batch, 49, -1)], [(7, 7)])
    return student, teacher


@pytest.mark.parametrize("case", REFERENCE["view_only_cases"], ids=lambda c: f"epoch{c['epoch']}")
def test_view_only_equals_dino_and_authors_code(case):
    inp, meta = REFERENCE["inputs"], REFERENCE["meta"]
    student, teacher = reference_outputs(inp)
    loss_fn = esvit.EsViTLoss(48, 5, **meta["schedule"], use_region_loss=False)
    loss_fn.center.copy_(inp["center_init"])
    loss_fn.center_grid.copy_(inp["center_grid_init"])
    out = loss_fn(student, teacher, case["epoch"])
    dino_fn = dino.DINOLoss(48, 5, **meta["schedule"])
    dino_fn.center.copy_(inp["center_init"])
    torch.testing.assert_close(out["loss"], dino_fn(inp["s_cls"], inp["t_cls"], case["epoch"])["loss"])
    torch.testing.assert_close(out["loss"], case["expected_loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_fn.center, dino_fn.center)
    torch.testing.assert_close(loss_fn.center, case["expected_center"], rtol=1e-5, atol=1e-5)
    assert torch.equal(loss_fn.center_grid, inp["center_grid_init"]) and "region_loss" not in out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_centers(rank, world_size, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _, student, teacher = random_case(batch=2, seed=10 + rank)   # other rows in each process
        loss_fn = esvit.EsViTLoss(11, 5, 0.04, 0.07, 30, 100)
        loss_fn.center.fill_(0.5)
        loss_fn.center_grid.fill_(-0.5)
        loss_fn(student, teacher, 0)
        queue.put((rank, loss_fn.center.tolist(), loss_fn.center_grid.tolist()))
    finally:
        torch.distributed.destroy_process_group()


def test_centers_are_averaged_over_two_gloo_processes():
    """Each centre becomes 0.9 c + 0.1 * the mean over the rows of *all* processes."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_centers, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    teachers = [random_case(batch=2, seed=10 + r)[2] for r in range(2)]
    view_rows = torch.cat([t.view for t in teachers])
    region_rows = torch.cat([t.region[0].flatten(0, 1) for t in teachers])
    for _, center, center_grid in results:
        torch.testing.assert_close(torch.tensor(center), 0.9 * 0.5 + 0.1 * view_rows.mean(0, keepdim=True))
        torch.testing.assert_close(torch.tensor(center_grid), 0.9 * -0.5 + 0.1 * region_rows.mean(0, keepdim=True))


@pytest.mark.parametrize("arch,sizes,grids", [("swin_pico", (64, 32), [(2, 2), (1, 1)]),
                                              ("vit_pico", (32, 16), [(2, 2), (1, 1)])])
def test_model_outputs(arch, sizes, grids):
    """View head on the global feature (Swin: mean token, ViT: CLS), region head on every final-norm
    token, crop-major rows, one entry per resolution group."""
    torch.manual_seed(0)
    backbone = common.build_backbone(arch)
    heads = [common.DINOHead(backbone.num_features, 13, hidden_dim=32, bottleneck_dim=8) for _ in range(2)]
    model = esvit.EsViT(backbone, *heads).eval()
    crops = [torch.randn(3, 3, sizes[0], sizes[0]) for _ in range(2)] + [torch.randn(3, 3, sizes[1], sizes[1])] * 2
    with torch.no_grad():
        out = model(crops)
        per_crop = [backbone.forward_dense(c) for c in crops]
    assert out.grids == grids and out.view.shape == (12, 13)
    torch.testing.assert_close(out.view, heads[0](torch.cat([g for g, _ in per_crop])), rtol=1e-4, atol=1e-5)
    for group, (s, e) in enumerate([(0, 2), (2, 4)]):
        tokens = torch.cat([grid.flatten(1, 2) for _, grid in per_crop[s:e]])
        torch.testing.assert_close(out.tokens[group], tokens, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.region[group], heads[1](tokens), rtol=1e-4, atol=1e-5)
    if arch == "swin_pico":
        torch.testing.assert_close(per_crop[0][0], per_crop[0][1].mean(dim=(1, 2)))


# ------------------------------------------------------------------------------------------------
# Real runs: a 2-step run (subprocess) and its resume (esvit.py's entry point in process); view-only
# then continual pre-training (in process)
# ------------------------------------------------------------------------------------------------
TINY = ["--arch", "swin_pico", "--dataset", "synthetic", "--synthetic_images", "16", "--synthetic_image_size", "64",
        "--global_crop_size", "64", "--local_crop_size", "32", "--local_crops_number", "2", "--out_dim", "64",
        "--batch_size_per_gpu", "8", "--num_workers", "0", "--warmup_epochs", "0", "--max_steps_per_epoch", "2",
        "--device", "cpu",
        "--precision", "fp32"]  # not auto: runs are compared to the digit, on every CPU


def run_esvit(*extra):
    return subprocess.run([sys.executable, "esvit.py", *TINY, *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def read_log(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "log.txt").read_text().splitlines()]


def test_two_step_run_then_resume(tmp_path):
    first = run_esvit("--epochs", "1", "--output_dir", str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["method"] == "esvit"
    assert set(ckpt) >= {"student", "teacher", "optimizer", "scaler", "esvit_loss", "args", "rng"}
    assert ckpt["esvit_loss"]["center"].abs().sum() > 0 and ckpt["esvit_loss"]["center_grid"].abs().sum() > 0
    assert any(k.startswith("region_head.") for k in ckpt["teacher"])
    common.load_state_dict_strict(common.build_backbone("swin_pico", img_size=64),   # timm key names, 64 px run
                                  torch.load(tmp_path / "teacher_backbone.pth", weights_only=True))

    second = run_here("esvit.py", *TINY, "--epochs", "2", "--output_dir", str(tmp_path))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout
    log = read_log(tmp_path)
    assert [r["epoch"] for r in log] == [0, 1]
    for key in ("loss", "view_loss", "region_loss", "center_norm", "center_grid_norm", "matched_teacher_tokens"):
        assert all(math.isfinite(r[key]) for r in log), key
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 2


@pytest.fixture
def keep_signal_handlers():
    """main() installs preemption handlers; put pytest's back afterwards. One thread inside, as the
    script's process would have under OMP_NUM_THREADS=1."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with one_thread():
        yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_view_only_run_then_continual_pretraining_with_region_loss(tmp_path, capsys, keep_signal_handlers):
    """Table 2's L_V row (no region head), then --init_from adds L_R: weights, view centre and epoch
    come from the view-only checkpoint, the region head starts fresh. In process (no interpreter start)."""
    parse = esvit.get_args_parser().parse_args
    esvit.main(parse(TINY + ["--epochs", "1", "--use_region_loss", "false", "--output_dir", str(tmp_path / "v")]))
    view_only = torch.load(tmp_path / "v/checkpoint.pth", weights_only=True)
    assert not any(k.startswith("region_head.") for k in view_only["student"])
    assert "region_loss" not in read_log(tmp_path / "v")[0]

    args = parse(TINY + ["--epochs", "2", "--output_dir", str(tmp_path / "f"), "--init_from", str(tmp_path / "v/checkpoint.pth")])
    student, teacher = esvit.build_model(args, 0.0), esvit.build_model(args, 0.0)
    teacher.load_state_dict(student.state_dict())
    fresh_region_head = {k: v.clone() for k, v in student.state_dict().items() if k.startswith("region_head.")}
    criterion = esvit.EsViTLoss(64, 4, 0.04, 0.07, 30, 2)
    assert esvit.init_from_view_only(args.init_from, student, teacher, criterion, args) == (1, 0)
    for model, name in ((student, "student"), (teacher, "teacher")):
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in view_only[name].items())
        assert all(torch.equal(state[k], v) for k, v in fresh_region_head.items())
    assert torch.equal(criterion.center, view_only["esvit_loss"]["center"]) and criterion.center_grid.abs().sum() == 0

    esvit.main(args)
    assert "initialised from" in capsys.readouterr().out
    log = read_log(tmp_path / "f")
    assert [r["epoch"] for r in log] == [1] and math.isfinite(log[0]["region_loss"])   # continues at epoch 1


def test_help_is_grouped():
    out = esvit.get_args_parser().format_help()
    for group in ("backbone:", "EsViT heads and loss:", "optimisation:", "multi-crop augmentation:", "data:", "run:"):
        assert group in out
    assert "--use_region_loss" in out and "--init_from" in out and "Table 8" in out
