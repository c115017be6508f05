"""Rules: every numeric flag has a range the code can honour (a value outside it is refused by
argparse in one line naming the flag, never an allocation failure that blames nothing or another
flag); an image whose decoder reports damage is unreadable (--skip_bad_images applies), on the PIL
path and on the device-decode path."""
import io
import importlib

import numpy as np
import pytest
from PIL import Image, ImageFile

import common
import device_crops

HUGE = "2147483647"
OUT_OF_RANGE = [  # each was accepted, then failed in an allocation or a message on another flag
    ("dino.py", "--out_dim", HUGE), ("dino.py", "--head_hidden_dim", HUGE),
    ("dino.py", "--head_bottleneck_dim", HUGE), ("dino.py", "--synthetic_image_size", HUGE),
    ("dino.py", "--synthetic_images", HUGE), ("dino.py", "--global_crop_size", "2147483632"),
    ("dino.py", "--local_crop_size", "4096"), ("dino.py", "--local_crops_number", HUGE),
    ("dino.py", "--patch_size", HUGE), ("dino.py", "--num_workers", "100000"),
    ("dino.py", "--warmup_teacher_temp_epochs", "1e30"), ("dino.py", "--freeze_last_layer", "1e30"),
    ("esvit.py", "--window_size", HUGE), ("glsd.py", "--warmup_epochs", "1e30"),
    ("selfpatch.py", "--patch_out_dim", HUGE), ("drloc.py", "--drloc_pairs", HUGE),
    ("drloc.py", "--input_size", "2147483632"), ("drloc.py", "--lambda_warmup_epochs", HUGE),
    ("eval_knn.py", "--resize", HUGE), ("eval_knn.py", "--crop", "4096"),
    ("eval_linear.py", "--patch_size", HUGE)]
AT_THE_TOP = {"--out_dim": "262144", "--head_hidden_dim": "8192", "--local_crops_number": "64",
              "--synthetic_image_size": "2048", "--patch_size": "64", "--num_workers": "256",
              "--warmup_teacher_temp_epochs": "10000", "--synthetic_images": "10000000"}


@pytest.mark.parametrize("script, flag, value", OUT_OF_RANGE)
def test_a_value_outside_a_flags_range_is_refused_naming_the_flag(capsys, script, flag, value):
    parser = importlib.import_module(script[:-3]).get_args_parser()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and f"error: argument {flag}: " in err, err
    assert f"{value} is out of range: expected a value in " in err, err


def test_the_top_of_each_range_is_accepted():
    args = importlib.import_module("dino").get_args_parser().parse_args(
        [x for flag_value in AT_THE_TOP.items() for x in flag_value])
    assert args.out_dim == 262144 and args.warmup_teacher_temp_epochs == 10000


def damaged_folder(root):
    """root/a: a good PNG and JPEG; a PNG cut in half; a JPEG whose scan holds a stray marker
    (its end intact: a whole file to the eye)."""
    (root / "a").mkdir(parents=True)
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    for fmt in ("png", "jpg"):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "JPEG" if fmt == "jpg" else "PNG", quality=90)
        data = buffer.getvalue()
        (root / "a" / f"good.{fmt}").write_bytes(data)
        if fmt == "png":
            (root / "a" / "cut.png").write_bytes(data[:len(data) // 2])
        else:
            middle = len(data) // 2
            (root / "a" / "marker.jpg").write_bytes(data[:middle] + b"\xff\xdf" * 20
                                                    + data[middle + 40:])
    return root


def readable(folder, loader=None):
    """The files of `folder` that an ImageFolderSafe with --skip_bad_images yields, and how many
    it skipped."""
    dataset = common.ImageFolderSafe(str(folder), skip_bad_images=True)
    dataset.loader = loader or dataset.loader
    dataset.substitute = False
    kept = [dataset.samples[i][0].rsplit("/", 1)[1] for i in range(len(dataset))
            if dataset[i][1] != dataset.SKIPPED]
    return kept, dataset.skipped.value


def test_a_cut_image_is_unreadable_whatever_a_library_set(tmp_path, monkeypatch):
    """PIL fills a cut file with grey when LOAD_TRUNCATED_IMAGES is on (some libraries turn it
    on globally at import)."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    kept, skipped = readable(damaged_folder(tmp_path))
    assert sorted(kept) == ["good.jpg", "good.png"] and skipped == 2


def test_a_damaged_jpeg_is_unreadable_on_the_device_decode_path(tmp_path):
    """The device path's loader hands a whole-looking JPEG to the device decoder unread: one with
    a stray marker in its scan (PIL: "broken data stream") is checked by PIL, and skipped."""
    folder = damaged_folder(tmp_path)
    with pytest.raises(common.BadImageError, match="marker.jpg: broken data stream"):
        device_crops.read_jpeg_or_decode(folder / "a" / "marker.jpg")
    assert isinstance(device_crops.read_jpeg_or_decode(folder / "a" / "good.jpg"),
                      device_crops.EncodedJpeg)
    kept, skipped = readable(folder, device_crops.read_jpeg_or_decode)
    assert sorted(kept) == ["good.jpg", "good.png"] and skipped == 2
