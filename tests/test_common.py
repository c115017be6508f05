"""Tests of the shared infrastructure in common.py: backbones, the DINO head, multi-crop augmentation
and its geometry, per-sample seeding, datasets and image loading, distributed helpers, training
utilities and checkpoints.

The few reference numbers taken from the DINO authors' code live in tests/data/common_reference.pt
(see its "source" entry); everything else is checked against hand computations.
"""
import argparse
import copy
import gzip
import math
import os
import random
import re
import signal
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402

# Copied from the outputs of the DINO authors' code (facebookresearch/dino @ 7c446df5):
# utils.cosine_scheduler (6 cases), utils.clip_gradients (1 case) and
# VisionTransformer.interpolate_pos_encoding of a ViT-Ti/16 (first 16 of its 192 channels; the
# interpolation acts on every channel separately).
REFERENCE = torch.load(ROOT / "tests/data/common_reference.pt", weights_only=True)

VIT_ARCHS = [a for a, c in common.ARCHS.items() if c["family"] == "vit"]
SWIN_ARCHS = [a for a, c in common.ARCHS.items() if c["family"] == "swin"]
# every architecture with both of its token-grid options (ViT patch 16 / 8, Swin window 7 / 14)
VARIANTS = ([(a, dict(patch_size=p)) for a in VIT_ARCHS for p in (16, 8)]
            + [(a, dict(window_size=w)) for a in SWIN_ARCHS for w in (7, 14)])
VARIANT_IDS = [f"{a}-{next(iter(kw))[0]}{next(iter(kw.values()))}" for a, kw in VARIANTS]
# timm models with exactly the released layout of a configuration (num_classes=0: no classifier)
TIMM_EQUIVALENT = {("vit_tiny", 16): "vit_tiny_patch16_224", ("vit_small", 16): "vit_small_patch16_224",
                   ("vit_small", 8): "vit_small_patch8_224", ("vit_base", 16): "vit_base_patch16_224",
                   ("vit_base", 8): "vit_base_patch8_224",
                   ("swin_tiny", 7): "swin_tiny_patch4_window7_224",
                   ("swin_small", 7): "swin_small_patch4_window7_224",
                   ("swin_base", 7): "swin_base_patch4_window7_224"}
EMBED_DIM = {"vit_pico": 64, "vit_tiny": 192, "vit_small": 384, "vit_base": 768,
             "swin_pico": 256, "swin_pico3": 128, "swin_tiny": 768, "swin_small": 768, "swin_base": 1024}


# token grid side of a square input (from the brief): ViT/16 14x14 at 224 and 6x6 at 96, ViT/8 28x28
# and 12x12, Swin (patch 4, three 2x mergings) 7x7 and 3x3 whatever the window; swin_pico3 (patch 2,
# two mergings) 28x28 and 12x12
GRID = {("vit", 16): {224: 14, 96: 6}, ("vit", 8): {224: 28, 96: 12}, ("swin", None): {224: 7, 96: 3},
        ("swin_pico3", None): {224: 28, 96: 12}}


def expected_grid(arch, kw, size):
    family = arch if arch in ("swin_pico3",) else common.ARCHS[arch]["family"]
    return GRID[family, kw.get("patch_size")][size]


def assert_same(a, b):
    """Recursive exact equality of nested lists / tuples / dicts of tensors and numbers."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


# ================================================================================================
# 1. Backbones
# ================================================================================================
def test_arch_table_has_both_families():
    assert set(VIT_ARCHS) >= {"vit_tiny", "vit_small", "vit_base"}
    assert set(SWIN_ARCHS) >= {"swin_tiny", "swin_small", "swin_base"}
    assert set(VIT_ARCHS) | set(SWIN_ARCHS) == set(common.ARCHS)


@pytest.mark.parametrize("arch,kw", VARIANTS, ids=VARIANT_IDS)
def test_real_config_builds_with_released_layout(arch, kw):
    """The full-size configuration constructs (on the meta device: no memory), with the parameter
    layout of timm's released model where one exists, so released weights load into it."""
    with torch.device("meta"):
        model = common.build_backbone(arch, **kw)
    assert model.num_features == EMBED_DIM[arch]
    depths = [common.ARCHS[arch]["depth"]] if "depth" in common.ARCHS[arch] else common.ARCHS[arch]["depths"]
    blocks = [m for m in model.modules() if type(m).__name__ in ("Block", "SwinTransformerBlock")]
    assert len(blocks) == sum(depths)
    size_key = kw.get("patch_size", kw.get("window_size"))
    if (arch, size_key) in TIMM_EQUIVALENT:
        with torch.device("meta"):
            ref = timm.create_model(TIMM_EQUIVALENT[arch, size_key], pretrained=False, num_classes=0,
                                    weight_init="skip")
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        assert ours == theirs
    if "window_size" in kw:  # stage 1 (56x56 at 224 px) uses the requested window
        table = model.layers[0].blocks[0].attn.relative_position_bias_table
        assert table.shape[0] == (2 * kw["window_size"] - 1) ** 2


@pytest.mark.parametrize("arch,kw", VARIANTS, ids=VARIANT_IDS)
def test_global_and_dense_shapes_every_variant(arch, kw):
    """[B, D] and [B, h, w, D] at 224 and 96 px for every architecture and patch / window option.
    Shapes do not depend on the depth, so this propagates them (meta device: no arithmetic)
    through one block per stage of the real widths, heads and windows."""
    cfg = common.ARCHS[arch]
    shallow = dict(depth=1) if cfg["family"] == "vit" else dict(depths=(1,) * len(cfg["depths"]))
    with torch.device("meta"):
        model = common.build_backbone(arch, **kw, **shallow).eval()
    with torch.no_grad():
        for size in (224, 96):
            g, d = model.forward_dense(torch.empty(2, 3, size, size, device="meta"))
            n = expected_grid(arch, kw, size)
            assert tuple(g.shape) == (2, EMBED_DIM[arch])
            assert tuple(d.shape) == (2, n, n, EMBED_DIM[arch])


# Real forward passes: every architecture at its default patch / window, plus the other option of one
# ViT and one Swin (all options are shape-checked above on the full configurations).
FORWARD_VARIANTS = ([(a, dict(patch_size=16)) for a in VIT_ARCHS] + [("vit_small", dict(patch_size=8))]
                    + [(a, dict(window_size=7)) for a in SWIN_ARCHS] + [("swin_tiny", dict(window_size=14))])


@pytest.mark.parametrize("arch,kw", FORWARD_VARIANTS,
                         ids=[f"{a}-{next(iter(kw))[0]}{next(iter(kw.values()))}" for a, kw in FORWARD_VARIANTS])
def test_tiny_forward_dense_and_global(arch, kw):
    """Real forward passes of shallow variants (real widths, depth 1 per stage) at 224 and 96 px:
    shapes, the final norm applied to the last block's tokens, the global feature (ViT: CLS; Swin:
    mean of the normed tokens), and no mixing between the samples of a batch."""
    torch.manual_seed(0)
    vit = common.ARCHS[arch]["family"] == "vit"
    shallow = dict(depth=1) if vit else dict(depths=(1,) * len(common.ARCHS[arch]["depths"]))
    model = common.build_backbone(arch, **kw, **shallow).eval()
    D = EMBED_DIM[arch]
    seen = []
    model.norm.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    for size, B in ((224, 1), (96, 2)):
        x = torch.randn(B, 3, size, size)
        n = expected_grid(arch, kw, size)
        seen.clear()
        with torch.no_grad():
            g, d = model.forward_dense(x)
        assert g.shape == (B, D) and d.shape == (B, n, n, D)
        assert torch.isfinite(d).all() and torch.isfinite(g).all()
        with torch.no_grad():
            normed = model.norm(seen[0])
        if vit:  # [B, 1 + h*w, D]: CLS first, then the patches row-major
            torch.testing.assert_close(g, normed[:, 0], rtol=0, atol=1e-6)
            torch.testing.assert_close(d, normed[:, 1:].reshape(B, n, n, D), rtol=0, atol=1e-6)
        else:  # [B, h, w, D]
            torch.testing.assert_close(d, normed, rtol=0, atol=1e-6)
            torch.testing.assert_close(g, d.mean(dim=(1, 2)), rtol=0, atol=1e-5)
        # the final norm really is applied: every token of the dense output is layer-normalised
        tok = d.reshape(-1, D)
        assert tok.mean(-1).abs().max() < 1e-3 and (tok.var(-1, unbiased=False) - 1).abs().max() < 1e-2
        if size == 96:  # padded windows / interpolated positions must not mix samples
            with torch.no_grad():
                g1, d1 = model.forward_dense(x[1:])
            torch.testing.assert_close(g1, g[1:], rtol=0, atol=1e-4)
            torch.testing.assert_close(d1, d[1:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["vit_pico", "swin_pico"])
def test_forward_dense_norm_false_and_timm_forward(arch):
    """norm=False returns the tokens before the final norm; forward_dense agrees with timm's own
    forward_features / forward at 96 px (the Swin has a shifted-window block, so its padding and
    dynamic attention mask run)."""
    torch.manual_seed(0)
    model = common.build_backbone(arch, **(dict(depth=1) if arch.startswith("vit") else dict(depths=(1, 1, 2, 1))))
    model.eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2.0)
        model.norm.bias.normal_()
        x = torch.randn(2, 3, 96, 96)
        g, d = model.forward_dense(x)
        g_raw, d_raw = model.forward_dense(x, norm=False)
        feats, pooled = model.forward_features(x), model(x)
    torch.testing.assert_close(g, pooled, rtol=0, atol=1e-5)
    if arch.startswith("vit"):
        torch.testing.assert_close(d, model.norm(d_raw), rtol=0, atol=1e-5)
        torch.testing.assert_close(g, model.norm(g_raw), rtol=0, atol=1e-5)
        torch.testing.assert_close(d.reshape(2, 36, -1), feats[:, 1:], rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(d, model.norm(d_raw), rtol=0, atol=1e-5)
        torch.testing.assert_close(d, feats, rtol=0, atol=1e-5)
    assert not torch.allclose(d, d_raw, atol=1e-2)


def test_vit_without_cls_token_and_final_norm():
    """SelfPatch's backbone: no CLS token (global is None, pos_embed has only patch positions) and
    no final LayerNorm (dense output = last block's output)."""
    torch.manual_seed(0)
    model = common.build_backbone("vit_small", depth=1, class_token=False, final_norm=False).eval()
    keys = set(model.state_dict())
    assert model.cls_token is None and "cls_token" not in keys
    assert not any(k.startswith(("norm.", "fc_norm.")) for k in keys)
    assert model.pos_embed.shape == (1, 196, 384)
    assert not any(isinstance(m, nn.LayerNorm) for m in (model.norm, model.fc_norm))
    last_block = []
    model.blocks.register_forward_hook(lambda module, inputs, output: last_block.append(output))
    for size, n in ((224, 14), (96, 6)):
        x = torch.randn(2, 3, size, size)
        last_block.clear()
        with torch.no_grad():
            g, d = model.forward_dense(x)
            _, d_raw = model.forward_dense(x, norm=False)
        assert g is None and d.shape == (2, n, n, 384)
        assert last_block[0].shape == (2, n * n, 384)  # patch tokens only
        assert torch.equal(d, last_block[0].reshape(2, n, n, 384))  # the last block's output as is
        assert torch.equal(d, d_raw)


def test_vit_without_cls_token_keeps_a_requested_final_norm():
    """class_token=False with final_norm=True must still end in the final LayerNorm (timm moves it
    to an unused `fc_norm` for average pooling unless told otherwise)."""
    torch.manual_seed(0)
    model = common.build_backbone("vit_small", depth=1, class_token=False, final_norm=True).eval()
    assert isinstance(model.norm, nn.LayerNorm)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2.0)
        model.norm.bias.normal_()
        x = torch.randn(2, 3, 96, 96)
        g, d = model.forward_dense(x)
        _, d_raw = model.forward_dense(x, norm=False)
    assert g is None
    torch.testing.assert_close(d, model.norm(d_raw), rtol=0, atol=1e-6)
    assert not torch.allclose(d, d_raw, atol=1e-2)


def test_backbone_argument_errors():
    with pytest.raises(SystemExit, match="unknown --arch"):
        common.build_backbone("resnet50")
    with pytest.raises(SystemExit, match="patch_size"):
        common.build_backbone("vit_small", patch_size=12, depth=1)
    with pytest.raises(SystemExit, match="Swin"):
        common.build_backbone("swin_tiny", class_token=False)


def test_drop_path_only_when_asked():
    with torch.device("meta"):
        student = common.build_backbone("vit_small", drop_path_rate=0.1, depth=2)
        teacher = common.build_backbone("vit_small", depth=2)
    assert student.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)  # linear rule: 0.1 at the last block
    assert not any(type(m).__name__ == "DropPath" for m in teacher.modules())


def perturb_(model, seed=0):
    """Non-trivial weights (LayerNorm gains far from 1, non-zero biases, large position embeddings),
    so that outputs depend on every parameter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name in ("pos_embed", "cls_token") else 0.1
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_released_vit_layout_loads_strictly_and_matches_at_224():
    """timm's vit_tiny_patch16_224 has the DINO authors' key names; its state dict loads strictly
    into build_backbone('vit_tiny') and gives the same CLS (and patch tokens) at 224 px."""
    torch.manual_seed(0)
    released = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0).eval()
    perturb_(released)
    state = {k: v.clone() for k, v in released.state_dict().items()}
    assert len(state) == 150  # the authors' ViT-Ti state dict has 150 entries (dino.md)
    ours = common.build_backbone("vit_tiny").eval()
    assert set(ours.state_dict()) == set(state)
    ours.load_state_dict(state, strict=True)
    common.load_state_dict_strict(ours, state)
    assert all(m.eps == 1e-6 for m in ours.modules() if isinstance(m, nn.LayerNorm))
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        tokens = released.forward_features(x)
        expected = released.forward_head(tokens)
        g, d = ours.forward_dense(x)
    assert expected.abs().max() > 0.5  # a meaningful comparison
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(d.reshape(2, 196, 192), tokens[:, 1:], rtol=0, atol=1e-5)


def dino_interpolated_pos_embed(pos, h, w, n=14):
    """The DINO authors' interpolate_pos_encoding, written out: bicubic with scale_factor
    ((h + 0.1) / n, (w + 0.1) / n), align_corners=False, CLS position unchanged."""
    C = pos.shape[-1]
    grid = pos[:, 1:].reshape(1, n, n, C).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((h + 0.1) / n, (w + 0.1) / n), mode="bicubic",
                         align_corners=False)
    assert grid.shape[-2:] == (h, w)
    return torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, h * w, C)], dim=1)


@pytest.mark.parametrize("H,W", [(96, 96), (48, 80)])
def test_pos_embed_interpolation_is_dinos_formula(H, W):
    torch.manual_seed(0)
    model = common.build_backbone("vit_small", depth=1).eval()
    with torch.no_grad():
        model.pos_embed.normal_()
        model.cls_token.normal_()
    C, h, w = 384, H // 16, W // 16
    pos = model.pos_embed.detach()
    expected_pos = dino_interpolated_pos_embed(pos, h, w)
    with torch.no_grad():
        got = model._pos_embed(torch.zeros(1, h, w, C))
    torch.testing.assert_close(got[:, 1:], expected_pos[:, 1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, 0], model.cls_token[:, 0] + pos[:, 0], rtol=0, atol=1e-6)
    # timm's own resampling (size=(h, w), antialiased) differs: the check above can tell them apart
    stock = timm.layers.resample_abs_pos_embed(pos, (h, w), num_prefix_tokens=1)
    assert (stock - expected_pos).abs().max() > 0.05
    # and the forward pass uses it: a hand-written forward with the DINO position embedding
    x = torch.randn(2, 3, H, W)
    with torch.no_grad():
        tokens = model.patch_embed(x).reshape(2, h * w, C)
        tokens = torch.cat([model.cls_token.expand(2, -1, -1), tokens], 1) + expected_pos
        tokens = model.norm(model.blocks(tokens))
        g, d = model.forward_dense(x)
    assert d.shape == (2, h, w, C)
    torch.testing.assert_close(g, tokens[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(d.reshape(2, h * w, C), tokens[:, 1:], rtol=0, atol=1e-5)


def test_pos_embed_not_interpolated_at_224():
    model = common.build_backbone("vit_small", depth=1).eval()
    with torch.no_grad():
        model.pos_embed.normal_()
        got = model._pos_embed(torch.zeros(1, 14, 14, 384))
    torch.testing.assert_close(got[:, 1:], model.pos_embed[:, 1:], rtol=0, atol=0)


@pytest.mark.parametrize("case,h,w", [("expected_pos_embed_96", 6, 6), ("expected_pos_embed_48x80", 3, 5)])
def test_pos_embed_interpolation_matches_authors_values(case, h, w):
    """The interpolated position embedding of the authors' ViT-Ti/16 (first 16 channels)."""
    ref = REFERENCE["pos_embed"]
    model = common.build_backbone("vit_tiny", embed_dim=16, depth=1, num_heads=2).eval()
    with torch.no_grad():
        model.pos_embed.copy_(ref["pos_embed"])
        model.cls_token.zero_()
        got = model._pos_embed(torch.zeros(1, h, w, 16))
    torch.testing.assert_close(got, ref[case], rtol=0, atol=1e-5)


def test_forward_multicrop_groups_equal_resolutions():
    crops = [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16),
             torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16), torch.randn(2, 3, 32, 32)]
    assert common.resolution_groups(crops) == [(0, 2), (2, 5), (5, 6)]
    calls = []

    def fn(x):
        calls.append(x.shape)
        return x.mean(dim=(1, 2, 3))

    out = common.forward_multicrop(fn, crops)
    assert calls == [(4, 3, 32, 32), (6, 3, 16, 16), (2, 3, 32, 32)]
    torch.testing.assert_close(out[1], torch.cat(crops[2:5]).mean(dim=(1, 2, 3)))  # crop-major rows


# ================================================================================================
# 2. DINO head
# ================================================================================================
OFFICIAL_HEAD_KEYS = {"mlp.0.weight": (2048, 24), "mlp.0.bias": (2048,), "mlp.2.weight": (2048, 2048),
                      "mlp.2.bias": (2048,), "mlp.4.weight": (256, 2048), "mlp.4.bias": (256,),
                      "last_layer.weight_g": (48, 1), "last_layer.weight_v": (48, 256)}  # dino.md


def test_head_default_layout_and_init():
    torch.manual_seed(0)
    head = common.DINOHead(24, 48)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == OFFICIAL_HEAD_KEYS
    assert [type(m) for m in head.mlp] == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]
    assert torch.equal(head.last_layer.weight_g, torch.ones(48, 1))
    for i in (0, 2, 4):
        assert torch.equal(head.mlp[i].bias, torch.zeros_like(head.mlp[i].bias))
    assert head.mlp[2].weight.std().item() == pytest.approx(0.02, rel=0.02)
    bn = common.DINOHead(24, 48, use_bn=True, hidden_dim=32, bottleneck_dim=8)
    assert [type(m) for m in bn.mlp] == [nn.Linear, nn.BatchNorm1d, nn.GELU, nn.Linear, nn.BatchNorm1d,
                                         nn.GELU, nn.Linear]
    one = common.DINOHead(24, 48, nlayers=1, bottleneck_dim=8)
    assert isinstance(one.mlp, nn.Linear) and one.mlp.weight.shape == (8, 24)


def test_head_output_is_the_hand_computation():
    torch.manual_seed(0)
    head = common.DINOHead(24, 48, norm_last_layer=False, hidden_dim=64, bottleneck_dim=16)
    with torch.no_grad():
        for i in (0, 2, 4):
            head.mlp[i].bias.normal_(0, 0.1)
        head.last_layer.weight_g.uniform_(0.5, 2.0)
    x = torch.randn(5, 24)
    W = {i: (head.mlp[i].weight.detach(), head.mlp[i].bias.detach()) for i in (0, 2, 4)}
    h = F.gelu(x @ W[0][0].T + W[0][1])
    h = F.gelu(h @ W[2][0].T + W[2][1])
    z = h @ W[4][0].T + W[4][1]  # no activation after the bottleneck
    z = z / z.norm(dim=1, keepdim=True)
    g, v = head.last_layer.weight_g.detach(), head.last_layer.weight_v.detach()
    expected = z @ (g * v / v.norm(dim=1, keepdim=True)).T
    with torch.no_grad():
        out = head(x)
        bottleneck = head.mlp(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, F.linear(F.normalize(bottleneck), g * v / v.norm(dim=1, keepdim=True)))
    # each logit is g_k times a cosine: |out_k| <= g_k, and the l2-normalised bottleneck has norm 1
    assert (out.abs() <= g.T + 1e-6).all()


def test_head_norm_last_layer_freezes_the_gain():
    torch.manual_seed(0)
    head = common.DINOHead(8, 10, norm_last_layer=True, hidden_dim=16, bottleneck_dim=4)
    assert not head.last_layer.weight_g.requires_grad
    names = {id(p): n for n, p in head.named_parameters()}
    grouped = [names[id(p)] for group in common.get_params_groups(head) for p in group["params"]]
    assert "last_layer.weight_g" not in grouped and "last_layer.weight_v" in grouped
    opt = torch.optim.SGD(head.parameters(), lr=1.0)  # even an optimizer given every parameter
    v0 = head.last_layer.weight_v.detach().clone()
    (head(torch.randn(6, 8)) ** 2).sum().backward()
    opt.step()
    assert torch.equal(head.last_layer.weight_g, torch.ones(10, 1))
    assert not torch.equal(head.last_layer.weight_v, v0)
    # the cosine classifier: unit-norm effective rows
    eff = head.last_layer.weight_g * head.last_layer.weight_v / head.last_layer.weight_v.norm(dim=1, keepdim=True)
    torch.testing.assert_close(eff.norm(dim=1), torch.ones(10))
    with torch.no_grad():
        assert head(torch.randn(6, 8)).abs().max() <= 1 + 1e-6
    free = common.DINOHead(8, 10, norm_last_layer=False, hidden_dim=16, bottleneck_dim=4)
    assert free.last_layer.weight_g.requires_grad
    free(torch.randn(6, 8)).pow(2).sum().backward()
    assert free.last_layer.weight_g.grad is not None and free.last_layer.weight_g.grad.abs().sum() > 0


def test_head_survives_deepcopy():
    torch.manual_seed(0)
    head = common.DINOHead(8, 10, norm_last_layer=True, hidden_dim=16, bottleneck_dim=4)
    twin = copy.deepcopy(head)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), head(x), rtol=0, atol=0)
        assert not twin.last_layer.weight_g.requires_grad
        assert twin.state_dict().keys() == head.state_dict().keys()
        twin.last_layer.weight_v.add_(1.0)  # independent parameters
        assert not torch.allclose(twin(x), head(x))
        assert twin.last_layer.weight_v.data_ptr() != head.last_layer.weight_v.data_ptr()


class AuthorsHead(nn.Module):
    """The DINO authors' DINOHead (vision_transformer.py), with nn.utils.weight_norm."""

    def __init__(self, in_dim, out_dim, hidden_dim, bottleneck_dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # weight_norm is deprecated, but it is what they used
            self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


def test_head_loads_weight_g_weight_v_checkpoints(tmp_path):
    if not hasattr(nn.utils, "weight_norm"):
        pytest.skip("this torch no longer has the authors' nn.utils.weight_norm")
    torch.manual_seed(0)
    authors = AuthorsHead(8, 10, 16, 4)
    with torch.no_grad():
        authors.last_layer.weight_g.uniform_(0.5, 2.0)
    state = authors.state_dict()
    assert {"last_layer.weight_g", "last_layer.weight_v"} <= set(state)
    torch.save(state, tmp_path / "head.pth")
    ours = common.DINOHead(8, 10, norm_last_layer=False, hidden_dim=16, bottleneck_dim=4)
    common.load_state_dict_strict(ours, torch.load(tmp_path / "head.pth", weights_only=True))
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), authors(x), rtol=0, atol=1e-6)


# ================================================================================================
# 3. Augmentation, geometry and per-sample seeding
# ================================================================================================
def geometry(boxes, flips, sizes):
    return {"box": torch.tensor(boxes, dtype=torch.float32), "flip": torch.tensor(flips),
            "image_size": torch.tensor(sizes, dtype=torch.float32)}


def test_grid_centers_hand_computed():
    # crop box x0=0.25, y0=0.5, w=0.5, h=0.25 of a 100 (W) x 80 (H) image, 2x2 grid:
    # x = (0.25 + 0.5 * {0.25, 0.75}) * 100 = {37.5, 62.5}; y = (0.5 + 0.25 * {0.25, 0.75}) * 80 = {45, 55}
    geo = geometry([[0.25, 0.5, 0.5, 0.25]] * 2, [False, True], [[100, 80]] * 2)
    out = common.grid_centers(geo, (2, 2))
    assert out.shape == (2, 4, 2)
    torch.testing.assert_close(out[0], torch.tensor([[37.5, 45.0], [62.5, 45.0], [37.5, 55.0], [62.5, 55.0]]))
    # flipped: the grid's column 0 sees the right end of the box
    torch.testing.assert_close(out[1], torch.tensor([[62.5, 45.0], [37.5, 45.0], [62.5, 55.0], [37.5, 55.0]]))


def test_grid_centers_non_square_grid_box_and_image():
    # whole 30 x 10 image, 1 x 3 grid: x = 5, 15, 25; y = 5
    geo = geometry([[0.0, 0.0, 1.0, 1.0]], [False], [[30, 10]])
    torch.testing.assert_close(common.grid_centers(geo, (1, 3))[0],
                               torch.tensor([[5.0, 5.0], [15.0, 5.0], [25.0, 5.0]]))
    # box x0=0.1, y0=0.2, w=0.4, h=0.6 of a 200 x 50 image, 3 rows x 2 columns, flipped:
    # x = (0.1 + 0.4 * {0.75, 0.25}) * 200 = {80, 40}; y = (0.2 + 0.6 * {1/6, 3/6, 5/6}) * 50 = {15, 25, 35}
    geo = geometry([[0.1, 0.2, 0.4, 0.6], [0.1, 0.2, 0.4, 0.6]], [True, False], [[200, 50], [200, 50]])
    out = common.grid_centers(geo, (3, 2))
    torch.testing.assert_close(out[0], torch.tensor([[80.0, 15.0], [40.0, 15.0], [80.0, 25.0], [40.0, 25.0],
                                                     [80.0, 35.0], [40.0, 35.0]]))
    torch.testing.assert_close(out[1], torch.tensor([[40.0, 15.0], [80.0, 15.0], [40.0, 25.0], [80.0, 25.0],
                                                     [40.0, 35.0], [80.0, 35.0]]))


def test_crop_geometry_locates_every_pixel():
    """End to end: on an image whose red / green channels are its x / y pixel coordinates, every
    interior pixel of a (flipped or not) crop has the value of the original image at the centre
    `grid_centers` gives for it (grid = the crop's pixels)."""
    W, H = 240, 160
    xs, ys = np.meshgrid(np.arange(W), np.arange(H))
    img = Image.fromarray(np.stack([xs, ys, np.zeros_like(xs)], -1).astype(np.uint8))
    flips = set()
    for seed in range(8):
        torch.manual_seed(seed)
        for size, scale in ((32, (0.4, 1.0)), (16, (0.05, 0.4))):
            crop, geo = common.MultiCropAugmentation.crop_and_flip(img, size, scale)
            flips.add(bool(geo["flip"]))
            pix = np.asarray(crop).astype(np.float64)[3:-3, 3:-3]  # bicubic edges see the crop border
            centres = common.grid_centers({k: v[None] for k, v in geo.items()}, (size, size))
            centres = centres[0].reshape(size, size, 2).numpy()[3:-3, 3:-3]
            # pixel i covers [i, i + 1), so the value at continuous coordinate c is c - 0.5
            assert np.abs(pix[..., 0] - (centres[..., 0] - 0.5)).max() < 0.75
            assert np.abs(pix[..., 1] - (centres[..., 1] - 0.5)).max() < 0.75
    assert flips == {True, False}


def test_multicrop_output_counts_sizes_and_boxes():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8))
    aug = common.MultiCropAugmentation(local_crops_number=3, global_crop_size=64, local_crop_size=32)
    for seed in range(10):
        torch.manual_seed(seed)
        crops, geo = aug(img)
        assert len(crops) == len(geo) == 5
        assert [tuple(c.shape) for c in crops] == [(3, 64, 64)] * 2 + [(3, 32, 32)] * 3
        assert all(c.dtype == torch.float32 for c in crops)
        for i, g in enumerate(geo):
            x0, y0, w, h = g["box"].tolist()
            assert 0 <= x0 and 0 <= y0 and 0 < w and 0 < h and x0 + w <= 1 + 1e-6 and y0 + h <= 1 + 1e-6
            lo, hi = (0.4, 1.0) if i < 2 else (0.05, 0.4)
            assert lo - 0.03 <= w * h <= hi + 0.03  # area fraction (integer pixel rounding)
            assert g["flip"].dtype == torch.bool
            assert g["image_size"].tolist() == [100.0, 70.0]
    default = common.MultiCropAugmentation()
    crops, geo = default(img)
    assert [c.shape[-1] for c in crops] == [224, 224] + [96] * 8 and len(geo) == 10


def synthetic_seeded(seed=3, n=6):
    base = common.SyntheticShapes(num_images=n, image_size=48)
    aug = common.MultiCropAugmentation(local_crops_number=2, global_crop_size=32, local_crop_size=16)
    return common.SeededDataset(base, aug, seed=seed)


def test_seeded_dataset_is_a_function_of_seed_epoch_index():
    ds = synthetic_seeded()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = ds[4]
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone
    torch.manual_seed(999)
    _ = ds[2]
    assert_same(ds[4], first)  # another global seed, another sample in between: same crops
    ds.epoch = 1
    other_epoch = ds[4]
    assert not torch.equal(other_epoch[0][0][0], first[0][0][0])
    assert not torch.equal(other_epoch[0][1][0]["box"], first[0][1][0]["box"])
    ds.epoch = 0
    assert_same(ds[4], first)  # resuming epoch 0 gives it back
    assert not torch.equal(synthetic_seeded(seed=4)[4][0][0][0], first[0][0][0])


def load_all(ds, num_workers, order=None):
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=num_workers,
                                         sampler=order or list(range(len(ds))))
    return list(loader)


def test_seeded_augmentation_independent_of_workers_and_order():
    ds = synthetic_seeded()
    single = load_all(ds, 0)
    two_workers = load_all(ds, 2)
    assert_same(two_workers, single)
    backwards = load_all(ds, 2, order=list(range(len(ds)))[::-1])
    for b, batch in enumerate(backwards):  # batch b holds samples 5-2b and 4-2b
        crops, geo = batch[0]
        for j, index in enumerate((5 - 2 * b, 4 - 2 * b)):
            ref_crops, ref_geo = single[index // 2][0]
            k = index % 2
            for c in range(len(crops)):
                assert torch.equal(crops[c][j], ref_crops[c][k])
                assert torch.equal(geo[c]["box"][j], ref_geo[c]["box"][k])
                assert torch.equal(geo[c]["flip"][j], ref_geo[c]["flip"][k])
    ds.epoch = 1
    epoch1 = load_all(ds, 2)
    assert_same(load_all(ds, 0), epoch1)
    assert not torch.equal(epoch1[0][0][0][0], single[0][0][0][0])
    assert not torch.equal(epoch1[0][0][1][0]["box"], single[0][0][1][0]["box"])


def draws_of_all_three_generators(_image):
    return torch.tensor([random.random(), float(np.random.rand()), torch.rand(1).item()], dtype=torch.float64)


def test_seeded_dataset_seeds_python_numpy_torch_alike_in_workers_and_main_process():
    """Workers skip the save/restore of the global generators (nothing else uses them there), so
    the seeding itself must be the same on both paths."""
    ds = common.SeededDataset([(None, 0)] * 4, draws_of_all_three_generators, seed=3)
    main = torch.stack([ds[i][0] for i in range(4)])
    worker = next(iter(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1)))[0]
    assert torch.equal(worker, main)
    assert len(set(main[:, 0].tolist())) == 4


def test_persistent_workers_see_every_epoch():
    """make_loader keeps its workers across epochs; they never see a later `set_epoch` of their copy of
    the dataset, so the epoch travels with each index: epoch by epoch, two persistent workers give the
    samples of the main process (with the dataset's own epoch never set), and each epoch its own draws."""
    ds = common.SeededDataset([(None, 0)] * 8, draws_of_all_three_generators, seed=3)
    loaders = {n: common.make_loader(ds, 2, n, train=True, seed=5) for n in (0, 2)}
    assert loaders[2][0].persistent_workers and not loaders[0][0].persistent_workers
    epochs = {n: [] for n in loaders}
    for epoch in range(3):
        for n, (loader, sampler) in loaders.items():
            sampler.set_epoch(epoch)
            epochs[n].append(torch.cat([draws for draws, _label in loader]))
    for with_workers, in_main in zip(epochs[2], epochs[0]):
        assert torch.equal(with_workers, in_main)
    assert ds.epoch == 0 and len({tuple(e[:, 2].sort().values.tolist()) for e in epochs[2]}) == 3  # new draws


def sigterm_to_self_before_ignoring(worker_id, ignore=common.ignore_preemption_signals):
    os.kill(os.getpid(), signal.SIGTERM)   # a job-wide SIGTERM that reaches a worker still starting up
    ignore(worker_id)


def test_loader_worker_survives_a_preemption_signal_sent_before_its_init(monkeypatch):
    """Until its worker_init_fn runs, a worker has torch's SIGTERM handler and dies of the signal,
    taking the training process with it (CI saw this). make_loader's workers are born with it blocked."""
    monkeypatch.setattr(common, "ignore_preemption_signals", sigterm_to_self_before_ignoring)
    loader, _ = common.make_loader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=1,
                                   train=False)
    for _epoch in range(2):   # the persistent worker is still alive for the next epoch
        assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])   # the main process is unblocked again


def test_sample_seed_distinct_and_stable():
    seeds = {common.sample_seed(0, e, i) for e in range(3) for i in range(100)}
    assert len(seeds) == 300
    assert common.sample_seed(0, 1, 2) == common.sample_seed(0, 1, 2)
    assert 0 <= common.sample_seed(7, 8, 9) < 2 ** 63


# ================================================================================================
# 4. Datasets and image loading
# ================================================================================================
def test_synthetic_shapes_deterministic_with_all_classes():
    a = common.SyntheticShapes(num_images=20, image_size=40, seed=0)
    b = common.SyntheticShapes(num_images=20, image_size=40, seed=0)
    assert len(a.classes) == 10 and len(set(a.classes)) == 10
    assert set(a.targets) == set(range(10))
    arrays = []
    for i in range(20):
        img, label = a[i]
        assert img.mode == "RGB" and img.size == (40, 40) and label == a.targets[i]
        assert np.array_equal(np.asarray(img), np.asarray(b[i][0]))
        arrays.append(np.asarray(img))
    assert len({arr.tobytes() for arr in arrays}) == 20
    assert not np.array_equal(np.asarray(common.SyntheticShapes(20, 40, seed=1)[3][0]), arrays[3])
    assert not np.array_equal(np.asarray(common.SyntheticShapes(20, 40, train=False)[3][0]), arrays[3])
    assert common.SyntheticShapes(4, 100)[1][0].size == (100, 100)  # any resolution


def test_fashion_mnist_reading():
    if not Path(common.FashionMNIST.DEFAULT_ROOT).is_dir():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    ds = common.build_dataset(Namespace(dataset="fashion_mnist", data_path=None), train=False)
    assert len(ds) == 10000 and len(ds.classes) == 10
    assert np.array_equal(np.bincount(ds.targets), np.full(10, 1000))
    assert [int(t) for t in ds.targets[:3]] == [9, 2, 1]  # ankle boot, pullover, trouser
    img, label = ds[0]
    arr = np.asarray(img)
    assert img.mode == "RGB" and img.size == (28, 28) and label == 9
    assert np.array_equal(arr[..., 0], arr[..., 1]) and np.array_equal(arr[..., 0], arr[..., 2])
    assert arr.max() > 200 and arr.min() == 0


def test_idx_reader_plain_and_missing_fashion_mnist(tmp_path):
    data = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 8, 3]) + b"".join(int(s).to_bytes(4, "big") for s in data.shape)
    (tmp_path / "x-idx3-ubyte").write_bytes(header + data.tobytes())
    assert np.array_equal(common.read_idx(tmp_path / "x-idx3-ubyte"), data)
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path))):
        common.FashionMNIST(tmp_path)


def test_torchvision_datasets_are_read_from_a_local_root(tmp_path, monkeypatch):
    """CIFAR-10/100 and SVHN (DRLoc's datasets) in torchvision's own layout, tiny and without the real files'
    checksums: each split, its labels and 32 px RGB images; a missing one is one line that says how to fetch it
    (torchvision's own "use download=True" names no flag of these scripts)."""
    import pickle
    import scipy.io
    import torchvision.datasets.cifar
    import torchvision.datasets.svhn
    for module in torchvision.datasets.cifar, torchvision.datasets.svhn:                  # no md5 of the real files
        monkeypatch.setattr(module, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    rng = np.random.default_rng(0)
    cifar = {"cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "batches.meta", "labels", 10),
             "cifar100": ("cifar-100-python", ["train"], "meta", "fine_labels", 100)}
    for name, (folder, train_files, meta, key, n_classes) in cifar.items():
        (tmp_path / folder).mkdir()
        for file, n in [*((f, 2) for f in train_files), ("test_batch" if name == "cifar10" else "test", 3)]:
            batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), key: list(range(n))}
            (tmp_path / folder / file).write_bytes(pickle.dumps(batch))
        names = [f"c{i}" for i in range(n_classes)]
        (tmp_path / folder / meta).write_bytes(pickle.dumps({"label_names": names, "fine_label_names": names}))
    for split, n in ("train", 4), ("test", 3):
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat", {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8),
                                                            "y": np.array([[10], [1], [2], [3]][:n], dtype=np.uint8)})
    for name, sizes in ("cifar10", (10, 3)), ("cifar100", (2, 3)), ("svhn", (4, 3)):
        for train, size in zip((True, False), sizes):
            data = common.named_dataset(Namespace(dataset=name, data_path=str(tmp_path)), train)
            image, label = data[1]
            assert len(data) == size and image.size == (32, 32) and image.mode == "RGB" and label == 1
    assert common.dataset_record(common.named_dataset(Namespace(dataset="svhn", data_path=str(tmp_path)), True))
    (tmp_path / "test_32x32.mat").unlink()
    with pytest.raises(SystemExit) as info:
        common.named_dataset(Namespace(dataset="svhn", data_path=str(tmp_path)), train=False)
    assert str(info.value) == (f"error: svhn is missing or damaged under --data_path {tmp_path}: these scripts download "
                               f"nothing; fetch it once: python -c \"import torchvision; torchvision.datasets.SVHN("
                               f"'{tmp_path}', split='test', download=True)\"")


def test_a_damaged_fashion_mnist_is_one_line(tmp_path):
    """A truncated download, a file that is not gzip or not IDX, labels of the other split: one line, no traceback
    from gzip or numpy, and never a silently misaligned dataset."""
    def idx(array):
        return bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape) + array.tobytes()
    images = np.random.default_rng(0).integers(0, 256, (6, 28, 28), dtype=np.uint8)     # incompressible
    labels = np.arange(6, dtype=np.uint8)
    cases = {"truncated": (gzip.compress(idx(images))[:200], "Compressed file ended before the end-of-stream marker"),
             "not gzip": (b"hello", "Not a gzipped file"),
             "not IDX": (gzip.compress(b"\x89PNG" + bytes(100)), "not with an IDX header of unsigned bytes"),
             "short": (gzip.compress(idx(images)[:-10]), "cannot reshape")}
    for case, (content, said) in cases.items():
        root = tmp_path / case.replace(" ", "_")
        root.mkdir()
        (root / "train-images-idx3-ubyte.gz").write_bytes(content)
        (root / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx(labels)))
        with pytest.raises(SystemExit) as info:
            common.FashionMNIST(root)
        (line,) = str(info.value).splitlines()
        assert line.startswith(f"error: cannot read {root / 'train-images-idx3-ubyte.gz'}: ") and said in line, line
        assert line.endswith("; (re)install dataset-fashion-mnist (apt-get) or give --data_path its 4 files")
    root = tmp_path / "other_labels"
    root.mkdir()
    (root / "train-images-idx3-ubyte").write_bytes(idx(images))         # plain files too
    (root / "train-labels-idx1-ubyte").write_bytes(idx(labels[:4]))
    with pytest.raises(SystemExit, match=f"error: {re.escape(str(root))}'s train files hold 6 images but 4 labels"):
        common.FashionMNIST(root)
    (root / "train-labels-idx1-ubyte").write_bytes(idx(labels))
    assert len(common.FashionMNIST(root)) == 6 and common.FashionMNIST(root).targets.dtype == np.int64


def folder_args(path):
    return Namespace(dataset="folder", data_path=None if path is None else str(path), skip_bad_images=False)


def test_build_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="--data_path is required"):
        common.build_dataset(folder_args(None))
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit, match=re.escape(str(missing)) + ".*does not exist"):
        common.build_dataset(folder_args(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=re.escape(f"no images in {empty}")):
        common.build_dataset(folder_args(empty))
    (empty / "cats").mkdir()
    (empty / "cats" / "notes.txt").write_text("not an image")
    with pytest.raises(SystemExit, match=re.escape(f"no images in {empty}")):
        common.build_dataset(folder_args(empty))
    with pytest.raises(SystemExit, match="no val/ or test/"):
        common.build_dataset(folder_args(empty), train=False)
    with pytest.raises(SystemExit, match="unknown --dataset"):
        common.build_dataset(Namespace(dataset="imagenet22k", data_path=None))
    with pytest.raises(SystemExit, match="nothing is downloaded"):
        common.build_dataset(Namespace(dataset="cifar10", data_path=None))
    synthetic = dict(dataset="synthetic", synthetic_images=8, synthetic_image_size=16, synthetic_seed=0)
    assert len(common.build_dataset(Namespace(**synthetic, data_path=None))) == 8
    with pytest.raises(SystemExit, match=re.escape(f"--dataset synthetic draws its images; --data_path {empty} would "
                                                   "be ignored: drop it (or --dataset folder)")):
        common.build_dataset(Namespace(**synthetic, data_path=str(empty)))     # not the folder the user meant


def test_image_folder_and_bad_images(tmp_path):
    for cls, color in (("a", (255, 0, 0)), ("b", (0, 0, 255))):
        (tmp_path / "train" / cls).mkdir(parents=True)
        Image.new("RGB", (12, 10), color).save(tmp_path / "train" / cls / "0.png")
    ds = common.build_dataset(folder_args(tmp_path))
    assert len(ds) == 2 and ds.classes == ["a", "b"]
    img, label = ds[1]
    assert label == 1 and img.getpixel((0, 0)) == (0, 0, 255)
    bad = tmp_path / "train" / "b" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    ds = common.build_dataset(folder_args(tmp_path))
    with pytest.raises(common.BadImageError, match=re.escape(str(bad))):
        ds[2]
    ds.skip_bad_images = True
    img, label = ds[2]  # replaced by the next readable image
    assert ds.skipped.value == 1 and label == 0


def test_load_image_converts_modes(tmp_path):
    gray = np.array([[0, 128], [200, 255]], dtype=np.uint8)
    Image.fromarray(gray, mode="L").save(tmp_path / "gray.png")
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[..., :3] = (10, 20, 30)
    rgba[0, 0, 3] = 255
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "rgba.png")
    pal = Image.fromarray(np.array([[0, 1], [1, 0]], dtype=np.uint8), mode="P")
    pal.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    pal.save(tmp_path / "pal.png")
    pal.save(tmp_path / "pal_t.png", transparency=1)
    deep = np.array([[0, 1000], [30000, 65535]], dtype=np.uint16)
    Image.fromarray(deep).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")

    out = {name: common.load_image(tmp_path / f"{name}.png") for name in ("gray", "rgba", "pal", "pal_t", "deep")}
    assert all(img.mode == "RGB" and img.size == (2, 2) for img in out.values())
    assert np.array_equal(np.asarray(out["gray"]), np.repeat(gray[..., None], 3, -1))
    assert np.array_equal(np.asarray(out["rgba"]), rgba[..., :3])
    expected_pal = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 255, 0], [255, 0, 0]]], dtype=np.uint8)
    assert np.array_equal(np.asarray(out["pal"]), expected_pal)
    assert np.array_equal(np.asarray(out["pal_t"]), expected_pal)
    d = np.asarray(out["deep"])[..., 0].astype(int)
    assert d[0, 0] == 0 and d[1, 1] == 255 and 0 <= d[0, 1] < d[1, 0] < 255  # rescaled, order kept
    assert np.array_equal(np.asarray(out["deep"])[..., 0], np.asarray(out["deep"])[..., 2])


def test_load_image_truncated_jpeg_names_the_file(tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "full.jpg", quality=95)
    data = (tmp_path / "full.jpg").read_bytes()
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(data[: len(data) // 2])
    assert common.load_image(tmp_path / "full.jpg").size == (64, 64)
    with pytest.raises(common.BadImageError, match="broken.jpg") as info:
        common.load_image(broken)
    assert str(broken) in str(info.value)
    text = tmp_path / "notes.jpg"
    text.write_text("hello")
    with pytest.raises(common.BadImageError, match="notes.jpg"):
        common.load_image(text)


# ================================================================================================
# 5. Distributed helpers
# ================================================================================================
def test_all_reduce_helpers_without_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not common.is_dist()
    assert common.get_rank() == 0 and common.get_world_size() == 1 and common.is_main_process()
    t = torch.tensor([1.5, -2.0, 3.0])
    assert torch.equal(common.all_reduce_sum(t), t)
    assert common.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert common.init_distributed("cpu") == torch.device("cpu") and not common.is_dist()


def test_a_successful_main_shuts_its_process_group_down(tmp_path):
    """Every script runs main() through common.run_script(): after success the process group is
    destroyed (gloo left to the interpreter's exit can abort the process); after an error it is left
    alone, since another process may still be in a collective."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this session")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        def mistake(args):
            common.die("a user mistake")

        def success(args):
            assert common.all_gather_objects(1) == [1]
        with pytest.raises(SystemExit):
            common.run_script(mistake, argparse.ArgumentParser(), argv=[])
        assert common.is_dist()
        common.run_script(success, argparse.ArgumentParser(), argv=[])
        assert not common.is_dist()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_all_reduce_helpers_in_a_one_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this session")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert common.is_dist() and common.get_world_size() == 1
        t = torch.tensor([1.0, 2.0])
        s = common.all_reduce_sum(t)
        assert torch.equal(s, t) and s is not t  # a new tensor, the input untouched
        assert common.all_gather_objects(7) == [7]
    finally:
        dist.destroy_process_group()
    assert not common.is_dist()


# ================================================================================================
# 6. Training utilities
# ================================================================================================
@pytest.mark.parametrize("case", REFERENCE["cosine_scheduler"], ids=lambda c: c["name"])
def test_cosine_scheduler_matches_authors(case):
    got = common.cosine_scheduler(case["base_value"], case["final_value"], case["epochs"], case["niter_per_ep"],
                                  warmup_epochs=case["warmup_epochs"],
                                  start_warmup_value=case["start_warmup_value"])
    np.testing.assert_allclose(got, case["expected"].numpy(), rtol=0, atol=1e-12)


def test_cosine_scheduler_warmup_and_end_by_hand():
    s = common.cosine_scheduler(0.5, 0.1, epochs=10, niter_per_ep=4, warmup_epochs=2, start_warmup_value=0.01)
    assert len(s) == 40
    np.testing.assert_allclose(s[:8], np.linspace(0.01, 0.5, 8))  # endpoint base included
    assert s[8] == pytest.approx(0.5)  # cosine starts at base
    assert s[-1] == pytest.approx(0.1 + 0.2 * (1 + math.cos(math.pi * 31 / 32)))
    assert s[-1] > 0.1  # final is approached, never reached
    assert np.all(np.diff(s[8:]) < 0)
    one = common.cosine_scheduler(0.5, 0.1, epochs=6, niter_per_ep=1, warmup_epochs=1)
    assert one[0] == 0.0 and one[1] == pytest.approx(0.5)  # a 1-step warm-up is [start]


def test_teacher_temperature_schedule():
    s = common.teacher_temperature_schedule(0.04, 0.07, 20, 60)
    assert len(s) == 60 and s[0] == pytest.approx(0.04) and s[19] == pytest.approx(0.07)
    assert np.all(s[19:] == 0.07)
    # temperatures the authors' DINOLoss used (dino.pt, dino_loss cases mc8_warmup_epoch9 and mc5_B2_D96_epoch3)
    assert s[9] == pytest.approx(0.05421052631578948, abs=1e-15)
    assert common.teacher_temperature_schedule(0.03, 0.05, 8, 16)[3] == pytest.approx(0.038571428571428576, abs=1e-15)
    flat = common.teacher_temperature_schedule(0.04, 0.04, 0, 100)
    assert len(flat) == 100 and np.all(flat == 0.04)


def test_teacher_temperature_schedule_per_step():
    """One value per iteration: whole warm-up epochs ramp per epoch (the authors' code), a fraction
    of an epoch ramps per step, and a warm-up longer than the run is cut where the run ends."""
    per_epoch = common.teacher_temperature_schedule(0.04, 0.07, 20, 60)
    per_step = common.teacher_temperature_schedule(0.04, 0.07, 20, 60, niter_per_ep=3)
    assert len(per_step) == 180 and np.array_equal(per_step, np.repeat(per_epoch, 3))
    half = common.teacher_temperature_schedule(0.04, 0.01, 0.5, 1, niter_per_ep=10)
    np.testing.assert_allclose(half, [0.04, 0.0325, 0.025, 0.0175, 0.01] + [0.01] * 5, rtol=0, atol=1e-15)
    two_and_half = common.teacher_temperature_schedule(0.04, 0.07, 2.5, 4, niter_per_ep=2)
    np.testing.assert_allclose(two_and_half, [0.04, 0.0475, 0.055, 0.0625, 0.07, 0.07, 0.07, 0.07], atol=1e-15)
    cut = common.teacher_temperature_schedule(0.04, 0.07, 30, 2, niter_per_ep=4)
    assert len(cut) == 8 and np.all(cut[:4] == 0.04) and cut[4] == pytest.approx(0.04 + 0.03 / 29)


class Wrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head


@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_params_groups(norm_last_layer):
    """Same groups as the authors' utils.get_params_groups on MultiCropWrapper(vit_tiny, DINOHead(192, 64))
    (dino.pt param_groups: 55 / 56 decayed names, 102 not decayed, weight_g frozen or decayed)."""
    with torch.device("meta"):
        model = Wrapper(common.build_backbone("vit_tiny"), common.DINOHead(192, 64, norm_last_layer=norm_last_layer))
    groups = common.get_params_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = [names[id(p)] for p in groups[0]["params"]]
    not_decayed = [names[id(p)] for p in groups[1]["params"]]
    assert "weight_decay" not in groups[0] and groups[1]["weight_decay"] == 0.0
    blocks = [f"backbone.blocks.{i}." for i in range(12)]
    expected_decayed = (["backbone.cls_token", "backbone.pos_embed", "backbone.patch_embed.proj.weight"]
                        + [b + m for b in blocks for m in ("attn.qkv.weight", "attn.proj.weight",
                                                           "mlp.fc1.weight", "mlp.fc2.weight")]
                        + ["head.mlp.0.weight", "head.mlp.2.weight", "head.mlp.4.weight"]
                        + ([] if norm_last_layer else ["head.last_layer.weight_g"]) + ["head.last_layer.weight_v"])
    expected_not = (["backbone.patch_embed.proj.bias"]
                    + [b + m for b in blocks for m in ("norm1.weight", "norm1.bias", "attn.qkv.bias",
                                                       "attn.proj.bias", "norm2.weight", "norm2.bias",
                                                       "mlp.fc1.bias", "mlp.fc2.bias")]
                    + ["backbone.norm.weight", "backbone.norm.bias", "head.mlp.0.bias", "head.mlp.2.bias",
                       "head.mlp.4.bias"])
    assert sorted(decayed) == sorted(expected_decayed) and len(decayed) == (55 if norm_last_layer else 56)
    assert sorted(not_decayed) == sorted(expected_not) and len(not_decayed) == 102
    assert ("head.last_layer.weight_g" in decayed) == (not norm_last_layer)  # frozen: in neither group
    assert "head.last_layer.weight_g" not in not_decayed


class FiveParams(nn.Module):
    """Parameters a (4,5), b (7,), c (3,3,2), d (6,), e (2,2) as in the authors' clip_gradients case."""

    def __init__(self):
        super().__init__()
        for name, shape in (("a", (4, 5)), ("b", (7,)), ("c", (3, 3, 2)), ("d", (6,)), ("e", (2, 2))):
            setattr(self, name, nn.Parameter(torch.zeros(shape)))


def test_clip_gradients_per_parameter_matches_authors():
    ref = REFERENCE["clip_gradients"]
    model = FiveParams()
    for name, p in model.named_parameters():
        p.grad = ref["grads_before"][name].clone() if name in ref["grads_before"] else None
    assert ref["param_without_grad"] == "d"
    norms = common.clip_gradients(model, ref["clip"])
    np.testing.assert_allclose(norms, ref["expected_returned_norms"], rtol=1e-6)
    assert model.d.grad is None
    for name in ref["param_names"]:
        torch.testing.assert_close(getattr(model, name).grad, ref["expected_grads_after"][name], rtol=0, atol=1e-6)
    # per tensor, not global: small gradients untouched, large ones clipped to 3 each
    assert torch.equal(model.b.grad, ref["grads_before"]["b"])
    after = [getattr(model, n).grad.norm().item() for n in ref["param_names"]]
    assert after[0] == pytest.approx(3.0, rel=1e-5) and after[2] == pytest.approx(3.0, rel=1e-5)
    assert math.sqrt(sum(v * v for v in after)) > 3.0


def test_cancel_gradients_last_layer_keeps_weights_still():
    torch.manual_seed(0)
    model = Wrapper(nn.Linear(6, 8), common.DINOHead(8, 5, norm_last_layer=False, hidden_dim=16, bottleneck_dim=4))

    def step(epoch):
        opt = torch.optim.AdamW(common.get_params_groups(model), lr=0.1, weight_decay=0.5)
        opt.zero_grad()
        model.head(model.backbone(torch.randn(4, 6))).pow(2).sum().backward()
        common.cancel_gradients_last_layer(epoch, model, freeze_last_layer=1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters()}
        opt.step()
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        return grads, changed

    grads, changed = step(epoch=0)
    assert grads["head.last_layer.weight_v"] is None and grads["head.last_layer.weight_g"] is None
    assert grads["head.mlp.0.weight"] is not None and grads["backbone.weight"] is not None
    assert "head.last_layer.weight_v" not in changed and "head.last_layer.weight_g" not in changed
    assert {"head.mlp.0.weight", "backbone.weight"} <= changed
    grads, changed = step(epoch=1)
    assert grads["head.last_layer.weight_v"] is not None
    assert {"head.last_layer.weight_v", "head.last_layer.weight_g"} <= changed


def test_update_teacher_ema():
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    teacher = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    with torch.no_grad():
        for p in teacher.parameters():
            p.normal_()
        for p in student.parameters():
            p.normal_()
    s0 = {n: p.detach().clone() for n, p in student.named_parameters()}
    t0 = {n: p.detach().clone() for n, p in teacher.named_parameters()}

    class DDPLike(nn.Module):  # the student is wrapped in DistributedDataParallel during training
        def __init__(self, module):
            super().__init__()
            self.module = module

    common.update_teacher(DDPLike(student), teacher, 0.9)
    for n, p in teacher.named_parameters():
        torch.testing.assert_close(p, 0.9 * t0[n] + 0.1 * s0[n], rtol=0, atol=1e-7)
        assert not p.requires_grad or p.grad is None
    for n, p in student.named_parameters():
        assert torch.equal(p, s0[n])
    t1 = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    common.update_teacher(student, teacher, 1.0)
    assert all(torch.equal(p, t1[n]) for n, p in teacher.named_parameters())
    common.update_teacher(student, teacher, 0.0)
    assert all(torch.equal(p, s0[n]) for n, p in teacher.named_parameters())


def test_autocast_precisions():
    cpu = torch.device("cpu")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with common.autocast(cpu, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with common.autocast(cpu, "fp32"):
        assert (a @ b).dtype == torch.float32
    with common.autocast(cpu, "fp16"):             # on CPU too, so the grad-scaler path is testable
        assert (a @ b).dtype == torch.float16
    assert common.make_grad_scaler(cpu, "fp16").is_enabled()
    assert not common.make_grad_scaler(cpu, "bf16").is_enabled()


# (device, torch's CPU capability, cpuinfo's bf16 flags, the GPU computes bf16 natively, arch) -> auto's pick
PRECISION_CASES = {
    "Zen 4 / Cooper Lake: AVX512-BF16": ("cpu", "AVX512", {"avx512_bf16": True}, False, "vit_small", "bf16"),
    "Sapphire Rapids: AMX-BF16": ("cpu", "AVX512", {"amx_bf16": True}, False, "vit_small", "bf16"),
    "native bf16, a pico model too": ("cpu", "AVX512", {"amx_bf16": True}, False, "swin_pico", "bf16"),
    "Skylake: AVX-512 without bf16": ("cpu", "AVX512", {}, False, "vit_small", "fp32"),
    "EPYC with AVX2 only": ("cpu", "AVX2", {}, False, "vit_small", "fp32"),
    "no vector unit torch uses": ("cpu", "DEFAULT", {}, False, "vit_small", "fp32"),
    "Ampere or newer GPU": ("cuda", "AVX2", {}, True, "vit_small", "bf16"),
    "V100: bf16 only emulated": ("cuda", "AVX512", {"avx512_bf16": True}, False, "vit_pico", "fp16"),
}


def mock_hardware(monkeypatch, capability, cpu_flags, gpu_bf16):
    """What torch reports about the CPU and the GPU, as `common.choose_precision` asks it. The mocked
    GPU says yes to bf16 with emulation (as a V100 does) and natively only when `gpu_bf16`."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": capability != "DEFAULT", **cpu_flags})
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or gpu_bf16)


@pytest.mark.parametrize("case", PRECISION_CASES)
def test_precision_auto_follows_the_hardware_and_says_why(monkeypatch, capsys, case):
    device, capability, cpu_flags, gpu_bf16, arch, expected = PRECISION_CASES[case]
    mock_hardware(monkeypatch, capability, cpu_flags, gpu_bf16)
    precision, auto = common.resolve_precision("auto", torch.device(device))
    assert (precision, auto) == (expected, True)
    (line,) = capsys.readouterr().out.splitlines()              # one line, with the reason
    assert line.startswith(f"precision: {expected} (--precision auto: ")
    if device == "cpu" and not cpu_flags:
        assert f"capability {capability}" in line and "no native bf16" in line and "25x slower" in line
    assert common.make_grad_scaler(torch.device("cpu"), precision).is_enabled() == (expected == "fp16")


def test_choose_precision_asks_the_device_it_runs_on(monkeypatch):
    mock_hardware(monkeypatch, "AVX512", {"avx512_bf16": True}, False)
    assert common.choose_precision(torch.device("cuda", 0))[0] == "fp16"     # the CPU's bf16 is no GPU's
    mock_hardware(monkeypatch, "AVX2", {}, True)
    assert common.choose_precision(torch.device("cpu"))[0] == "fp32"         # nor the GPU's the CPU's
    assert common.choose_precision(torch.device("meta")) == ("fp32", "no mixed-precision rule for meta devices")


def test_explicit_bf16_on_a_cpu_without_native_bf16_runs_after_one_warning(monkeypatch, capsys):
    mock_hardware(monkeypatch, "AVX2", {}, False)
    assert common.resolve_precision("bf16", torch.device("cpu")) == ("bf16", False)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("warning: --precision bf16: this CPU has no native bf16 (torch CPU capability AVX2")
    assert "25x slower than fp32" in line and "--precision auto picks fp32" in line
    for precision, flags in (("bf16", {"amx_bf16": True}), ("fp32", {}), ("fp16", {})):   # nothing to warn about
        mock_hardware(monkeypatch, "AVX512", flags, False)
        resolved = common.resolve_precision(precision, torch.device("cpu"))
        assert (resolved, capsys.readouterr().out) == ((precision, False), "")


def test_fp16_gradient_overflow_skips_the_step_and_lowers_the_scale():
    """The update sequence of every training loop (scale, backward, unscale, per-parameter clip,
    step, update) with a scale so large that the fp16 gradients overflow: no parameter moves, the
    scale halves, and the next step (finite gradients) updates as usual."""
    torch.manual_seed(0)
    model, cpu = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)), torch.device("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)   # 2^40 * grad is inf in fp16
    x = torch.randn(16, 8)

    def step():
        with common.autocast(cpu, "fp16"):
            loss = model(x).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        common.clip_gradients(model, 3.0)
        scaler.step(optimizer)
        scaler.update()

    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # skipped
    assert scaler.get_scale() == 2.0 ** 39
    scaler.update(2.0 ** 4)                                                     # a sane scale
    step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ================================================================================================
# 7. Checkpoints
# ================================================================================================
def checkpoint_state(seed):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"student": model.state_dict(), "optimizer": opt.state_dict(), "epoch": seed,
            "args": {"arch": "vit_small", "lr": 5e-4, "global_crops_scale": [0.4, 1.0], "data_path": None},
            "dino_loss": {"center": torch.randn(1, 8)}, "rng": common.rng_state()}


def test_save_checkpoint_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pth"
    first = checkpoint_state(1)
    common.save_checkpoint(first, path)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]  # no temporary file left
    assert_same(torch.load(path, weights_only=True), first)
    second = checkpoint_state(2)
    common.save_checkpoint(second, path)
    assert_same(common.load_checkpoint(path), second)

    real_save = torch.save

    def crashing_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")  # partial bytes, then the process "dies"
        raise RuntimeError("simulated crash mid-write")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(RuntimeError, match="simulated crash"):
        common.save_checkpoint(checkpoint_state(3), path)
    monkeypatch.setattr(torch, "save", real_save)
    assert_same(torch.load(path, weights_only=True), second)  # the last good checkpoint survives


def test_load_checkpoint_error_names_file(tmp_path):
    bad = tmp_path / "checkpoint.pth"
    bad.write_bytes(b"garbage")
    with pytest.raises(SystemExit, match=re.escape(str(bad))):
        common.load_checkpoint(bad)


def test_load_checkpoint_reads_the_legacy_format_and_names_a_picture(tmp_path):
    """Released weights from before torch 1.6 are a pickle, not a zip archive: read them; an image is refused by name."""
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert torch.equal(common.load_checkpoint(tmp_path / "legacy.pth")["w"], torch.ones(2))
    Image.new("RGB", (4, 4)).save(tmp_path / "picture.pth", format="PNG")
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path / 'picture.pth'} is not a PyTorch file")):
        common.load_checkpoint(tmp_path / "picture.pth")


def test_rng_state_roundtrip_through_weights_only_load(tmp_path):
    np.random.randn(1)  # leaves a cached Gaussian in numpy's state
    random.gauss(0, 1)  # and in Python's
    torch.manual_seed(5)
    state = common.rng_state()
    draws = (torch.rand(3), np.random.randn(3), np.random.randint(0, 10 ** 6, 3), random.random(), random.gauss(0, 1))
    common.save_checkpoint({"rng": state}, tmp_path / "rng.pth")
    loaded = torch.load(tmp_path / "rng.pth", weights_only=True)["rng"]
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    common.set_rng_state(loaded)
    again = (torch.rand(3), np.random.randn(3), np.random.randint(0, 10 ** 6, 3), random.random(), random.gauss(0, 1))
    assert torch.equal(draws[0], again[0])
    assert np.array_equal(draws[1], again[1]) and np.array_equal(draws[2], again[2])
    assert draws[3] == again[3] and draws[4] == again[4]


def test_load_state_dict_strict_reports_keys():
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    good = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    common.load_state_dict_strict(model, good)
    assert torch.equal(model[0].weight, torch.full((2, 3), 0.5))
    broken = dict(good)
    del broken["1.bias"]
    broken["head.extra"] = torch.zeros(1)
    with pytest.raises(SystemExit) as info:
        common.load_state_dict_strict(model, broken, what="teacher")
    message = str(info.value)
    assert "teacher" in message and "missing: [1.bias]" in message and "unexpected: [head.extra]" in message
    wrong_shape = dict(good, **{"0.weight": torch.zeros(4, 3)})
    with pytest.raises(SystemExit, match=r"0\.weight: \(4, 3\) vs \(2, 3\)"):
        common.load_state_dict_strict(model, wrong_shape)
