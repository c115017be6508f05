"""An ImageFolder of ImageNet-like JPEGs, made once and reused: what a loader-bound run reads.

    python extras/perf/jpeg_folder.py                        # 4,000 images in runs/jpeg_folders/
    python extras/perf/jpeg_folder.py --images 32 --size 96  # the CPU form's small folder
    python extras/perf/jpeg_folder.py --cost 96 --log docs/data/loader_cost.jsonl
                                                  # and a loader worker's CPU time per JPEG

The procedural images of `--dataset synthetic` are drawn in memory: no file is read and nothing is
decoded, so a run on them cannot show a loader that is slower than the GPU. These are files like
ImageNet's: widths 400-640 and heights 300-500 px at --size 500 (one in eight turned to portrait;
one in five taller than wide in all), about 105 KB each at JPEG quality 90 (a smooth colour field,
shapes with edges, grain), in --classes class folders. A folder is named by its parameters and
holds `.made.json` once complete, so a second call with the same parameters reuses it and one
stopped half-way is made again (4,000 images: 63 s on a busy 2-core CPU). Used by gpu_check.py
(its JPEG parts), side_by_side.py (end to end) and gpu_run.py. Imported by no training script.
"""
import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torchvision.transforms import functional as TF

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import device_crops  # noqa: E402

MARKER = ".made.json"  # a file, not a folder: ImageFolder takes only folders for classes


def folder_for(cache, images, classes=10, size=500, quality=90, seed=0):
    """Where the folder of these parameters is (made or not)."""
    return Path(cache) / f"jpeg_{images}img_{classes}cls_{size}px_q{quality}_seed{seed}"


def draw_image(index, size, seed):
    """Image `index` of the set `seed`: a smooth colour field, a dozen filled shapes (edges, as
    objects have), a slight blur and grain at two scales (the texture that makes JPEG files
    ImageNet's size rather than a tenth of it)."""
    rng = np.random.default_rng([seed, index])
    width = int(size * rng.uniform(0.8, 1.28))
    height = int(size * rng.uniform(0.6, 1.0))
    if rng.random() < 1 / 8:
        width, height = height, width
    field = rng.uniform(0, 255, (rng.integers(3, 7), rng.integers(3, 7), 3)).astype(np.uint8)
    image = Image.fromarray(field).resize((width, height), Image.BICUBIC)
    pen = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = [x0, y0, x0 + int(rng.integers(width // 50 + 1, width // 2 + 2)),
               y0 + int(rng.integers(height // 50 + 1, height // 2 + 2))]
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (pen.ellipse if rng.random() < 0.5 else pen.rectangle)(box, fill=colour)
    image = image.filter(ImageFilter.BoxBlur(max(1, round(size / 500))))
    pixels = np.asarray(image, np.float32)
    coarse = rng.normal(0, 16, (height // 4 + 1, width // 4 + 1)).astype(np.float32)
    coarse = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))
    grain = rng.normal(0, 16, (height, width)).astype(np.float32)
    pixels = pixels + (coarse + grain)[..., None]  # grey grain: JPEG keeps detail in luma
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_images(job):
    """One worker's share: (folder, first index, last index + 1, classes, size, quality, seed)."""
    folder, start, stop, classes, size, quality, seed = job
    for index in range(start, stop):
        path = Path(folder) / f"class{index % classes:02d}" / f"{index:06d}.jpg"
        with common.open_for_writing(path, "wb") as f:
            draw_image(index, size, seed).save(f, "JPEG", quality=quality)


def make(cache, images, classes=10, size=500, quality=90, seed=0, processes=None):
    """The folder of these parameters, made if absent (in `processes` processes, default all
    cores) or incomplete; reused when complete. Returns its path."""
    params = dict(images=images, classes=classes, size=size, quality=quality, seed=seed)
    folder = folder_for(cache, **params)
    if (folder / MARKER).is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a run stopped half-way: made again
    for c in range(classes):
        (partial / f"class{c:02d}").mkdir(parents=True)
    processes = processes or os.cpu_count()
    bounds = np.linspace(0, images, 4 * processes + 1).astype(int)  # small shares: even finish
    jobs = [(str(partial), a, b, classes, size, quality, seed)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    start = time.time()
    # forked workers: no re-import of torch; threads of this process are not needed there
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        pool.map(write_images, jobs, chunksize=1)
    finally:
        # ended by their queue, not by SIGTERM (`with` terminates): a worker forked from a
        # process with common's preemption handler would take SIGTERM as "checkpoint" and stay
        pool.close()
        pool.join()
    with common.open_for_writing(partial / MARKER) as f:
        f.write(json.dumps({**params, "seconds": round(time.time() - start, 1),
                            "processes": processes}) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def describe(folder):
    """{images, mean_kb, mean_width, mean_height, portrait} of a made folder."""
    paths = sorted(Path(folder).glob("class*/*.jpg"))
    sizes = []
    for path in paths:
        with Image.open(path) as image:
            sizes.append(image.size)
    return {"images": len(paths),
            "mean_kb": round(statistics.mean(p.stat().st_size for p in paths) / 1e3, 1),
            "mean_width": round(statistics.mean(w for w, _ in sizes)),
            "mean_height": round(statistics.mean(h for _, h in sizes)),
            "portrait": sum(h > w for w, h in sizes)}


def cost_per_image(folder, count=48, seed=0):
    """CPU milliseconds per image at one thread (process time: other jobs on the machine do not
    inflate it), over `count` images of `folder`, with DINO's default crops (2 x 224 + 8 x 96):
    what a loader worker does on each path (decode alone; decode + the PIL multi-crop, the
    default; decode + `--batched_crops`' draws; on a GPU, where nvJPEG decodes, read + draws) and,
    for information, the crops that `--batched_crops` then cuts on the training device, here this
    CPU."""
    base = common.ImageFolderSafe(str(folder))
    base.samples = sorted(base.samples)[:count]
    indices = [(i, 0) for i in range(len(base.samples))]
    augment = common.MultiCropAugmentation()
    pil = common.SeededDataset(base, augment, seed=seed)
    batched = device_crops.BatchedCrops(common.SeededDataset(base, augment, seed=seed), "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {"decode_ms": process_time(lambda: [base[i] for i, _ in indices]),
                   "pil_multicrop_ms": process_time(lambda: [pil[i] for i in indices])}
        views = []
        seconds["batched_crops_worker_ms"] = process_time(
            lambda: views.append(batched.__getitems__(indices)[0]))
        seconds["batched_crops_device_half_on_this_cpu_ms"] = process_time(
            lambda: common.crops_on_device(views[0], torch.device("cpu")))
        gpu = device_crops.BatchedCrops(
            common.SeededDataset(common.ImageFolderSafe(str(folder)), augment, seed=seed), "cuda")
        gpu.base.samples = base.samples  # as on a GPU: the worker reads the files, nvJPEG decodes
        seconds["batched_crops_worker_gpu_decode_ms"] = process_time(
            lambda: gpu.__getitems__(indices))
    finally:
        torch.set_num_threads(threads)
    return {"images": len(indices),
            **{name: round(value * 1e3 / len(indices), 2) for name, value in seconds.items()}}


def device_decode(folder, count=96):
    """The training device's JPEG decoder (nvJPEG on a GPU, else this CPU) against PIL, the PIL
    path's decoder, on `count` files: milliseconds per image of one batched call (after a warm-up),
    and the pixels' mean and largest |difference| in levels of 255."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = sorted(path for path, _ in common.ImageFolderSafe(str(folder)).samples)[:count]
    jpegs = [device_crops.read_jpeg_or_decode(path) for path in paths]
    if not all(isinstance(jpeg, device_crops.EncodedJpeg) for jpeg in jpegs):
        common.die(f"{folder} holds files that are not baseline RGB JPEGs: make it again")
    device_crops.images_on_device(jpegs[:8], device)  # the decoder's first call sets it up
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    decoded = device_crops.images_on_device(jpegs, device)
    synchronize()
    seconds = time.perf_counter() - start
    diffs = torch.cat([(image.cpu().int() - TF.pil_to_tensor(common.load_image(path)).int())
                       .abs().flatten() for image, path in zip(decoded, paths)])
    return {"device": device.type, "images": len(paths),
            "batched_decode_ms": round(seconds * 1e3 / len(paths), 3),
            "mean_abs_diff_from_pil": round(diffs.float().mean().item(), 4),
            "max_abs_diff_from_pil": diffs.max().item()}


def process_time(work):
    """CPU seconds that `work()` takes in this process."""
    start = time.process_time()
    work()
    return time.process_time() - start


def get_args_parser():
    p = argparse.ArgumentParser("jpeg_folder.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cache", default="runs/jpeg_folders",
                   help="where folders are made and found (one per set of parameters)")
    p.add_argument("--images", default=4000, type=common.POSITIVE_INT)
    p.add_argument("--classes", default=10, type=common.POSITIVE_INT)
    p.add_argument("--size", default=500, type=common.ranged(int, 32),
                   help="nominal width: widths 0.8-1.28x, heights 0.6-1x of it")
    p.add_argument("--quality", default=90, type=common.ranged(int, 1, 95))
    p.add_argument("--seed", default=0, type=common.COUNT)
    p.add_argument("--processes", default=None, type=common.POSITIVE_INT,
                   help="processes that make the images (default: every core)")
    p.add_argument("--cost", default=0, type=common.COUNT,
                   help="then time a loader worker's work on N of the images at one thread")
    p.add_argument("--log", default=None,
                   help="append the cost as a JSON line with its provenance (e.g. "
                        "docs/data/loader_cost.jsonl)")
    return p


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    if args.classes > args.images:
        common.die(f"--classes {args.classes} is more than --images {args.images}: a class "
                   "folder would be empty")
    if args.log and not args.cost:
        common.die("--log records the cost: give --cost N too")
    sys.path.insert(0, str(ROOT / "extras" / "experiments"))
    import provenance
    if args.log:
        provenance.check_log_writable(args.log)
    started = provenance.start()
    start = time.time()
    folder = make(args.cache, args.images, args.classes, args.size, args.quality, args.seed,
                  args.processes)
    made = {"folder": str(folder), "seconds": round(time.time() - start, 1), **describe(folder)}
    print(json.dumps(made))
    if args.cost:
        cost = {"one_thread_cost": cost_per_image(folder, args.cost),
                "device_decode": device_decode(folder, args.cost)}
        print(json.dumps(cost))
    if args.log:
        words = sys.argv[1:] if argv is None else argv
        command = "python extras/perf/jpeg_folder.py " + " ".join(words)
        with common.open_for_writing(args.log, "a") as f:
            f.write(json.dumps({**made, **cost, "command": command, **provenance.stamp(started)})
                    + "\n")


if __name__ == "__main__":
    main()
