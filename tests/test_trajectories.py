"""Whole training steps equal to the authors' code, for all five methods.

Each case in tests/data/*_trajectory.pt was recorded by running the authors' own training loop
(their `train_one_epoch`, loss, parameter groups, optimizer, schedules, clipping, frozen last
layer, EMA and centre updates) for 8 optimizer steps over 4 epochs on fixed tiny inputs;
tests/data/TRAJECTORIES.md says how. Here the project's `train_one_epoch` runs from the same
initial weights on the same inputs, built as each main() builds it (AdamW on
common.get_params_groups, the schedules of main, the method's loss class), and every recorded value
is compared step by step: the loss and its parts, the lr and weight decay of both parameter
groups, the teacher momentum and temperature, the centre(s) before and after each loss, which
gradients the frozen last layer dropped, tracked student and teacher tensors after every step, and
the whole student at the end (DRLoc: the loss parts, lambda, the sampled pairs, the gradient norm
and the model's tensors).

The settings make every schedule move: a 2-epoch linear lr warm-up, then a cosine weight decay
0.04 -> 0.4 and momentum 0.9 -> 1 indexed by the global step (2 steps per epoch), a teacher
temperature warm-up over 3 epochs, the last layer frozen in epoch 0, and a per-parameter clip
(0.3) that some tensors hit and others do not.

Tolerance. Both sides compute in float32 but not in the same order (an einsum against a Python
loop over crop pairs, timm's attention against the authors', `weight_g * v / |v|` against
torch's weight_norm), so values differ in their last bits, and AdamW's g / sqrt(v) carries those
differences into the weights at about lr * 1e-3. Measured: losses within 1.7e-6, weights within
2.4e-7 (lr <= 1e-3). The tests allow 2e-5 on losses and centres and 2e-6 on weights. Each single
broken detail (weight decay on biases and norms, no clipping, last layer not frozen, centre updated
before the loss, schedules indexed by epoch) moves the weights by 1e-3 or more and fails (see
TRAJECTORIES.md).
"""
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import dino  # noqa: E402
import esvit  # noqa: E402
import glsd  # noqa: E402
import selfpatch  # noqa: E402
import drloc  # noqa: E402

DATA = ROOT / "tests/data"
LOSS_TOL = dict(rtol=2e-5, atol=2e-5)
WEIGHT_TOL = dict(rtol=0, atol=2e-6)
DEVICE = torch.device("cpu")


def load_case(name):
    return torch.load(DATA / f"{name}_trajectory.pt", weights_only=True)


def exact_attention(model):
    """timm's fused attention sums in another order than the authors' softmax(q k^T) v; the
    unfused path keeps the comparison at the float32 rounding of the weights."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


class Recorder:
    """Collects, per optimizer step, what the project's train_one_epoch did: the loss and centres
    (hooks on the criterion), lr / weight decay / dropped gradients (a hook before optimizer.step),
    the EMA momentum (a wrapper around common.update_teacher), and tracked tensors of student and
    teacher before every step (the loader) and at the end."""

    def __init__(self, student, teacher, criterion, optimizer, tracked, monkeypatch, center_names=("center",),
                 loss_parts=()):
        self.student, self.teacher, self.tracked = student, teacher, tracked
        self.steps, self.snapshots = [], []
        self.center_names, self.loss_parts = center_names, loss_parts
        criterion.register_forward_pre_hook(self.before_loss)
        criterion.register_forward_hook(self.after_loss)
        optimizer.register_step_pre_hook(self.before_optimizer_step)
        update_teacher = common.update_teacher

        def recording_update_teacher(student, teacher, momentum):
            self.steps[-1]["momentum"] = momentum
            update_teacher(student, teacher, momentum)
        monkeypatch.setattr(common, "update_teacher", recording_update_teacher)

    def before_loss(self, module, inputs):
        step = inputs[2]                            # criterion(student, teacher, global step, ...)
        self.steps.append({"step": step, "teacher_temp": float(module.teacher_temp_schedule[step]),
                           **{f"{c}_before": getattr(module, c).clone() for c in self.center_names}})
        if isinstance(inputs[0], torch.Tensor):      # DINO: the head outputs themselves
            self.steps[-1].update(student_output=inputs[0].detach().clone(), teacher_output=inputs[1].detach().clone())

    def after_loss(self, module, inputs, output):
        self.steps[-1].update({k: output[k].item() for k in ("loss", *self.loss_parts)})
        self.steps[-1].update({f"{c}_after": getattr(module, c).clone() for c in self.center_names})

    def before_optimizer_step(self, optimizer, *_):
        regularized, not_regularized = optimizer.param_groups
        self.steps[-1].update(lr=regularized["lr"], lr_group1=not_regularized["lr"],
                              wd=regularized["weight_decay"], wd_group1=not_regularized["weight_decay"],
                              grad_none_last_layer=[p.grad is None for n, p in self.student.named_parameters()
                                                    if "last_layer" in n])

    def snapshot(self):
        s, t = dict(self.student.named_parameters()), dict(self.teacher.named_parameters())
        self.snapshots.append({"student": {k: s[k].detach().clone() for k in self.tracked},
                               "teacher": {k: t[k].detach().clone() for k in self.tracked}})

    def loader(self, batches):
        """One epoch of the fixed batches; the state is recorded before each step."""
        for batch in batches:
            self.snapshot()
            yield batch


def without_key_bias(name, t):
    """A key bias adds the same number to every logit of a query, which the softmax ignores: its
    gradient is zero up to rounding, and AdamW turns that rounding noise (different in any two
    implementations) into steps of +-lr. It is left out (the query and value parts of a qkv bias
    are compared)."""
    if name.endswith("attn.k.bias"):                 # SelfPatch's class attention: a separate key Linear
        return t[..., :0]
    if not name.endswith("qkv.bias"):
        return t
    q, _k, v = t.chunk(3, dim=-1)
    return torch.cat([q, v], dim=-1)


def compare(recorder, case, student, centers=("center",), loss_parts=()):
    """Every recorded value of the authors' run against the project's, step by step."""
    expected, got = case["steps"], recorder.steps
    n = len(expected["loss"])
    assert len(got) == n, f"{len(got)} steps, the authors' loop took {n}"
    for i, step in enumerate(got):
        where = f"step {i} (epoch {expected['epoch'][i]})"
        assert step["step"] == i, f"the loss was given step {step['step']} at {where}"
        for k in ("lr", "lr_group1", "wd", "wd_group1", "momentum", "teacher_temp"):
            assert step[k] == pytest.approx(expected[k][i].item(), rel=1e-12, abs=1e-15), f"{k} at {where}"
        assert step["grad_none_last_layer"] == expected["grad_none_last_layer"][i], f"frozen last layer at {where}"
        for c in centers:
            torch.testing.assert_close(step[f"{c}_before"], expected[f"{c}_before"][i], **LOSS_TOL, msg=f"{c} at {where}")
            torch.testing.assert_close(step[f"{c}_after"], expected[f"{c}_after"][i], **LOSS_TOL, msg=f"{c} at {where}")
        for k in ("loss", *loss_parts):
            assert step[k] == pytest.approx(expected[k][i].item(), rel=LOSS_TOL["rtol"], abs=LOSS_TOL["atol"]), \
                f"{k} at {where}"
        for k in ("student_output", "teacher_output"):
            if k in expected:
                torch.testing.assert_close(step[k], expected[k][i], **LOSS_TOL, msg=f"{k} at {where}")
    for who in ("student", "teacher"):
        for name, values in case["snapshots"][who].items():
            for i, snap in enumerate(recorder.snapshots):
                torch.testing.assert_close(without_key_bias(name, snap[who][name]), without_key_bias(name, values[i]),
                                           **WEIGHT_TOL,
                                           msg=f"{who} {name} after {i} steps")
    final = student.state_dict()
    for name, value in case["final_student"].items():
        torch.testing.assert_close(without_key_bias(name, final[name]), without_key_bias(name, value), **WEIGHT_TOL,
                                   msg=f"final student {name}")


def schedules_like_main(args, n_steps):
    """The three per-iteration schedules exactly as each method's main() builds them."""
    total_batch = args.batch_size_per_gpu * common.get_world_size()
    return {
        "lr": common.cosine_scheduler(args.lr * total_batch / 256, args.min_lr, args.epochs, n_steps, args.warmup_epochs),
        "wd": common.cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, n_steps),
        "momentum": common.cosine_scheduler(args.momentum_teacher, 1, args.epochs, n_steps),
    }


def train(method, case, student, teacher, criterion, args, monkeypatch, **recorder_options):
    """The project's own loop over all epochs of the case, as main() runs it (AdamW on
    common.get_params_groups, the schedules of main, a grad scaler), on the case's fixed batches."""
    student, teacher = exact_attention(student), exact_attention(teacher)
    common.load_state_dict_strict(student, {k: v.float() for k, v in case["initial_state"].items()})
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    optimizer = torch.optim.AdamW(common.get_params_groups(student))
    scaler = common.make_grad_scaler(DEVICE, args.precision)
    labels = torch.zeros(len(case["batches"][0][0]), dtype=torch.long)
    # per crop: box, flip, image size (none recorded for the methods that do not match by it)
    geometry = case.get("geometry", [[]] * len(case["batches"]))
    enlarge = case["meta"]["settings"].get("upsample", 1)    # crops stored at 1/enlarge resolution
    batches = [(([c.float().repeat_interleave(enlarge, -1).repeat_interleave(enlarge, -2) for c in crops], geo), labels)
               for crops, geo in zip(case["batches"], geometry)]
    schedules = schedules_like_main(args, len(batches))
    recorder = Recorder(student, teacher, criterion, optimizer, list(case["snapshots"]["student"]), monkeypatch,
                        **recorder_options)
    for epoch in range(args.epochs):
        method.train_one_epoch(student, teacher, criterion, recorder.loader(batches), optimizer, scaler, schedules,
                               epoch, 0, args, DEVICE)
    recorder.snapshot()
    return recorder, student


SCHEDULE_FLAGS = ["epochs", "lr", "min_lr", "warmup_epochs", "weight_decay", "weight_decay_end", "momentum_teacher",
                  "warmup_teacher_temp", "teacher_temp", "warmup_teacher_temp_epochs", "clip_grad", "freeze_last_layer",
                  "out_dim", "norm_last_layer", "local_crops_number"]


def parse_args(method, settings, names, *extra):
    s = settings
    return method.get_args_parser().parse_args(
        settings_flags(s, names)
        + ["--batch_size_per_gpu", str(s["batch"]), "--head_hidden_dim", str(s["hidden_dim"]),
           "--head_bottleneck_dim", str(s["bottleneck_dim"]), "--global_crop_size", str(s["global_size"]),
           "--local_crop_size", str(s["local_size"]), "--drop_path_rate", "0", "--device", "cpu", *extra])


def settings_flags(settings, names):
    flags = []
    for name in names:
        value = settings[name]
        flags += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


# ================================================================================================
# DINO (facebookresearch/dino main_dino.train_one_epoch)
# ================================================================================================
def run_dino(case, tmp_path, monkeypatch):
    s = case["meta"]["settings"]
    args = parse_args(dino, s, SCHEDULE_FLAGS + ["patch_size"], "--output_dir", str(tmp_path))

    def build_model():  # dino.build_model with a ViT smaller than vit_pico (keeps the case file small)
        backbone = common.build_backbone("vit_pico", args.patch_size, img_size=args.global_crop_size,
                                         embed_dim=s["embed_dim"], depth=s["depth"], num_heads=s["num_heads"])
        head = common.DINOHead(backbone.num_features, args.out_dim, norm_last_layer=args.norm_last_layer,
                               hidden_dim=args.head_hidden_dim, bottleneck_dim=args.head_bottleneck_dim)
        return dino.DINO(backbone, head)

    criterion = dino.DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                              args.warmup_teacher_temp_epochs, args.epochs, niter_per_ep=len(case["batches"]))
    return train(dino, case, build_model(), build_model(), criterion, args, monkeypatch)


def test_dino_trajectory_equals_authors_code(tmp_path, monkeypatch):
    case = load_case("dino")
    recorder, student = run_dino(case, tmp_path, monkeypatch)
    compare(recorder, case, student)


# ================================================================================================
# EsViT, view + region loss (microsoft/esvit main_esvit.train_one_epoch with DDINOLoss)
# ================================================================================================
def run_esvit(case, tmp_path, monkeypatch):
    s = case["meta"]["settings"]
    args = parse_args(esvit, s, SCHEDULE_FLAGS + ["window_size"], "--output_dir", str(tmp_path))

    def build_model():  # esvit.build_model with a Swin smaller than swin_pico (keeps the case file small)
        backbone = common.build_backbone("swin_pico", window_size=args.window_size, img_size=args.global_crop_size,
                                         embed_dim=s["embed_dim"], depths=s["depths"], num_heads=s["num_heads"])
        heads = [common.DINOHead(backbone.num_features, args.out_dim, norm_last_layer=args.norm_last_layer,
                                 hidden_dim=args.head_hidden_dim, bottleneck_dim=args.head_bottleneck_dim)
                 for _ in range(1 + args.use_region_loss)]
        return esvit.EsViT(backbone, *heads)

    criterion = esvit.EsViTLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                                args.warmup_teacher_temp_epochs, args.epochs, args.use_region_loss,
                                niter_per_ep=len(case["batches"]))
    return train(esvit, case, build_model(), build_model(), criterion, args, monkeypatch,
                 center_names=("center", "center_grid"), loss_parts=("view_loss", "region_loss"))


def test_esvit_trajectory_equals_authors_code(tmp_path, monkeypatch):
    """Swin crops of 32 and 16 px with window 2: every token map is a multiple of the window, so
    the documented 96-px padding difference (pad before or after the shift) does not arise."""
    case = load_case("esvit")
    recorder, student = run_esvit(case, tmp_path, monkeypatch)
    compare(recorder, case, student, centers=("center", "center_grid"), loss_parts=("view_loss", "region_loss"))


# ================================================================================================
# GLSD, geometric matching (tileb1/global-local-self-distillation train_one_epoch with DDINOLoss,
# dense_matching_type="distance", hinge_bool=True)
# ================================================================================================
def run_glsd(case, tmp_path, monkeypatch):
    s = case["meta"]["settings"]
    args = parse_args(glsd, s, SCHEDULE_FLAGS + ["window_size"], "--local_matching", "geometric",
                      "--match_threshold", "true", "--output_dir", str(tmp_path))

    def build_model():  # glsd.build_model with a Swin smaller than swin_pico (keeps the case file small)
        backbone = common.build_backbone("swin_pico", window_size=args.window_size, img_size=args.global_crop_size,
                                         embed_dim=s["embed_dim"], depths=s["depths"], num_heads=s["num_heads"])
        heads = [common.DINOHead(backbone.num_features, args.out_dim, norm_last_layer=args.norm_last_layer,
                                 hidden_dim=args.head_hidden_dim, bottleneck_dim=args.head_bottleneck_dim)
                 for _ in range(1 + (args.local_matching != "none"))]
        return glsd.GLSD(backbone, *heads)

    criterion = glsd.GLSDLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                              args.warmup_teacher_temp_epochs, args.epochs, args.local_matching, args.match_threshold,
                              niter_per_ep=len(case["batches"]))
    return train(glsd, case, build_model(), build_model(), criterion, args, monkeypatch,
                 center_names=("center", "center_grid"), loss_parts=("view_loss", "region_loss", "kept_fraction"))


def test_glsd_geometric_trajectory_equals_authors_code(tmp_path, monkeypatch):
    """The authors pool per-pixel position maps over each token; here token centres come from the
    crop box (the documented difference). The case feeds the authors' loss maps that are exactly
    linear in the box, so both sides see the same centres and the same matches; the threshold
    drops some pairs (kept fraction < 1), so the hinge is exercised."""
    case = load_case("glsd")
    recorder, student = run_glsd(case, tmp_path, monkeypatch)
    compare(recorder, case, student, centers=("center", "center_grid"), loss_parts=("view_loss", "region_loss"))
    kept = [step["kept_fraction"] for step in recorder.steps]
    assert 0 < min(kept) and max(kept) < 1, kept


# ================================================================================================
# SelfPatch (alinlab/SelfPatch main_selfpatch.train_one_epoch with its combined DINOLoss)
# ================================================================================================
def run_selfpatch(case, tmp_path, monkeypatch):
    s = case["meta"]["settings"]
    args = parse_args(selfpatch, s, SCHEDULE_FLAGS + ["patch_size", "patch_out_dim", "k_num"],
                      "--neighbors_wrap", "true", "--output_dir", str(tmp_path))

    def build_model():  # selfpatch.build_model with a ViT smaller than vit_pico (keeps the case file small)
        backbone = common.build_backbone("vit_pico", args.patch_size, img_size=args.global_crop_size,
                                         class_token=False, final_norm=False,
                                         embed_dim=s["embed_dim"], depth=s["depth"], num_heads=s["num_heads"])
        heads = [common.DINOHead(backbone.num_features, out_dim, norm_last_layer=args.norm_last_layer,
                                 hidden_dim=args.head_hidden_dim, bottleneck_dim=args.head_bottleneck_dim)
                 for out_dim in (args.out_dim, args.patch_out_dim)]
        ca_head = selfpatch.AggregationModule(backbone.num_features, backbone.blocks[0].attn.num_heads)
        return selfpatch.SelfPatch(backbone, ca_head, *heads, args.k_num, args.neighbors_wrap)

    criterion = selfpatch.SelfPatchLoss(args.out_dim, args.patch_out_dim, args.local_crops_number + 2,
                                        args.warmup_teacher_temp, args.teacher_temp, args.warmup_teacher_temp_epochs,
                                        args.epochs, args.patch_loss_weight, niter_per_ep=len(case["batches"]))
    return train(selfpatch, case, build_model(), build_model(), criterion, args, monkeypatch,
                 center_names=("center", "patch_center"), loss_parts=("cls_loss", "patch_loss"))


def test_selfpatch_trajectory_equals_authors_code(tmp_path, monkeypatch):
    """14 x 14 and 6 x 6 patch grids (112 and 48 px, patch 8): the only grids the authors' code accepts."""
    case = load_case("selfpatch")
    recorder, student = run_selfpatch(case, tmp_path, monkeypatch)
    compare(recorder, case, student, centers=("center", "patch_center"), loss_parts=("cls_loss", "patch_loss"))


# ================================================================================================
# DRLoc with its supervised loss (yhlleo/VTs-Drloc main.train_one_epoch, Swin, l1 mode, |Delta| targets)
# ================================================================================================
def hashed_uniform(shape, name):
    """Values in [-1, 1) from an integer hash of (name, element index): exact integer arithmetic,
    so every machine draws the same numbers without a stored tensor (the DRLoc MLP alone has
    280k weights, too many for the case file)."""
    i = torch.arange(math.prod(shape), dtype=torch.int64) + (zlib.crc32(name.encode()) % 100_003) * 10_000_019
    for _ in range(2):
        i = ((i ^ (i >> 16)) * 0x45D9F3B) % 2**32
    i = i ^ (i >> 16)
    return (i.double() / 2**31 - 1).float().reshape(shape)


def hashed_initial_state(model):
    """The case's initial weights (the generator gave the authors' model the same values under
    their names): biases 0.1 u, norm weights 1 + 0.2 u, position tables 0.5 u, matrices
    u sqrt(3 / fan_in), rounded to float16."""
    state = {}
    for name, t in model.state_dict().items():
        u = hashed_uniform(tuple(t.shape), name)
        if name.endswith("bias"):
            v = 0.1 * u
        elif t.ndim == 1:
            v = 1 + 0.2 * u
        elif "relative_position_bias_table" in name:
            v = 0.5 * u
        else:
            v = u * math.sqrt(3 / math.prod(t.shape[1:]))
        state[name] = v.half().float()
    return state


def run_drloc(case, tmp_path, monkeypatch, lr_schedule=None):
    """drloc.train_one_epoch from the case's weights. `lr_schedule` defaults to the lr the authors'
    run used at each step: their timm scheduler is the documented difference (and it sets a step's
    lr after the previous step, so the warm-up value is used twice); every other piece is the
    project's own."""
    s = case["meta"]["settings"]
    args = drloc.get_args_parser().parse_args(
        settings_flags(s, ["input_size", "window_size", "drloc_pairs", "lambda_drloc", "lambda_warmup_epochs", "epochs",
                           "lr", "warmup_lr", "min_lr", "warmup_epochs", "weight_decay", "clip_grad", "smoothing", "seed"])
        + ["--arch", "swin_pico", "--drloc_mode", "l1", "--drloc_targets", "abs", "--mixup", "0", "--cutmix", "0",
           "--batch_size_per_gpu", str(s["batch"]), "--drop_path_rate", "0", "--device", "cpu",
           "--output_dir", str(tmp_path)])
    backbone = common.build_backbone(args.arch, window_size=args.window_size, img_size=args.input_size,
                                     layer_norm_eps=1e-5, embed_dim=s["embed_dim"], depths=s["depths"],
                                     num_heads=s["num_heads"])       # drloc.build_model's Swin, smaller
    model = exact_attention(drloc.DRLoc(backbone, s["num_classes"], args.drloc_mode, args.drloc_pairs,
                                        heads=[(backbone.num_features, None)]))
    common.load_state_dict_strict(model, hashed_initial_state(model))
    criterion = drloc.DRLocLoss(args.drloc_mode, args.drloc_targets == "signed", args.drloc_normalize, args.smoothing)
    optimizer = torch.optim.AdamW(common.get_params_groups(model, drloc.NO_WEIGHT_DECAY), weight_decay=args.weight_decay)
    scaler = common.make_grad_scaler(DEVICE, args.precision)
    schedules = {"lr": case["steps"]["lr"].tolist() if lr_schedule is None else lr_schedule,
                 "lambda": drloc.lambda_schedule(args.lambda_drloc, args.epochs, args.lambda_warmup_epochs,
                                                 args.lambda_schedule)}

    steps, snapshots = [], []

    def after_loss(module, inputs, output):
        (head,) = inputs[0]["drloc"]
        steps.append({k: output[k].item() for k in ("loss", "L_ce", "L_drloc")}
                     | {"lambda": inputs[2], "targets": drloc.relative_targets(head["pos_a"], head["pos_b"], head["k"])})
    criterion.register_forward_hook(after_loss)
    optimizer.register_step_pre_hook(lambda opt, *_: steps[-1].update(
        lr=opt.param_groups[0]["lr"], lr_group1=opt.param_groups[1]["lr"],
        wd=opt.param_groups[0]["weight_decay"], wd_group1=opt.param_groups[1]["weight_decay"]))
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, max_norm, *rest, **options):
        norm = clip(parameters, max_norm, *rest, **options)
        steps[-1]["grad_norm"] = float(norm)
        return norm
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    tracked = list(case["snapshots"]["model"])

    def loader(batches):
        for batch in batches:
            params = dict(model.named_parameters())
            snapshots.append({k: params[k].detach().clone() for k in tracked})
            yield batch
    batches = [(x.float(), y) for x, y in case["batches"]]
    for epoch in range(args.epochs):
        drloc.train_one_epoch(model, criterion, loader(batches), optimizer, scaler, None, schedules, epoch, 0, args, DEVICE)
    params = dict(model.named_parameters())
    snapshots.append({k: params[k].detach().clone() for k in tracked})
    return steps, snapshots, model, args


def test_drloc_trajectory_equals_authors_code(tmp_path, monkeypatch):
    """Swin (grid 4 x 4), 8 pairs per image, lambda warmed up over 2 of 4 epochs, global-norm clip
    active on some steps only. The pairs: the authors draw them from the global RNG, the project
    from a generator seeded by (seed, epoch, step) (documented); the case seeded the authors' RNG
    with that seed before each step, so both draw the same pairs (checked: equal targets)."""
    case = load_case("drloc")
    steps, snapshots, model, _ = run_drloc(case, tmp_path, monkeypatch)
    expected = case["steps"]
    assert len(steps) == len(expected["loss"])
    for i, step in enumerate(steps):
        where = f"step {i}"
        torch.testing.assert_close(step["targets"], expected["targets"][i], rtol=0, atol=0, msg=f"pairs at {where}")
        for k in ("lambda", "lr", "lr_group1", "wd", "wd_group1"):
            assert step[k] == pytest.approx(expected[k][i].item(), rel=1e-12, abs=1e-15), f"{k} at {where}"
        for k in ("loss", "L_ce", "L_drloc", "grad_norm"):
            assert step[k] == pytest.approx(expected[k][i].item(), rel=LOSS_TOL["rtol"], abs=LOSS_TOL["atol"]), \
                f"{k} at {where}"
    clipped = [n > case["meta"]["settings"]["clip_grad"] for n in expected["grad_norm"].tolist()]
    assert any(clipped) and not all(clipped)             # the clip is active on some steps only
    for name, values in case["snapshots"]["model"].items():
        for i, snap in enumerate(snapshots):
            torch.testing.assert_close(without_key_bias(name, snap[name]), without_key_bias(name, values[i]),
                                       **WEIGHT_TOL, msg=f"{name} after {i} steps")
    final = model.state_dict()
    for name, value in case["final_model"].items():        # matrices of the 512-wide MLP: their first 4 rows
        torch.testing.assert_close(without_key_bias(name, final[name][:len(value)]), without_key_bias(name, value),
                                   **WEIGHT_TOL, msg=f"final {name}")


def test_drloc_authors_lr_is_timms_cosine_one_step_late():
    """What the trajectory test replaces: the authors' lr at step s is timm's CosineLRScheduler
    value at s - 1 (their loop calls step_update(s) *after* step s, so the warm-up start is used
    twice), a cosine over *all* iterations, warm-up included (documented in drloc.py). main()'s
    common.cosine_scheduler starts from the same warm-up value and differs afterwards."""
    case = load_case("drloc")
    s = case["meta"]["settings"]
    scale = s["batch"] / 512
    total, warmup = s["epochs"] * s["steps_per_epoch"], s["warmup_epochs"] * s["steps_per_epoch"]
    base, start, final = s["lr"] * scale, s["warmup_lr"] * scale, s["min_lr"] * scale

    def timm_cosine(t):
        if t < warmup:
            return start + t * (base - start) / warmup
        return final + 0.5 * (base - final) * (1 + math.cos(math.pi * t / total))
    authors = [timm_cosine(max(step - 1, 0)) for step in range(total)]
    assert case["steps"]["lr"].tolist() == pytest.approx(authors, rel=1e-12)
    ours = common.cosine_scheduler(base, final, s["epochs"], s["steps_per_epoch"], s["warmup_epochs"], start)
    assert ours[0] == pytest.approx(authors[0]) and ours.tolist() != pytest.approx(authors)
