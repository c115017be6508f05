"""The parts of extras/perf/gpu_check.py's two forms (the GPU form at paper size, the CPU form with
tiny models), as commands: which script, which flags, which part each needs. Not a script."""
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import jpeg_folder  # noqa: E402  (this file's folder is on sys.path, as for gpu_check.py)


# ======== The parts of each form ==================================================================
@dataclass
class Part:
    name: str
    script: str
    argv: list
    nproc: int = 1
    needs: tuple = ()
    env: dict = field(default_factory=dict)
    sync_window: tuple = (0, 0)
    preempt_at: int = -1
    # a part whose checkpoint.pth is copied into this part's --output_dir first
    start_from: str = None

    def command(self):
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), "torchrun --nproc_per_node",
                         str(self.nproc), f"{self.script}.py", *self.argv])


ARCH = {"dino": "vit", "esvit": "swin", "glsd": "swin", "selfpatch": "vit", "drloc": "swin"}
FORMS = {
    "gpu": dict(steps=25, warmup=5, syncs=5, preempt=10, size=256, eval_images=2048,
                linear_epochs=5, pairs=["dino"], pair_steps=4,
                # the scripts' defaults
                batch={"dino": 64, "esvit": 32, "glsd": 32, "selfpatch": 64, "drloc": 128},
                arch={"vit": ["--arch", "vit_small"], "swin": ["--arch", "swin_tiny"]}, ssl=[],
                selfpatch=[], drloc=["--val_subset", "512"], eval=["--batch_size_per_gpu", "128"],
                # ImageNet-like JPEGs read by the scripts' default loader: 10 workers, PIL crops
                jpeg=dict(images=4000, size=500, steps=40, workers=10)),
    "cpu": dict(steps=3, warmup=1, syncs=2, preempt=1, size=64, eval_images=64, linear_epochs=2,
                batch=dict.fromkeys(ARCH, 8),
                pairs=["dino", "esvit", "glsd", "selfpatch"], pair_steps=2, pair_batch=4,
                arch={"vit": ["--arch", "vit_pico", "--patch_size", "8"],
                      "swin": ["--arch", "swin_pico"]},
                ssl=["--global_crop_size", "64", "--local_crop_size", "32",
                     "--local_crops_number", "2", "--out_dim", "64",
                     "--head_hidden_dim", "64", "--head_bottleneck_dim", "32"],
                selfpatch=["--patch_out_dim", "64"],
                drloc=["--input_size", "64", "--val_subset", "8"],
                eval=["--batch_size_per_gpu", "16", "--resize", "64", "--crop", "64"],
                jpeg=dict(images=32, size=96, steps=3, workers=1)),
}


def jpeg_data(form, jpeg_cache):
    """The JPEG parts' folder (jpeg_folder.py's, made by gpu_check before the parts run)."""
    jpeg = FORMS[form]["jpeg"]
    return jpeg_folder.folder_for(jpeg_cache, jpeg["images"], size=jpeg["size"])


def plan(form, gpus, out, jpeg_cache="runs/jpeg_folders"):
    """The parts of the GPU form (`gpus` GPUs) or of the CPU form, writing under `out`; the JPEG
    parts read their folder from `jpeg_cache`."""
    f = FORMS[form]
    out = Path(out)
    device = ["--device", "cpu", "--num_workers", "0"] if form == "cpu" else []
    data = ["--dataset", "synthetic", "--synthetic_image_size", str(f["size"])]

    def train(method, name=None, steps=f["steps"], epochs=2, batch=None, extra=(), images=None,
              folder=None, **kw):
        batch = batch or f["batch"][method]
        drawn = [*data, "--synthetic_images", str(images or batch * steps)]
        argv = [*f["arch"][ARCH[method]],
                *(["--dataset", "folder", "--data_path", str(folder)] if folder else drawn),
                "--batch_size_per_gpu", str(batch), "--epochs", str(epochs),
                "--max_steps_per_epoch", str(steps), "--warmup_epochs", "1",
                "--precision", "auto", "--saveckp_freq", "0",
                "--output_dir", str(out / (name or method)), *device,
                *(f["drloc"] + ["--lambda_schedule", "constant"] if method == "drloc"
                  else f["ssl"]),
                *(f["selfpatch"] if method == "selfpatch" else []), *extra]
        return Part(name or method, method, argv, **kw)

    parts = [train(m, sync_window=(f["warmup"], f["warmup"] + f["syncs"])) for m in ARCH]
    parts += [train("dino", "dino_preempted", preempt_at=f["preempt"]),
              train("dino", "dino_resumed", needs=("dino", "dino_preempted"),
                    start_from="dino_preempted"),
              train("dino", "dino_fp16", epochs=3, needs=("dino",), start_from="dino",
                    extra=["--precision", "fp16"])]
    weights = ["--pretrained_weights", str(out / "dino" / "checkpoint.pth"), *data,
               "--synthetic_images", str(f["eval_images"]), *f["eval"], *device]
    ranks = min(gpus, 2) if gpus else 2
    parts += [Part("eval_knn", "eval_knn", [*weights, "--nb_knn", "5", "20"], ranks,
                   needs=("dino",)),
              Part("eval_linear", "eval_linear",
                   [*weights, "--precomputed_features", "true", "--epochs",
                    str(f["linear_epochs"]), "--output_dir", str(out / "eval_linear")], ranks,
                   needs=("dino",)),
              train("glsd", "glsd_batched", epochs=1, extra=["--batched_crops", "true"])]
    # DINO on files: decoded and cropped by --num_workers loader processes (a later flag wins)
    workers = ["--num_workers", str(f["jpeg"]["workers"])]
    on_files = dict(steps=f["jpeg"]["steps"], folder=jpeg_data(form, jpeg_cache))
    parts += [train("dino", "dino_jpeg", extra=workers, **on_files),
              train("dino", "dino_jpeg_batched", extra=[*workers, "--batched_crops", "true"],
                    **on_files)]
    # fp32 without TF32: rounding apart only
    for method in f["pairs"] if form == "cpu" or gpus >= 2 else []:
        batch = f.get("pair_batch") or f["batch"][method]
        same = dict(steps=f["pair_steps"], epochs=1, images=2 * batch * f["pair_steps"],
                    batch=batch, env={"NVIDIA_TF32_OVERRIDE": "0"},
                    extra=["--drop_path_rate", "0", "--precision", "fp32"])
        parts += [train(method, f"{method}_one_process", **{**same, "batch": 2 * batch}),
                  train(method, f"{method}_two_processes", nproc=2,
                        needs=(f"{method}_one_process",), **same)]
    return parts


def check_commands(parts):
    """Parse every part's flags with its script's own parser: a wrong flag stops here, not after
    minutes."""
    for part in parts:
        parser = importlib.import_module(part.script).get_args_parser()
        parser.exit = lambda status=0, message=None: common.die(
            f"part {part.name}: {(message or '').strip()}")
        parser.error = lambda message: common.die(f"part {part.name}: {part.script}.py {message}")
        parser.parse_args(part.argv)
