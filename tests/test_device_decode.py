"""`--batched_crops` on a GPU: loader workers read an image folder's baseline JPEGs without
decoding them (`read_jpeg_or_decode`), the training device decodes them in one call
(`images_on_device`: nvJPEG there, libjpeg here on the CPU), and every other file (PNG, CMYK,
grayscale, progressive, 16-bit) is decoded by the workers as before, onto the batch's canvas. On
a CPU both decoders give the PIL path's pixels, so the crops and their geometry are the
PIL-decoded batch's. The decode on a stream of its own while a backward is queued: its CPU form,
extras/perf/decode_check.py --device cpu (below)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import functional as TF

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import device_crops  # noqa: E402

DEVICE_DECODED = ["a/baseline.jpg", "a/no_subsampling.jpg", "b/square.jpg"]
WORKER_DECODED = ["b/cmyk.jpg", "b/gray.jpg", "b/picture.png", "b/progressive.jpg",
                  "b/sixteen_bit.png"]


def colour_image(width, height, seed):
    """A smooth colour field with a sharp square: every decoder and resampler changes it."""
    rng = np.random.default_rng(seed)
    field = Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8))
    pixels = np.asarray(field.resize((width, height), Image.BICUBIC)).copy()
    pixels[height // 4: height // 2, width // 4: width // 2] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two classes of files: three the device decodes, five the workers decode."""
    root = tmp_path_factory.mktemp("mixed_files")
    (root / "a").mkdir()
    (root / "b").mkdir()
    colour_image(50, 37, 0).save(root / "a/baseline.jpg", quality=90)
    colour_image(33, 61, 1).save(root / "a/no_subsampling.jpg", quality=75, subsampling=0)
    colour_image(40, 40, 2).save(root / "b/square.jpg", quality=95)
    colour_image(40, 30, 3).convert("CMYK").save(root / "b/cmyk.jpg")
    colour_image(40, 30, 4).convert("L").save(root / "b/gray.jpg")
    colour_image(40, 30, 5).save(root / "b/picture.png")
    colour_image(40, 30, 6).save(root / "b/progressive.jpg", quality=90, progressive=True)
    deep = (np.asarray(colour_image(40, 30, 7).convert("L")).astype(np.uint16) * 257)
    Image.fromarray(deep).save(root / "b/sixteen_bit.png")
    return root


def batch(folder, on_device):
    """(`UncroppedBatch`, None) of the whole folder, epoch 0, and the dataset."""
    augment = common.MultiCropAugmentation(local_crops_number=2, global_crop_size=16,
                                           local_crop_size=8)
    seeded = common.SeededDataset(common.ImageFolderSafe(str(folder)), augment, seed=3)
    dataset = device_crops.BatchedCrops(seeded, "cuda" if on_device else "cpu")
    views, _labels = dataset.__getitems__([(i, 0) for i in range(len(dataset))])
    return views, dataset


def names(dataset):
    return [Path(path).relative_to(dataset.base.root).as_posix() for path, _ in dataset.base.samples]


def test_workers_hand_baseline_jpegs_over_and_decode_the_rest(folder):
    (uncropped, _geometry), dataset = batch(folder, on_device=True)
    root = dataset.base.root
    assert sorted(Path(j.path).relative_to(root).as_posix() for j, _, _ in uncropped.jpegs) == \
        DEVICE_DECODED  # the others are on the canvas
    assert len(uncropped.jpegs) + len(WORKER_DECODED) == len(dataset)
    jpeg = uncropped.jpegs[0][0]
    with Image.open(jpeg.path) as image:
        assert (jpeg.width, jpeg.height) == image.size
    assert jpeg.data.dtype == torch.uint8 and jpeg.data.dim() == 1


def test_without_device_decoding_the_workers_decode_every_file(folder):
    (uncropped, _), dataset = batch(folder, on_device=False)
    assert uncropped.jpegs == [] and dataset.base.loader is not device_crops.read_jpeg_or_decode


def test_the_device_decoded_batch_is_the_pil_decoded_one(folder):
    (pil, _), _ = batch(folder, on_device=False)
    (device, _), dataset = batch(folder, on_device=True)
    decoded = device_crops.images_on_device([j for j, _, _ in device.jpegs], torch.device("cpu"))
    for image, (jpeg, _, _) in zip(decoded, device.jpegs, strict=True):
        pixels = TF.pil_to_tensor(common.load_image(jpeg.path))
        assert image.shape == pixels.shape and (image.int() - pixels.int()).abs().max() <= 1
    assert torch.equal(device.pack, pil.pack) and device.shape == pil.shape  # the same draws
    crops_pil, pil_geometry = common.crops_on_device((pil, None), torch.device("cpu"))
    crops_device, device_geometry = common.crops_on_device((device, None), torch.device("cpu"))
    for a, b in zip(pil_geometry, device_geometry):
        assert all(torch.equal(a[key], b[key]) for key in a)
    for a, b in zip(crops_pil, crops_device):
        assert (a - b).abs().mean() * 255 < 0.1  # 1 level of 255 at most where libjpegs differ


def test_a_batch_with_a_file_the_device_decoder_refuses_is_decoded_by_pil_with_a_warning(
        folder, monkeypatch, capsys):
    (uncropped, _), _dataset = batch(folder, on_device=True)
    jpegs = [jpeg for jpeg, _, _ in uncropped.jpegs]

    def decode_jpeg(data, **kwargs):
        raise RuntimeError("nvjpegDecodeBatched failed: 3\nmore lines")
    monkeypatch.setattr(device_crops.tv_io, "decode_jpeg", decode_jpeg)
    images = device_crops.images_on_device(jpegs, torch.device("cpu"))
    for image, jpeg in zip(images, jpegs, strict=True):
        assert torch.equal(image, TF.pil_to_tensor(common.load_image(jpeg.path)))
    out = capsys.readouterr().out
    assert out.count("warning:") == 1
    assert (f"warning: the cpu JPEG decoder refused a file of {len(jpegs)} (nvjpegDecodeBatched "
            f"failed: 3): PIL decodes them, {jpegs[0].path} ...") in out


def test_a_cut_jpeg_is_the_workers_to_decode_and_to_refuse(folder, tmp_path):
    whole = (folder / "a/baseline.jpg").read_bytes()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(whole[: len(whole) // 2])  # no end marker: never handed over
    with pytest.raises(common.BadImageError, match=f"cannot read image {cut}"):
        device_crops.read_jpeg_or_decode(cut)
    missing = tmp_path / "missing.jpg"
    with pytest.raises(common.BadImageError, match=f"cannot read image {missing}"):
        device_crops.read_jpeg_or_decode(missing)


def test_a_loader_on_a_gpu_hands_the_jpegs_over(folder, monkeypatch):
    augment = common.MultiCropAugmentation(local_crops_number=2, global_crop_size=16,
                                           local_crop_size=8)
    seeded = common.SeededDataset(common.ImageFolderSafe(str(folder)), augment, seed=3)
    dataset = device_crops.BatchedCrops(seeded, "cuda")  # as built for a GPU
    assert dataset.base.loader is device_crops.read_jpeg_or_decode
    loader, sampler = common.make_loader(dataset, 4, num_workers=1, seed=3)  # pin_memory off
    sampler.set_epoch(0)
    handed_over = []
    for views, _labels in loader:
        handed_over += [Path(j.path).name for j, _, _ in views[0].jpegs]
        common.crops_on_device(views, torch.device("cpu"))
    assert sorted(handed_over) == sorted(Path(n).name for n in DEVICE_DECODED)  # 2 batches


def test_the_decode_check_in_its_cpu_form(tmp_path, capsys):
    """extras/perf/decode_check.py, the GPU check part that decodes while a backward is queued,
    on the CPU: the same code path in line, the same pixels in every round, one JSON line."""
    sys.path.insert(0, str(ROOT / "extras" / "perf"))
    import decode_check
    out = tmp_path / "decode_check.jsonl"
    assert decode_check.main(["--device", "cpu", "--images", "6", "--size", "64", "--rounds", "2",
                              "--width", "32", "--jpeg_cache", str(tmp_path / "jpegs"),
                              "--out", str(out)]) == 0
    assert "the same pixels in every round" in capsys.readouterr().out
    line = json.loads(out.read_text())
    assert line["changed_images_per_round"] == [0, 0] and line["images"] == 6
    assert line["max_abs_diff_from_cpu_decoder"] == 0  # the same decoder, here
