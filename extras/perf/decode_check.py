"""The training device's JPEG decode while a backward is queued: its pixels must not change.

    python extras/perf/decode_check.py                 # a GPU: nvJPEG on a stream of its own
    python extras/perf/decode_check.py --unsafe        # the decode on the training stream
    python extras/perf/decode_check.py --device cpu    # the CPU form: the same code, in line

torchvision's decoder allocates its outputs on the caller's stream and writes them from a private
stream that waits for none of the caller's queued work (pytorch/vision#9606). On the stream that
trains, a decoded image can get memory that a queued kernel still writes (or reads), as the
batched crops' decode would while the previous step's backward is queued.
`device_crops.images_on_device` decodes on a stream of its own. Each round queues a backward, then
writes and frees buffers of the images' sizes behind it (freed memory that queued kernels still
write), decodes the files and compares them, bit for bit, with the same files decoded with
nothing queued. `--unsafe` decodes on the training stream: on a GPU it should fail, which shows
that the check can see the race. Exit status 0 when every round's pixels are the same.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torchvision import io as tv_io

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
import common  # noqa: E402
import device_crops  # noqa: E402
import jpeg_folder  # noqa: E402


def get_args_parser():
    p = argparse.ArgumentParser("decode_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--images", default=64, type=common.POSITIVE_INT, help="files decoded a round")
    p.add_argument("--size", default=500, type=common.POSITIVE_INT, help="their nominal width")
    p.add_argument("--rounds", default=10, type=common.POSITIVE_INT)
    p.add_argument("--width", default=4096, type=common.POSITIVE_INT,
                   help="the queued backward's network width (CPU form: 64)")
    p.add_argument("--unsafe", action="store_true", help="decode on the training stream")
    p.add_argument("--jpeg_cache", default="runs/jpeg_folders")
    p.add_argument("--out", default=None, help="a JSON line of the result is appended here")
    return p


def decode(jpegs, device, unsafe):
    if unsafe:  # what torchvision's decoder does when called on the stream that trains
        return tv_io.decode_jpeg([j.data for j in jpegs], device=device,
                                 mode=tv_io.ImageReadMode.RGB)
    return device_crops.images_on_device(jpegs, device)


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    device = torch.device(args.device)
    folder = jpeg_folder.make(args.jpeg_cache, args.images, size=args.size)
    paths = sorted(folder.rglob("*.jpg"))[:args.images]
    jpegs = [device_crops.read_jpeg_or_decode(path) for path in paths]
    reference = [image.cpu() for image in device_crops.images_on_device(jpegs, device)]
    cpu = [tv_io.decode_jpeg(j.data, mode=tv_io.ImageReadMode.RGB) for j in jpegs]
    net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(8)])
    net = net.to(device)
    x = torch.randn(256, args.width, device=device)
    changed = []
    start = time.perf_counter()
    for _ in range(args.rounds):
        net(x).square().mean().backward()  # queued: the GPU is busy for a while
        for image in reference:  # freed at once, written later by the queued fills
            torch.empty(image.numel(), dtype=torch.uint8, device=device).fill_(0)
        decoded = decode(jpegs, device, args.unsafe)
        changed.append(sum(not torch.equal(a.cpu(), b) for a, b in zip(decoded, reference)))
    apart = max((a.int() - b.int()).abs().max().item() for a, b in zip(reference, cpu))
    result = {"device": device.type, "unsafe": args.unsafe, "images": len(jpegs),
              "rounds": args.rounds, "changed_images_per_round": changed,
              "max_abs_diff_from_cpu_decoder": apart, "seconds": time.perf_counter() - start}
    print(("decode while a backward is queued: " + ("the same pixels in every round"
           if not any(changed) else f"changed images per round {changed}")
           + f"; {apart} levels at most from the CPU decoder's"), flush=True)
    if args.out:
        with common.open_for_writing(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if not any(changed) else 1


if __name__ == "__main__":
    sys.exit(main())
