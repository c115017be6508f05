"""The learning-curve pictures of docs/COMPARISON.md are what their listed commands draw from the
committed log: the data each picture carries (its PNG's "curves" text) equals a redraw's, and its
pixels equal a redraw's wherever the same Pillow draws (Pillow's default font, which draws the
labels, differs between versions)."""

import json
import re
import shlex
import sys
from pathlib import Path

import PIL
import pytest
import torch
from PIL import Image
from torchvision.transforms.functional import pil_to_tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "extras" / "experiments"))
import curves  # noqa: E402


def curves_commands():
    """The `curves.py` commands that docs/COMPARISON.md lists, parsed."""
    text = (ROOT / "docs" / "COMPARISON.md").read_text().replace("\\\n", " ")
    lines = re.findall(r"python extras/experiments/curves\.py[^\n]*", text)
    return [curves.get_args_parser().parse_args(shlex.split(line)[2:]) for line in lines]


def test_every_curves_picture_of_the_documents_has_its_command():
    drawn = {Path(args.output).name for args in curves_commands()}
    shown = set(
        re.findall(
            r"\((comparison_curves[\w]*\.png)\)", (ROOT / "docs" / "COMPARISON.md").read_text()
        )
    )
    assert shown and shown <= drawn


@pytest.mark.parametrize("args", curves_commands(), ids=lambda a: Path(a.output).name)
def test_a_committed_curves_picture_equals_its_redraw(args):
    picture = Image.open(ROOT / args.output)
    series, title, pixels = curves.curves_inputs(args)
    redraw_data = json.loads(curves.curves_data(series, title, pixels))
    assert json.loads(picture.text["curves"]) == redraw_data, (
        f"{args.output}: redraw it (the log moved)"
    )
    if picture.text.get("pillow") == PIL.__version__:
        redraw = curves.curves_picture(series, title, pixels)
        assert torch.equal(pil_to_tensor(picture.convert("RGB")), redraw), f"{args.output} differs"


def test_a_picture_drawn_before_its_log_changed_fails(tmp_path):
    """The check can fail: a picture drawn from a log whose figure later moved."""
    args = curves_commands()[0]
    series, title, pixels = curves.curves_inputs(args)
    row = next(iter(series))
    step, values = series[row]["points"][-1]
    series[row]["points"][-1] = (step, {**values, "knn_top1": (1.0, 1.0, 1.0)})
    assert json.loads(curves.curves_data(series, title, pixels)) != json.loads(
        Image.open(ROOT / args.output).text["curves"]
    )
