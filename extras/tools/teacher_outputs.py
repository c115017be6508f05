"""How a trained teacher's image head spreads images over its K outputs: the two collapses of
DINO's "Avoiding collapse" study (Caron et al., ICCV 2021), measured on a split instead of a batch.

    p_i   = softmax((g(x_i) - c) / tau_t)  the teacher's target for image i (centre c, tau_t the
                                           teacher temperature of the run's last trained step)
    h     = 1/n sum_i H(p_i)               per-image entropy: ln K when every target is uniform
    h_bar = H(1/n sum_i p_i)               entropy of the mean target: 0 when one output wins
    used  = |{argmax_k p_i,k}|             how many of the K outputs are some image's arg-max

Uniform collapse: h -> ln K. Collapse to one dimension: h_bar -> 0 and used -> 1. A healthy head
has a small h (sharp targets), an h_bar near ln K (all outputs used over the split) and many
outputs in use.

Works on this repository's checkpoint.pth of DINO, EsViT, GLSD and SelfPatch (the image head on
the global feature: DINO's CLS, the Swin's pooled tokens, SelfPatch's aggregated image token).

    python extras/tools/teacher_outputs.py \
        --pretrained_weights runs/results/dino_recipe_test_seed0/checkpoint.pth \
        --dataset fashion_mnist --crop 32 --resize 32 --max_images 2000
"""
import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# Run as `python extras/tools/teacher_outputs.py` from anywhere: the project's modules sit two
# folders up.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import eval_knn  # noqa: E402

HEAD_KEYS = {"dino": "head.", "esvit": "head.", "glsd": "head.", "selfpatch": "c_head."}


def get_args_parser():
    p = argparse.ArgumentParser("teacher_outputs.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pretrained_weights", required=True,
                   help="a checkpoint.pth written by a method of this repository")
    p.add_argument("--max_images", default=2000, type=common.POSITIVE_INT,
                   help="the first N images of the evaluation split (the test split; with "
                        "--holdout, the held-out train images)")
    p.add_argument("--teacher_temp", default=None, type=common.POSITIVE,
                   help="measure at this temperature instead of the one the run reached at its "
                        "last trained step")
    eval_knn.add_eval_data_args(p, batch_size=250)
    return p


def reached_teacher_temperature(args, epoch, step):
    """The teacher temperature of the last step a checkpoint trained (it holds `epoch` whole epochs
    and `step` steps of the next), from the run's schedule (common.teacher_temperature_schedule).
    Not the schedule's end point: a one-epoch run of a 30-epoch warm-up 0.04 -> 0.07 ends at 0.04.
    A fractional warm-up ramps per step, which needs the run's steps per epoch that a checkpoint
    does not record: None while such a warm-up was still under way."""
    warmup = args["warmup_teacher_temp"]
    final = args["teacher_temp"]
    warmup_epochs = args["warmup_teacher_temp_epochs"]
    last_epoch = max(epoch - 1 if step == 0 else epoch, 0)    # the epoch of the last trained step
    if float(warmup_epochs).is_integer():                     # whole epochs ramp once per epoch
        return float(common.teacher_temperature_schedule(warmup, final, warmup_epochs,
                                                         last_epoch + 1)[last_epoch])
    return final if epoch >= warmup_epochs else None


def head_statistics(logits, center, temperature):
    """(h, h_bar, used) of the module docstring, for image-head logits [n, K]."""
    p = F.softmax((logits.float() - center) / temperature, dim=-1)
    h = -(p * p.clamp_min(1e-12).log()).sum(-1).mean().item()
    mean = p.mean(0)
    h_bar = -(mean * mean.clamp_min(1e-12).log()).sum().item()
    return h, h_bar, len(torch.unique(p.argmax(-1)))


def load_teacher_head(ckpt):
    """The teacher's image head (common.DINOHead), its centre and the temperature of its last
    trained step (None inside a fractional warm-up) from a checkpoint."""
    method = ckpt.get("method")
    args = ckpt["args"]
    if method not in HEAD_KEYS:
        common.die(f"a {method} checkpoint has no self-distillation image head; use one of DINO, "
                   "EsViT, GLSD, SelfPatch")
    prefix = HEAD_KEYS[method]
    loss_key = f"{method}_loss"
    state = {k[len(prefix):]: v for k, v in ckpt["teacher"].items() if k.startswith(prefix)}
    if "last_layer.weight_v" not in state or "center" not in ckpt.get(loss_key, {}):
        common.die(f"the {method} checkpoint lacks its teacher image head ({prefix}*) or its "
                   f"centre ({loss_key})")
    dim = (state["mlp.0.weight"].shape[1] if "mlp.0.weight" in state
           else state["mlp.weight"].shape[1])
    head = common.DINOHead(dim, args["out_dim"], use_bn=args["use_bn_in_head"],
                           norm_last_layer=args["norm_last_layer"],
                           hidden_dim=args["head_hidden_dim"],
                           bottleneck_dim=args["head_bottleneck_dim"])
    common.load_state_dict_strict(head, state, what=f"{method} teacher image head")
    # a training checkpoint's position
    position = (ckpt["epoch"], ckpt["step"]) if "epoch" in ckpt and "step" in ckpt else None
    temperature = reached_teacher_temperature(args, *position) if position else None
    return head.eval(), ckpt[loss_key]["center"], temperature


@torch.no_grad()
def main(args):
    if not Path(args.pretrained_weights).is_file():
        common.die(f"--pretrained_weights {args.pretrained_weights} is not a file")
    ckpt = common.load_checkpoint(args.pretrained_weights)
    if not (isinstance(ckpt, dict) and "method" in ckpt and "args" in ckpt):
        common.die(f"{args.pretrained_weights} is not a checkpoint.pth of this repository (no "
                   "method and args)")
    head, center, temperature = load_teacher_head(ckpt)
    if args.teacher_temp is not None:
        temperature = args.teacher_temp
    elif temperature is None:
        common.die(f"the teacher temperature of {args.pretrained_weights}'s last step is unknown "
                   "(no training position recorded, or a fractional warm-up still under way: it "
                   f"depends on the run's steps per epoch): pass --teacher_temp")
    backbone, _ = eval_knn.load_backbone(args.pretrained_weights, "teacher", crop=args.crop)
    dataset = common.build_dataset(args, train=False)
    # (a --holdout Subset's folder) unreadable images are left out, no neighbour counted twice
    if isinstance(getattr(dataset, "dataset", dataset), common.ImageFolderSafe):
        getattr(dataset, "dataset", dataset).substitute = False
    transform = common.eval_transform(args.resize, args.crop)
    n = min(args.max_images, len(dataset))
    logits = []
    for start in range(0, n, args.batch_size_per_gpu):
        batch = [dataset[i] for i in range(start, min(start + args.batch_size_per_gpu, n))]
        images = [transform(image) for image, label in batch if label != eval_knn.SKIPPED]
        logits += [head(backbone(torch.stack(images)))] if images else []
    if not logits:                                  # statistics over no image are none
        common.die(f"none of the first {n} images could be read (--skip_bad_images left them all "
                   "out): no statistics")
    logits = torch.cat(logits)
    k = center.shape[-1]
    h, h_bar, used = head_statistics(logits, center, temperature)
    left_out = f" ({n - len(logits)} unreadable, left out)" if n > len(logits) else ""
    common.log(f"{ckpt['method']} teacher at temperature {temperature:g}, {len(logits)} "
               f"images{left_out}, K = {k} (ln K = {math.log(k):.2f}):")
    common.log(f"per-image entropy {h:.2f} | entropy of the mean target {h_bar:.2f} | arg-max "
               f"outputs {used} of {k}")
    return h, h_bar, used


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
