"""eval_knn.py and eval_linear.py: the weighted k-NN vote against a naive per-sample statement and
the DINO authors' numbers, strict loading of every supported checkpoint layout, the linear-probe
features (ViT and Swin), the linear probe's training, both scripts end to end on `synthetic`, and
extras/tools/teacher_outputs.py (its statistics against a loop, and its teacher against dino.py's model).

tests/data/eval_knn_reference.pt holds inputs and outputs of the DINO authors' knn_classifier
(facebookresearch/dino @ 7c446df5, eval_knn.py; see its "source" entry).
"""
import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import eval_knn  # noqa: E402
import eval_linear  # noqa: E402
from conftest import finish, one_thread, run_here, start  # noqa: E402

sys.path.append(str(ROOT / "extras" / "tools"))
import teacher_outputs  # noqa: E402

KNN_REFERENCE = torch.load(ROOT / "tests/data/eval_knn_reference.pt", weights_only=True)
DATA = ["--dataset", "synthetic", "--synthetic_images", "70", "--synthetic_image_size", "32",
        "--resize", "32", "--crop", "32", "--batch_size_per_gpu", "8", "--num_workers", "0"]


# ================================================================================================
# Weighted k-NN
# ================================================================================================
def naive_knn_vote(train_features, train_labels, x, k, T):
    """One test feature: sort every train image by cosine similarity, let the k first vote
    exp(sim / T) for their label. Returns {class: score} of the classes that got votes."""
    sims = [(float(x @ f), int(c)) for f, c in zip(train_features, train_labels)]
    sims.sort(key=lambda s: -s[0])
    scores = {}
    for sim, c in sims[:k]:
        scores[c] = scores.get(c, 0.0) + math.exp(sim / T)
    return scores


@pytest.mark.parametrize("num_classes, k, T", [(3, 1, 0.07), (3, 10, 0.5), (6, 20, 0.07), (12, 7, 0.1), (12, 40, 0.07),
                                                (6, 20, 0.005), (12, 40, 0.01)])  # exp(1 / T) past float32
def test_knn_matches_naive_vote(num_classes, k, T):
    g = torch.Generator().manual_seed(num_classes * 100 + k)
    train = F.normalize(torch.randn(60, 8, generator=g), dim=1)
    test = F.normalize(torch.randn(37, 8, generator=g), dim=1)   # fewer than 100 test rows
    train_labels = torch.randint(0, num_classes, (60,), generator=g)
    test_labels = torch.randint(0, num_classes, (37,), generator=g)
    correct1 = []
    for i in range(len(test)):
        scores = naive_knn_vote(train, train_labels, test[i], k, T)
        target = int(test_labels[i])
        higher = sum(s > scores.get(target, 0.0) for s in scores.values())
        correct1.append(target in scores and higher == 0)
        top1, top5 = eval_knn.knn_classifier(train, train_labels, test[i:i + 1], test_labels[i:i + 1], k, T, num_classes)
        assert top1 == 100.0 * correct1[-1]
        if num_classes < 5:
            assert top5 is None
        elif target in scores or len(scores) >= min(5, k):  # no tie among zero-vote classes decides it
            assert top5 == 100.0 * (target in scores and higher < min(5, k))
    for chunk_size in (1, 5, 256):   # chunking changes nothing
        top1, _ = eval_knn.knn_classifier(train, train_labels, test, test_labels, k, T, num_classes, chunk_size)
        assert top1 == pytest.approx(100.0 * sum(correct1) / len(test), abs=1e-9)


def test_knn_matches_authors_code():
    r = KNN_REFERENCE
    for case in r["results"]:
        for chunk_size in (7, 256):
            top1, top5 = eval_knn.knn_classifier(r["train_features"], r["train_labels"], r["test_features"],
                                                 r["test_labels"], case["k"], case["T"], case["num_classes"], chunk_size)
            assert top1 == pytest.approx(case["expected_top1"], abs=1e-9)
            assert top5 == pytest.approx(case["expected_top5"], abs=1e-9)


def test_knn_separable_features_are_perfect():
    g = torch.Generator().manual_seed(0)
    centers = torch.eye(16)[:7]                                      # 7 orthogonal class directions
    train_labels, test_labels = torch.arange(70) % 7, torch.arange(21) % 7
    train = F.normalize(centers[train_labels] + 0.05 * torch.randn(70, 16, generator=g), dim=1)
    test = F.normalize(centers[test_labels] + 0.05 * torch.randn(21, 16, generator=g), dim=1)
    for k, T in (1, 0.07), (10, 0.07), (20, 0.07), (20, 0.01), (20, 1e-4):   # 0.01 overflowed float32: 0%
        assert eval_knn.knn_classifier(train, train_labels, test, test_labels, k, T, 7) == (100.0, 100.0)
    wrong = (test_labels + 1) % 7                                    # and the test can fail
    assert eval_knn.knn_classifier(train, train_labels, test, wrong, 10, 0.07, 7)[0] == 0.0


def test_gather_rows_single_process_is_identity():
    a, b = torch.randn(5, 3), torch.arange(5)
    out = eval_knn.all_gather_rows(a, b)
    assert out[0] is a and out[1] is b


# Defaults of the authors' argparse (facebookresearch/dino @ 7c446df5, eval_knn.py and eval_linear.py)
# for the options both share with this repository's scripts.
AUTHORS_KNN_DEFAULTS = {"batch_size_per_gpu": 128, "nb_knn": [10, 20, 100, 200], "temperature": 0.07,
                        "pretrained_weights": "", "arch": "vit_small", "patch_size": 16, "checkpoint_key": "teacher",
                        "dump_features": None, "load_features": None, "num_workers": 10}
AUTHORS_LINEAR_DEFAULTS = {"n_last_blocks": 4, "avgpool_patchtokens": False, "arch": "vit_small", "patch_size": 16,
                           "pretrained_weights": "", "checkpoint_key": "teacher", "epochs": 100, "lr": 0.001,
                           "batch_size_per_gpu": 128, "num_workers": 10, "val_freq": 1, "output_dir": "."}


def test_argparse_defaults_match_authors():
    knn = vars(eval_knn.get_args_parser().parse_args([]))
    linear = vars(eval_linear.get_args_parser().parse_args([]))
    assert {k: knn[k] for k in AUTHORS_KNN_DEFAULTS} == AUTHORS_KNN_DEFAULTS
    assert {k: linear[k] for k in AUTHORS_LINEAR_DEFAULTS} == AUTHORS_LINEAR_DEFAULTS
    assert (knn["resize"], knn["crop"]) == (linear["resize"], linear["crop"]) == (256, 224)


# ================================================================================================
# Loading checkpoints
# ================================================================================================
@pytest.fixture(scope="module")
def dino_run(tmp_path_factory):
    """A tiny DINO run written by dino.py itself (in this process): checkpoint.pth and teacher_backbone.pth."""
    out = tmp_path_factory.mktemp("dino")
    proc = run_here("dino.py", "--arch", "vit_pico", "--dataset", "synthetic", "--synthetic_images", "64",
                    "--synthetic_image_size", "32", "--global_crop_size", "32", "--local_crop_size", "16",
                    "--local_crops_number", "2", "--out_dim", "64", "--batch_size_per_gpu", "8", "--epochs", "1",
                    "--warmup_epochs", "0", "--max_steps_per_epoch", "2", "--num_workers", "0", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("key", ["teacher", "student"])
def test_load_full_checkpoint(dino_run, key):
    ckpt = torch.load(dino_run / "checkpoint.pth", weights_only=True)
    # the architecture comes from the checkpoint: the (wrong) flags are ignored
    model, info = eval_knn.load_backbone(str(dino_run / "checkpoint.pth"), key, arch="swin_pico", patch_size=8)
    assert info["arch"] == "vit_pico" and info["method"] == "dino" and isinstance(model, common.ViT)
    assert ckpt["backbone"] == {**model.build_config, "image_token": "backbone"}   # what rebuilt it
    expected = {k.removeprefix("backbone."): v for k, v in ckpt[key].items() if k.startswith("backbone.")}
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    with pytest.raises(SystemExit, match="checkpoint_key"):
        eval_knn.load_backbone(str(dino_run / "checkpoint.pth"), "ema")


def test_teacher_and_student_differ_after_training(dino_run):
    teacher, _ = eval_knn.load_backbone(str(dino_run / "checkpoint.pth"), "teacher")
    student, _ = eval_knn.load_backbone(str(dino_run / "checkpoint.pth"), "student")
    assert not torch.equal(teacher.blocks[0].attn.qkv.weight, student.blocks[0].attn.qkv.weight)


def test_load_teacher_backbone_needs_the_arch(dino_run):
    path = str(dino_run / "teacher_backbone.pth")
    model, info = eval_knn.load_backbone(path, arch="vit_pico", patch_size=16)
    ckpt = torch.load(dino_run / "checkpoint.pth", weights_only=True)
    assert torch.equal(model.pos_embed, ckpt["teacher"]["backbone.pos_embed"])
    with pytest.raises(SystemExit, match="does not match"):
        eval_knn.load_backbone(path, arch="vit_tiny", patch_size=16)


def test_load_timm_layout_state_dict(tmp_path):
    """A released DINO ViT file is a plain state dict in timm's layout: it loads strictly and gives
    timm's own output; a missing or an extra key is an error, not a partial load."""
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0).eval()
    torch.save(reference.state_dict(), tmp_path / "dino_vit.pth")
    model, _ = eval_knn.load_backbone(str(tmp_path / "dino_vit.pth"), arch="vit_tiny", patch_size=16)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-5)
    for edit in ("missing", "extra"):
        state = reference.state_dict()
        if edit == "missing":
            del state["blocks.3.mlp.fc1.bias"]
        else:
            state["blocks.3.extra"] = torch.zeros(1)
        torch.save(state, tmp_path / "bad.pth")
        with pytest.raises(SystemExit, match="blocks.3"):
            eval_knn.load_backbone(str(tmp_path / "bad.pth"), arch="vit_tiny", patch_size=16)


def official_swin_layout(timm_state):
    """Write a timm Swin state dict the way the EsViT / GLSD authors' checkpoints hold it: patch
    merging at the end of the previous stage, the relative-position buffers, DINO heads, and the
    `module.backbone.` prefixes of the wrapped teacher."""
    state = {}
    for k, v in timm_state.items():
        parts = k.split(".")
        if parts[0] == "layers" and parts[2] == "downsample":
            parts[1] = str(int(parts[1]) - 1)
        state["module.backbone." + ".".join(parts)] = v
        if k.endswith("attn.relative_position_bias_table"):
            state["module.backbone." + k.replace("bias_table", "index")] = torch.zeros(49, 49, dtype=torch.long)
    state["module.backbone.layers.0.blocks.1.attn_mask"] = torch.zeros(4, 49, 49)
    state["module.backbone.head.mlp.0.weight"] = torch.zeros(8, 256)
    state["module.backbone.head_dense.last_layer.weight_g"] = torch.ones(8, 1)
    return state


def test_load_esvit_swin_checkpoint(tmp_path):
    common.fix_random_seeds(0)
    reference = common.build_backbone("swin_pico").eval()
    state = official_swin_layout(reference.state_dict())
    assert "module.backbone.layers.0.downsample.reduction.weight" in state
    torch.save({"teacher": state, "student": {}, "epoch": 300}, tmp_path / "esvit.pth")
    model, _ = eval_knn.load_backbone(str(tmp_path / "esvit.pth"), "teacher", arch="swin_pico")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    with pytest.raises(SystemExit, match="does not match"):   # another Swin size is an error
        eval_knn.load_backbone(str(tmp_path / "esvit.pth"), "teacher", arch="swin_tiny")


def test_load_selfpatch_checkpoint(tmp_path):
    """SelfPatch's image token comes from its aggregation module, rebuilt by common.py from the
    checkpoint's "backbone" record, or from its args for checkpoints written before records."""
    import selfpatch
    args = selfpatch.get_args_parser().parse_args(["--arch", "vit_pico", "--out_dim", "16", "--patch_out_dim", "16"])
    common.fix_random_seeds(0)
    reference = selfpatch.build_model(args, 0.0).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        image_logits, _ = reference([x])
    record = common.backbone_record(reference.backbone, image_token="ca_head")
    for name, extra in (("recorded.pth", {"backbone": record}), ("before_records.pth", {})):
        torch.save({"teacher": reference.state_dict(), "student": reference.state_dict(), "args": vars(args),
                    "method": "selfpatch", **extra}, tmp_path / name)
        model, info = eval_knn.load_backbone(str(tmp_path / name), "teacher")
        assert info["method"] == "selfpatch" and isinstance(model, eval_knn.PooledViT)
        with torch.no_grad():
            torch.testing.assert_close(reference.c_head(model(x)), image_logits, rtol=0, atol=0)  # the image token
            random_model, _ = eval_knn.load_backbone(str(tmp_path / name), "teacher", random_init=True)
            assert not torch.allclose(random_model(x), model(x))


def test_backbone_record_rebuilds_what_args_cannot_tell(tmp_path):
    """A DRLoc ViT trained at 32 px has a 4x4 position embedding: its record says so, and loading
    rebuilds it (with the record's LayerNorm eps), where the args alone would give a 224 px ViT."""
    common.fix_random_seeds(0)
    backbone = common.build_backbone("vit_pico", 8, img_size=32, layer_norm_eps=1e-5).eval()
    torch.save({"model": {f"backbone.{k}": v for k, v in backbone.state_dict().items()}, "method": "drloc",
                "args": {"arch": "vit_pico", "patch_size": 8}, "backbone": common.backbone_record(backbone)},
               tmp_path / "checkpoint.pth")
    model, info = eval_knn.load_backbone(str(tmp_path / "checkpoint.pth"), "model")
    assert info == {"method": "drloc", "arch": "vit_pico", "patch_size": 8, "window_size": 7}
    assert model.norm.eps == 1e-5 and model.pos_embed.shape == backbone.pos_embed.shape
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), backbone(x), rtol=0, atol=0)


def test_random_init_and_missing_weights():
    common.fix_random_seeds(0)
    a, info = eval_knn.load_backbone("", arch="vit_pico", random_init=True)
    common.fix_random_seeds(0)
    b, _ = eval_knn.load_backbone("", arch="vit_pico", random_init=True)
    assert info["method"] == "random" and torch.equal(a.pos_embed, b.pos_embed)
    with pytest.raises(SystemExit, match="--pretrained_weights"):
        eval_knn.load_backbone("", arch="vit_pico")


# ================================================================================================
# Linear-probe features
# ================================================================================================
def block_outputs(blocks, run):
    """Outputs of each module in `blocks` during `run()`, through forward hooks."""
    outputs = []
    handles = [b.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in blocks]
    run()
    for h in handles:
        h.remove()
    return outputs


def test_vit_linear_features():
    common.fix_random_seeds(0)
    vit = common.build_backbone("vit_pico").eval()
    x = torch.randn(3, 3, 32, 48)
    with torch.no_grad():
        outputs = block_outputs(vit.blocks, lambda: vit(x))
        feats = eval_linear.vit_features(vit, x, 3)
        expected = torch.cat([vit.norm(o)[:, 0] for o in outputs[-3:]], dim=1)
        torch.testing.assert_close(feats, expected, rtol=0, atol=1e-6)
        both = eval_linear.vit_features(vit, x, 1, avgpool_patchtokens=True)    # the authors' interleaved layout
        cls, grid = vit.forward_dense(x)
        assert both.shape == (3, 128)
        torch.testing.assert_close(both[:, 0::2], cls, rtol=0, atol=1e-6)
        torch.testing.assert_close(both[:, 1::2], grid.mean(dim=(1, 2)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch, n, dim", [("swin_pico", 4, 128 + 128 + 256 + 256), ("swin_pico", 5, 64 + 768),
                                          ("swin_tiny", 4, 384 + 384 + 768 + 768)])
def test_swin_linear_features(arch, n, dim):
    common.fix_random_seeds(0)
    swin = common.build_backbone(arch).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        blocks = [b for stage in swin.layers for b in stage.blocks]
        last_stage = set(map(id, swin.layers[-1].blocks))
        outputs = block_outputs(blocks, lambda: swin(x))
        feats = eval_linear.swin_features(swin, x, n)
        expected = torch.cat([(swin.norm(o) if id(b) in last_stage else o).mean(dim=(1, 2))
                              for b, o in zip(blocks[-n:], outputs[-n:])], dim=1)
    assert feats.shape == (2, dim)
    torch.testing.assert_close(feats, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(feats[:, -swin.num_features:], swin(x), rtol=0, atol=1e-6)


def test_feature_arguments_are_checked():
    vit, swin = common.build_backbone("vit_pico"), common.build_backbone("swin_pico")
    with pytest.raises(SystemExit, match="n_last_blocks 1"):
        eval_linear.check_feature_args(vit, argparse.Namespace(n_last_blocks=4, avgpool_patchtokens=True))
    with pytest.raises(SystemExit, match="out of range"):
        eval_linear.check_feature_args(vit, argparse.Namespace(n_last_blocks=5, avgpool_patchtokens=False))
    with pytest.raises(SystemExit, match="avgpool_patchtokens"):
        eval_linear.check_feature_args(swin, argparse.Namespace(n_last_blocks=1, avgpool_patchtokens=True))
    eval_linear.check_feature_args(swin, argparse.Namespace(n_last_blocks=8, avgpool_patchtokens=False))
    pooled = torch.nn.Identity()                  # neither: SelfPatch's network, read through its aggregation head
    with pytest.raises(SystemExit, match="SelfPatch's is its aggregation head's image token"):     # was ignored
        eval_linear.check_feature_args(pooled, argparse.Namespace(n_last_blocks=4, avgpool_patchtokens=True))
    eval_linear.check_feature_args(pooled, argparse.Namespace(n_last_blocks=4, avgpool_patchtokens=False))


# ================================================================================================
# The linear probe's training
# ================================================================================================
def test_linear_probe_learns_separable_features():
    """train_one_epoch + validate on features that are linearly separable (an identity "backbone")."""
    g = torch.Generator().manual_seed(0)
    centers = 3 * torch.randn(6, 12, generator=g)
    labels = torch.arange(300) % 6
    features = centers[labels] + torch.randn(300, 12, generator=g)
    train = torch.utils.data.TensorDataset(features[:240], labels[:240])
    val = torch.utils.data.TensorDataset(features[240:], labels[240:], torch.arange(60))
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=g)
    val_loader = torch.utils.data.DataLoader(val, batch_size=32)
    args = argparse.Namespace(max_steps_per_epoch=0, n_last_blocks=1, avgpool_patchtokens=False)
    classifier = eval_linear.LinearClassifier(12, 6)
    assert classifier.linear.weight.std().item() == pytest.approx(0.01, rel=0.2)
    assert torch.equal(classifier.linear.bias, torch.zeros(6))
    optimizer = torch.optim.SGD(classifier.parameters(), lr=0.05, momentum=0.9, weight_decay=0)
    before = eval_linear.validate(torch.nn.Identity(), classifier, val_loader, 60, 6, args, torch.device("cpu"))
    for epoch in range(15):
        record = eval_linear.train_one_epoch(torch.nn.Identity(), classifier, loader, optimizer, epoch,
                                             range(len(loader)), args, torch.device("cpu"), save=None)
    after = eval_linear.validate(torch.nn.Identity(), classifier, val_loader, 60, 6, args, torch.device("cpu"))
    assert after["val_top1"] >= 95.0 and after["val_top5"] == 100.0
    assert after["val_loss"] < before["val_loss"] and record["train_loss"] < 0.5


def test_cached_feature_batches_shuffle_per_epoch_and_drop_the_last():
    features, labels = torch.arange(70.0)[:, None].repeat(1, 3), torch.arange(70) % 7
    cached = eval_linear.CachedFeatures(features, labels, 16, seed=3)
    epochs = [cached.batches(epoch) for epoch in range(3)]
    for batches in epochs:
        assert [len(x) for x, _ in batches] == [16] * 4                  # 70 images: 4 full batches
        rows = torch.cat([x[:, 0] for x, _ in batches]).long()
        assert len(set(rows.tolist())) == 64                             # no image twice in an epoch
        assert torch.equal(torch.cat([y for _, y in batches]), rows % 7)  # each feature keeps its label
    assert [x.tolist() for x, _ in epochs[0]] == [x.tolist() for x, _ in cached.batches(0)]   # (seed, epoch) decides
    assert epochs[0][0][0].tolist() != epochs[1][0][0].tolist()
    with pytest.raises(SystemExit, match="fewer than one batch"):
        eval_linear.CachedFeatures(features[:10], labels[:10], 16, seed=0)


def test_extracted_features_are_the_probe_features_of_the_eval_crops():
    torch.manual_seed(0)
    vit = common.build_backbone("vit_pico", patch_size=4, img_size=32).eval()
    dataset = common.build_dataset(eval_linear.get_args_parser().parse_args(DATA), train=True)
    args = eval_linear.get_args_parser().parse_args(["--n_last_blocks", "2", *DATA])
    features, labels, unreadable = eval_linear.extract_features(vit, dataset, args, torch.device("cpu"))
    assert features.shape == (70, 128) and unreadable == 0
    transform = common.eval_transform(32, 32)
    for i in (0, 33, 69):
        image, label = dataset[i]
        expected = eval_linear.vit_features(vit, transform(image)[None], 2)[0]
        torch.testing.assert_close(features[i], expected, rtol=1e-4, atol=1e-5)
        assert labels[i] == label


# ================================================================================================
# Both scripts end to end
# ================================================================================================
def test_eval_knn_end_to_end(dino_run, tmp_path):
    """Two processes (torchrun, gloo on CPU) through a subprocess give the features, in dataset
    order, of one process; --load_features reproduces the results without a model."""
    proc = start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "eval_knn.py",
                 "--pretrained_weights", str(dino_run / "checkpoint.pth"), "--nb_knn", "5", "20",
                 "--dump_features", str(tmp_path / "two"), *DATA)
    args = eval_knn.get_args_parser().parse_args(["--pretrained_weights", str(dino_run / "checkpoint.pth"),
                                                  "--nb_knn", "5", "20", "--dump_features", str(tmp_path / "one"), *DATA])
    with one_thread():
        results = eval_knn.main(args)        # one process, while the two run
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "20-NN classifier result: top-1" in proc.stdout

    for name in eval_knn.FEATURE_FILES:
        one, two = (torch.load(tmp_path / d / name, weights_only=True) for d in ("one", "two"))
        assert one.shape[0] == (70 if name.startswith("train") else 17)
        torch.testing.assert_close(one, two, rtol=0, atol=1e-5)
    labels = torch.load(tmp_path / "one" / "trainlabels.pth", weights_only=True)
    assert labels.tolist() == [i % 10 for i in range(70)]     # dataset order
    feats = torch.load(tmp_path / "one" / "trainfeat.pth", weights_only=True)
    torch.testing.assert_close(feats.norm(dim=1), torch.ones(70))
    for k, (top1, _) in results.items():
        assert f"{k}-NN classifier result: top-1 {top1:.2f}%" in proc.stdout

    args = eval_knn.get_args_parser().parse_args(["--load_features", str(tmp_path / "one"), "--nb_knn", "5", "20"])
    assert eval_knn.main(args) == results


def test_eval_linear_end_to_end_and_resume(dino_run, tmp_path):
    out = tmp_path / "linear"
    common_args = ["--pretrained_weights", str(dino_run / "teacher_backbone.pth"), "--arch", "vit_pico",
                   "--n_last_blocks", "2", "--max_steps_per_epoch", "2", "--output_dir", str(out), *DATA]
    proc = run_here("eval_linear.py", "--epochs", "1", *common_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "linear probe on 128-dimensional features" in proc.stdout
    first = torch.load(out / "linear_checkpoint.pth", weights_only=True)
    assert first["epoch"] == 1 and first["linear"]["linear.weight"].shape == (10, 128)

    args = eval_linear.get_args_parser().parse_args(["--epochs", "2", "--val_freq", "5", *common_args])
    best = eval_linear.main(args)                                   # resumes at epoch 1, runs epoch 1 only
    records = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert "val_top1" in records[0] and "val_top1" in records[1]   # the last epoch is always validated
    second = torch.load(out / "linear_checkpoint.pth", weights_only=True)
    assert second["epoch"] == 2 and best == second["best_top1"] == max(r["val_top1"] for r in records)
    assert not torch.equal(first["linear"]["linear.weight"], second["linear"]["linear.weight"])
    lr = 0.001 * 8 / 256
    assert [r["lr"] for r in records] == pytest.approx([lr, lr / 2])  # cosine over the resumed run's 2 epochs


def test_eval_linear_on_precomputed_features(dino_run, tmp_path):
    def flags(precomputed, epochs, out):
        return ["--pretrained_weights", str(dino_run / "teacher_backbone.pth"), "--arch", "vit_pico", "--n_last_blocks",
                "1", "--precomputed_features", precomputed, "--epochs", str(epochs), "--val_freq", "3",
                "--output_dir", str(out), *DATA]
    # two processes (torchrun, gloo): each extracts its share of the features, every process gets all 70;
    # started first, checked last: one process runs in this one meanwhile
    proc = start("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "eval_linear.py",
                 *flags("true", 2, tmp_path / "cached_two"))
    out = tmp_path / "cached"
    with one_thread():
        best = eval_linear.main(eval_linear.get_args_parser().parse_args(flags("true", 3, out)))
    records = [json.loads(line) for line in (out / "log.txt").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1, 2] and best == records[-1]["best_top1"]
    assert all(r["train_loss"] > 0 and r["skipped_images"] == 0 for r in records)
    # a probe trained on precomputed features is not resumed on augmented crops
    with pytest.raises(SystemExit, match="--precomputed_features true"):
        eval_linear.main(eval_linear.get_args_parser().parse_args(flags("false", 4, out)))
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precomputed 70 train features" in proc.stdout
    out = tmp_path / "cached_two"
    assert [json.loads(line)["epoch"] for line in (out / "log.txt").read_text().splitlines()] == [0, 1]


# ================================================================================================
# extras/tools/teacher_outputs.py: how the teacher's image head spreads images over its K outputs
# ================================================================================================
def test_head_statistics_against_loop():
    torch.manual_seed(0)
    logits, center, temp = torch.randn(7, 11) * 3, torch.randn(1, 11), 0.5
    p = [[math.exp((logits[i, k] - center[0, k]) / temp) for k in range(11)] for i in range(7)]
    p = [[v / sum(row) for v in row] for row in p]
    h = sum(-sum(v * math.log(v) for v in row) for row in p) / 7
    mean = [sum(p[i][k] for i in range(7)) / 7 for k in range(11)]
    h_bar = -sum(v * math.log(v) for v in mean)
    used = len({max(range(11), key=row.__getitem__) for row in p})
    got = teacher_outputs.head_statistics(logits, center, temp)
    assert got[0] == pytest.approx(h, abs=1e-5) and got[1] == pytest.approx(h_bar, abs=1e-5) and got[2] == used
    # the two collapses: uniform targets (h = ln K), and one output winning for every image (h_bar -> 0)
    assert teacher_outputs.head_statistics(torch.zeros(5, 8), torch.zeros(1, 8), 0.04)[0] == pytest.approx(math.log(8))
    one = torch.zeros(5, 8)
    one[:, 3] = 10.0
    assert teacher_outputs.head_statistics(one, torch.zeros(1, 8), 0.04)[1:] == (pytest.approx(0.0, abs=1e-6), 1)


def test_teacher_outputs_of_a_dino_run(dino_run):
    """The script reassembles the teacher (backbone's CLS -> image head, centre, final temperature)
    exactly as dino.py's model computes it."""
    import dino  # the reference: the method's own model
    path = str(dino_run / "checkpoint.pth")
    args = teacher_outputs.get_args_parser().parse_args(["--pretrained_weights", path, "--max_images", "12", *DATA])
    got = teacher_outputs.main(args)
    ckpt = torch.load(path, weights_only=True)
    model = dino.build_model(argparse.Namespace(**ckpt["args"]), 0.0)
    model.load_state_dict(ckpt["teacher"])
    dataset = common.build_dataset(args, train=False)
    images = torch.stack([common.eval_transform(32, 32)(dataset[i][0]) for i in range(12)])
    with torch.no_grad():
        expected = teacher_outputs.head_statistics(model.eval()([images]), ckpt["dino_loss"]["center"],
                                                   ckpt["args"]["teacher_temp"])
    assert got[:2] == pytest.approx(expected[:2], abs=1e-4) and got[2] == expected[2]


def test_teacher_outputs_refuses_a_supervised_checkpoint():
    with pytest.raises(SystemExit, match="drloc checkpoint has no self-distillation image head"):
        teacher_outputs.load_teacher_head({"method": "drloc", "args": {}, "teacher": {}})
    with pytest.raises(SystemExit, match=r"lacks its teacher image head \(head.\*\) or its centre \(dino_loss\)"):
        teacher_outputs.load_teacher_head({"method": "dino", "args": {}, "teacher": {"backbone.x": torch.zeros(1)}})


@pytest.mark.parametrize("warmup_epochs", [0, 1, 2, 3, 30])
@pytest.mark.parametrize("epoch, step", [(1, 0), (2, 0), (2, 3), (3, 0), (3, 6), (4, 0)])
def test_teacher_outputs_uses_the_temperature_of_the_last_trained_step(warmup_epochs, epoch, step):
    """The temperature the run reached, read from the schedule the run trained with (7 steps an epoch,
    4 epochs), not the schedule's end point."""
    args = {"warmup_teacher_temp": 0.04, "teacher_temp": 0.07, "warmup_teacher_temp_epochs": warmup_epochs}
    schedule = common.teacher_temperature_schedule(0.04, 0.07, warmup_epochs, 4, niter_per_ep=7)
    expected = schedule[epoch * 7 + step - 1]
    assert teacher_outputs.reached_teacher_temperature(args, epoch, step) == pytest.approx(expected)


def test_teacher_outputs_temperature_of_a_short_run_and_of_a_fractional_warmup():
    glsd_recipe = {"warmup_teacher_temp": 0.04, "teacher_temp": 0.07, "warmup_teacher_temp_epochs": 30}
    assert teacher_outputs.reached_teacher_temperature(glsd_recipe, 1, 0) == pytest.approx(0.04)  # one epoch of 30
    fractional = {**glsd_recipe, "warmup_teacher_temp_epochs": 0.5}
    assert teacher_outputs.reached_teacher_temperature(fractional, 1, 0) == pytest.approx(0.07)   # warm-up over
    assert teacher_outputs.reached_teacher_temperature(fractional, 0, 3) is None   # needs the steps per epoch
