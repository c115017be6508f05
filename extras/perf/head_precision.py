"""How far the DINO head's teacher distribution moves under mixed precision, against float32.

Not a test (pytest collects only tests/test_*.py); tests/test_gpu_path.py checks a smaller case.

The teacher distribution is P = softmax((logits - c) / tau_t) over the K prototypes, with the
centre c = the batch mean of the float32 logits and tau_t = 0.04 (the lowest teacher temperature
of the recipes): dividing by 0.04 multiplies every rounding error of a logit by 25. Compared, each
against the same head in float32:
  fp16 (authors)   the whole head under fp16 autocast: the DINO authors' setting (fp16 logits)
  bf16 all         the whole head under bf16 autocast (bf16 logits: 8 significant bits; fp16: 11)
  bf16, fp32 last  the MLP under bf16 autocast, the last layer in float32
  bf16, fp32 head  the whole head in float32 under bf16 autocast, as `common.DINOHead` computes it
Two heads: at initialisation (flat teacher distributions), and "peaked", where every input has a
prototype at cosine ~0.95 (the last layer's cosines then reach the range where bf16's spacing is
2^-8 = 0.0039, 0.1 after the division by tau_t): the case of a trained teacher.
A third row runs a randomly initialised ViT-S/16 (under the same autocast) and head on random
images: the backbone's rounding, which the head cannot undo, is then included.
Reported per case: the largest |P - P_fp32| over all entries, the largest and the mean over the
rows of KL(P_fp32 || P), and the largest |logit - logit_fp32| / tau_t.

    python extras/perf/head_precision.py [--out_dim 65536] [--batch 128] [--in_dim 384] [--images 8]
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402

TEACHER_TEMP = 0.04


def head_logits(head, x, precision, in_fp32="head", backbone=None):
    """The head's logits (as float32) under `precision` autocast on the CPU, for inputs `x` (images
    when a `backbone` is given, which then runs under the same autocast). in_fp32: what computes in
    float32 under bf16 autocast: "head" (`common.DINOHead`), "last layer", or "nothing"."""
    device = torch.device("cpu")
    with torch.no_grad(), common.autocast(device, precision):
        if backbone is not None:
            x = backbone(x)
        if in_fp32 == "head":
            return head(x).float()
        z = F.normalize(head.mlp(x), dim=-1, p=2)
        if in_fp32 == "last layer":
            with torch.autocast("cpu", enabled=False):
                return head.last_layer(z.float()).float()
        return head.last_layer(z).float()


def peaked(head, x, cosine=0.95, seed=1):
    """Give each input row a prototype at about `cosine` with its float32 bottleneck vector."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        z = F.normalize(head.mlp(x), dim=-1)
        noise = F.normalize(torch.randn(z.shape, generator=g), dim=-1)
        # orthogonal to z
        noise = F.normalize(noise - (noise * z).sum(-1, keepdim=True) * z, dim=-1)
        head.last_layer.weight_v[: len(x)] = cosine * z + (1 - cosine ** 2) ** 0.5 * noise
    return head


CASES = {"fp16 (authors)": ("fp16", "nothing"), "bf16 all": ("bf16", "nothing"),
         "bf16, fp32 last": ("bf16", "last layer"), "bf16, fp32 head": ("bf16", "head")}


def compare(head, x, temp=TEACHER_TEMP, backbone=None, cases=CASES):
    """{case: (max |dP|, max KL, mean KL, max |d logit| / temp)} against float32."""
    reference = head_logits(head, x, "fp32", backbone=backbone)
    center = reference.mean(0, keepdim=True)
    log_p32 = F.log_softmax((reference - center) / temp, dim=-1)
    out = {}
    for name in cases:
        precision, in_fp32 = CASES[name]
        logits = head_logits(head, x, precision, in_fp32, backbone)
        log_p = F.log_softmax((logits - center) / temp, dim=-1)
        kl = (log_p32.exp() * (log_p32 - log_p)).sum(-1)
        out[name] = ((log_p.exp() - log_p32.exp()).abs().max().item(), kl.max().item(),
                     kl.mean().item(), ((logits - reference).abs().max() / temp).item())
    return out


def heads(in_dim, out_dim, batch, seed=0):
    """(name, head, inputs) for the head at initialisation and the peaked head."""
    torch.manual_seed(seed)
    x = torch.randn(batch, in_dim)
    head = common.DINOHead(in_dim, out_dim)
    yield "initialisation", head, x
    yield "peaked (cosine 0.95)", peaked(head, x), x


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dim", type=common.POSITIVE_INT, default=65536)
    p.add_argument("--batch", type=common.POSITIVE_INT, default=128)
    p.add_argument("--in_dim", type=common.POSITIVE_INT, default=384,
                   help="backbone width (ViT-S: 384)")
    p.add_argument("--images", type=common.COUNT, default=8,
                   help="also a randomly initialised backbone + head on this many random 224 px "
                        "images, the backbone under the same autocast (0 = skip)")
    p.add_argument("--arch", default="vit_small", choices=list(common.ARCHS))
    return p


def main():
    a = get_args_parser().parse_args()
    print(f"torch {torch.__version__}, K = {a.out_dim}, batch {a.batch}, in_dim {a.in_dim}, "
          f"teacher temperature {TEACHER_TEMP}")
    print(f"{'head':22s} {'case':17s} {'max|dP|':>10s} {'max KL':>10s} {'mean KL':>10s} "
          f"{'max|dlogit|/T':>14s}")
    rows = [(name, compare(head, x)) for name, head, x in heads(a.in_dim, a.out_dim, a.batch)]
    if a.images:
        torch.manual_seed(0)
        backbone = common.build_backbone(a.arch).eval()
        head = common.DINOHead(backbone.num_features, a.out_dim)
        images = torch.randn(a.images, 3, 224, 224)
        rows.append((f"{a.arch} + head", compare(head, images, backbone=backbone)))
    for name, results in rows:
        for case, (dp, kl_max, kl_mean, dlogit) in results.items():
            print(f"{name:22s} {case:17s} {dp:10.2e} {kl_max:10.2e} {kl_mean:10.2e} "
                  f"{dlogit:14.3f}")


if __name__ == "__main__":
    main()
