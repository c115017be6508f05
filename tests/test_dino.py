"""DINO: the loss against a naive statement of Eq. 3 and the authors' numbers, the center, the
training step's wiring (teacher inputs, frozen last layer), and a real run with resume (through
dino.py's entry point in this process; tests/test_preemption_and_resume.py runs it as a
process)."""
import json
import math
import os
import socket
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
from conftest import run_here  # noqa: E402

# Inputs and outputs of the authors' main_dino.DINOLoss (facebookresearch/dino @ 7c446df5).
REFERENCE = torch.load(ROOT / "tests/data/dino_loss_reference.pt", weights_only=True)


def naive_dino_loss(student, teacher, center, teacher_temp, ncrops, student_temp=0.1):
    """Eq. 3 one term at a time: teacher global crop iq, student crop v != iq, sample b."""
    batch = len(teacher) // 2
    total, n_pairs = 0.0, 0
    for iq in range(2):
        for v in range(ncrops):
            if v == iq:
                continue
            for b in range(batch):
                q = F.softmax((teacher[iq * batch + b] - center[0]) / teacher_temp, dim=-1)
                log_p = F.log_softmax(student[v * batch + b] / student_temp, dim=-1)
                total = total + (-(q * log_p).sum()) / batch
            n_pairs += 1
    return total / n_pairs


@pytest.mark.parametrize("ncrops,batch,epoch,warmup", [(2, 3, 0, 0), (4, 2, 3, 10), (10, 4, 12, 10), (6, 1, 50, 30)])
def test_loss_matches_naive_loop(ncrops, batch, epoch, warmup):
    torch.manual_seed(ncrops * 100 + epoch)
    out_dim = 17
    loss_fn = dino.DINOLoss(out_dim, ncrops, 0.04, 0.07, warmup, 60)
    loss_fn.center.normal_()
    center = loss_fn.center.clone()
    student = torch.randn(ncrops * batch, out_dim) * 3
    teacher = torch.randn(2 * batch, out_dim) * 3
    temp = loss_fn.teacher_temp_schedule[epoch]
    if warmup > epoch:  # inside the temperature warmup
        assert 0.04 <= temp < 0.07
    expected = naive_dino_loss(student, teacher, center, temp, ncrops)
    got = loss_fn(student, teacher, epoch)["loss"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", REFERENCE["dino_loss"], ids=lambda c: c["name"])
def test_loss_matches_authors_code(case):
    loss_fn = dino.DINOLoss(case["out_dim"], case["ncrops"], case["warmup_teacher_temp"], case["teacher_temp"],
                            case["warmup_teacher_temp_epochs"], case["nepochs"])
    loss_fn.center.copy_(case["center_init"])
    student = case["student_output"].clone().requires_grad_(True)
    loss = loss_fn(student, case["teacher_output"].clone(), case["epoch"])["loss"]
    loss.backward()
    assert abs(loss.item() - case["expected_loss"]) < 1e-5 * max(1.0, abs(case["expected_loss"]))
    torch.testing.assert_close(loss_fn.center, case["expected_center"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(student.grad, case["expected_grad_student_output"], rtol=1e-4, atol=1e-6)


def test_center_sequence_matches_authors_code():
    """The loss of call i uses the center left by call i-1; the center moves after the loss."""
    seq = REFERENCE["sequence"]
    loss_fn = dino.DINOLoss(24, 5, 0.04, 0.07, 4, 8)
    for epoch, s, t, loss, center in zip(seq["epochs"], seq["student_outputs"], seq["teacher_outputs"],
                                         seq["expected_losses"], seq["expected_centers"]):
        assert loss_fn(s, t, epoch)["loss"].item() == pytest.approx(loss, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(loss_fn.center, center, rtol=1e-5, atol=1e-6)


def test_gradient_reaches_student_only_and_center_after_loss():
    loss_fn = dino.DINOLoss(8, 4, 0.04, 0.04, 0, 10)
    student = torch.randn(8, 8, requires_grad=True)
    teacher = torch.randn(4, 8, requires_grad=True)
    center_before = loss_fn.center.clone()
    loss = loss_fn(student, teacher, 0)["loss"]
    loss.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None                       # stop-gradient on the teacher
    assert not loss_fn.center.requires_grad
    # the center used by this loss was the old one (zero); then it moved by 0.1 * batch mean
    torch.testing.assert_close(loss_fn.center, 0.9 * center_before + 0.1 * teacher.detach().mean(0, keepdim=True))
    expected = naive_dino_loss(student.detach(), teacher.detach(), center_before, 0.04, 4)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_center(rank, world_size, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        ws2 = REFERENCE["world_size2"]
        loss_fn = dino.DINOLoss(40, 6, 0.04, 0.07, 30, 100)
        loss_fn.center.copy_(ws2["center_init"])
        loss = loss_fn(ws2["student_output"][rank], ws2["teacher_output"][rank], ws2["epoch"])["loss"]
        queue.put((rank, loss.item(), loss_fn.center.tolist()))  # plain data through the queue
    finally:
        torch.distributed.destroy_process_group()


def test_center_is_averaged_over_two_gloo_processes():
    """Each process's loss uses its own rows; the center is the mean over all processes' rows
    (equal to the single-process mean of the concatenated batch, and to the authors' value)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_center, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    ws2 = REFERENCE["world_size2"]
    single = dino.DINOLoss(40, 6, 0.04, 0.07, 30, 100)
    single.center.copy_(ws2["center_init"])
    single.update_center(torch.cat(ws2["teacher_output"]))
    for rank, loss, center in results:
        center = torch.tensor(center)
        assert loss == pytest.approx(ws2["expected_loss_per_rank"][rank], rel=1e-5)
        torch.testing.assert_close(center, ws2["expected_center"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(center, single.center, rtol=1e-6, atol=1e-7)


TINY = ["--arch", "vit_pico", "--dataset", "synthetic", "--synthetic_images", "32", "--synthetic_image_size", "32",
        "--global_crop_size", "32", "--local_crop_size", "16", "--local_crops_number", "2", "--out_dim", "64",
        "--batch_size_per_gpu", "8", "--num_workers", "0", "--warmup_epochs", "0", "--device", "cpu",
        "--precision", "fp32"]  # not auto: runs are compared to the digit, on every CPU


def test_teacher_sees_global_crops_only_and_last_layer_frozen_in_epoch0(tmp_path):
    args = dino.get_args_parser().parse_args(TINY + ["--epochs", "2", "--output_dir", str(tmp_path),
                                                     "--max_steps_per_epoch", "1", "--lr", "0.01"])
    device = torch.device("cpu")
    student, teacher = dino.build_model(args, 0.0), dino.build_model(args, 0.0)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    seen = []
    teacher.backbone.register_forward_pre_hook(lambda m, inp: seen.append(tuple(inp[0].shape)))
    dataset = common.SeededDataset(common.build_dataset(args), common.MultiCropAugmentation(
        args.global_crops_scale, args.local_crops_scale, 2, 32, 16))
    loader, _ = common.make_loader(dataset, 8, 0)
    criterion = dino.DINOLoss(64, 4, 0.04, 0.04, 0, 2)
    optimizer = torch.optim.AdamW(common.get_params_groups(student))
    schedules = {"lr": [0.01] * 2, "wd": [0.04] * 2, "momentum": [0.996] * 2}
    before = {k: v.clone() for k, v in student.state_dict().items()}
    dino.train_one_epoch(student, teacher, criterion, loader, optimizer, common.make_grad_scaler(device, "fp32"),
                         schedules, 0, 0, args, device)
    assert seen == [(16, 3, 32, 32)]                           # 2 global crops x batch 8, one call
    after = student.state_dict()
    assert torch.equal(before["head.last_layer.weight_v"], after["head.last_layer.weight_v"])
    assert not torch.equal(before["head.mlp.0.weight"], after["head.mlp.0.weight"])
    assert not torch.equal(before["backbone.blocks.0.attn.qkv.weight"], after["backbone.blocks.0.attn.qkv.weight"])
    dino.train_one_epoch(student, teacher, criterion, loader, optimizer, common.make_grad_scaler(device, "fp32"),
                         schedules, 1, 0, args, device)
    assert not torch.equal(before["head.last_layer.weight_v"], student.state_dict()["head.last_layer.weight_v"])


def run_dino(*extra):
    return run_here("dino.py", *TINY, *extra)


def test_teacher_temperature_warms_up_within_one_epoch(tmp_path):
    """--warmup_teacher_temp_epochs 0.5 of a 4-step epoch ramps over 2 steps (0.02, then 0.06 from
    step 1 on): the epoch's mean temperature is 0.05. An epoch-indexed temperature would give 0.02."""
    run = run_dino("--epochs", "1", "--max_steps_per_epoch", "4", "--warmup_teacher_temp", "0.02",
                   "--teacher_temp", "0.06", "--warmup_teacher_temp_epochs", "0.5", "--output_dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "log.txt").read_text().splitlines()[-1])
    assert record["teacher_temp"] == pytest.approx(0.05, abs=1e-12)


def test_two_step_run_then_resume(tmp_path):
    first = run_dino("--epochs", "1", "--max_steps_per_epoch", "2", "--output_dir", str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["method"] == "dino"
    assert set(ckpt) >= {"student", "teacher", "optimizer", "scaler", "dino_loss", "args", "rng"}
    assert ckpt["dino_loss"]["center"].abs().sum() > 0
    backbone = torch.load(tmp_path / "teacher_backbone.pth", weights_only=True)
    assert "cls_token" in backbone and "blocks.0.attn.qkv.weight" in backbone   # timm key names
    model = common.build_backbone("vit_pico", img_size=32)      # built for the run's 32 px global crop
    common.load_state_dict_strict(model, backbone)

    second = run_dino("--epochs", "2", "--max_steps_per_epoch", "2", "--output_dir", str(tmp_path))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout
    log = [json.loads(line) for line in (tmp_path / "log.txt").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1]
    assert all(math.isfinite(r["loss"]) for r in log)
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 2


def test_default_precision_is_chosen_logged_and_recorded(tmp_path):
    """`--precision auto` (the default) trains in bf16 on a CPU with native bf16 and in fp32 on any
    other; one line says which and why; args.json records it and that auto chose."""
    result = run_dino("--epochs", "1", "--max_steps_per_epoch", "1", "--output_dir", str(tmp_path),
                      "--precision", "auto")
    assert result.returncode == 0, result.stderr[-2000:]
    expected = common.choose_precision(torch.device("cpu"))[0]
    why = "has native bf16" if expected == "bf16" else "no native bf16"
    (line,) = [x for x in result.stdout.splitlines() if x.startswith(f"precision: {expected} (--precision auto: ")]
    assert why in line and "warning" not in result.stdout
    recorded = json.loads((tmp_path / "args.json").read_text())
    assert (recorded["precision"], recorded["precision_auto"]) == (expected, True)


def test_nonfinite_loss_stops_with_advice(tmp_path):
    result = run_dino("--epochs", "1", "--max_steps_per_epoch", "2", "--output_dir", str(tmp_path), "--lr", "1e30",
                      "--clip_grad", "0", "--warmup_epochs", "0", "--optimizer", "sgd")
    assert result.returncode != 0
    assert "--precision fp32" in result.stdout + result.stderr
    assert (tmp_path / "checkpoint_nonfinite.pth").exists()


def test_help_is_grouped():
    result = run_dino("--help")
    assert result.returncode == 0
    out = result.stdout
    for group in ("backbone:", "DINO head and loss:", "optimisation:", "multi-crop augmentation:", "data:", "run:"):
        assert group in out
    assert "0.9995" in out   # the paper's advice for small batches
