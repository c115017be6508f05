"""The learning curves of extras/experiments/compare.py's runs as one PNG: two panels (20-NN,
`overlap` correspondence) against steps, a row in one style everywhere, the seeds that kept
checkpoints (mean, range bars), raw pixels as a level. The picture carries the data it is drawn
from in a PNG text chunk (tests/test_pictures.py compares it with a redraw's).

    python extras/experiments/curves.py --log docs/data/compare_32px.jsonl --data fashion_mnist \
        --phase test --output docs/comparison_curves.png
"""
import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, __version__ as PILLOW
from PIL.PngImagePlugin import PngInfo
from torchvision.transforms.functional import pil_to_tensor, to_pil_image

# Run as `python extras/experiments/curves.py` from anywhere: the project's modules sit two folders
# up, compare_tables in this file's folder (on sys.path when it runs as a script).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import compare_tables  # noqa: E402

# the colour of a row that ROW_STYLES does not name
OTHER_ROW = (230, 25, 75)


# the learning curves' two metrics: log key, axis label
CURVES = (("knn_top1", "20-NN top-1 (%)"),
          ("overlap_accuracy", "overlap: all-token correspondence accuracy (%)"))


def curve_series(records, data, phase, variant="recipe"):
    """{row: {"seeds": the seeds drawn, "points": [(step, {metric: (mean, low, high)}), ...]}} of
    the trained rows of one comparison. A row is drawn over the seeds that logged a curve (its kept
    checkpoints): step 0 is the random-init record of the row's own network and seed (any variant:
    the initialisation depends on the network and the seed only), then the kept checkpoints, then
    the final one; mean and range over those seeds at each step."""
    def point(step, record):
        overlap = record["correspondence"]["overlap"]["accuracy"]
        return step, {"knn_top1": record["knn_top1"], "overlap_accuracy": overlap}

    base = compare_tables.baselines(records, data, phase)
    runs = {}
    for r in records:
        if (r["data"], r["phase"], r["variant"]) != (data, phase, variant) or not r.get("curve"):
            continue
        start = base.get((compare_tables.baseline_row(r["row"]), r["seed"]))
        points = ([point(0, start)] if start else []) + [
            (c["step"], {k: c[k] for k, _ in CURVES}) for c in r["curve"]] + [point(r["steps"], r)]
        runs.setdefault(r["row"], {})[r["seed"]] = dict(points)
    series = {}
    for row, by_seed in runs.items():
        # the steps every drawn seed has
        steps = sorted(set.intersection(*(set(run) for run in by_seed.values())))

        def spread(step, k):
            values = [run[step][k] for run in by_seed.values()]
            return statistics.mean(values), min(values), max(values)
        series[row] = {"seeds": sorted(by_seed), "points": [
            (step, {k: spread(step, k) for k, _ in CURVES}) for step in steps]}
    return series


# one colour, dash pattern (None: solid) and marker per row, the same in every picture; a row
# that can lie on another (GLSD similarity is EsViT's loss) is dashed, in a contrasting colour,
# drawn on top
ROW_STYLES = {"vit_dino": ((230, 25, 75), None, "circle"),
              "vit_selfpatch": ((60, 180, 75), None, "square"),
              "vit_esvit": ((0, 130, 200), None, "triangle"),
              "vit_glsd": ((245, 130, 48), None, "diamond"),
              "swin_dino": ((170, 110, 40), None, "circle"),
              "swin_esvit": ((145, 30, 180), None, "square"),
              "swin_glsd_geometric": ((0, 128, 128), None, "diamond"),
              "swin_glsd_similarity": ((240, 170, 0), (7, 5), "triangle")}


def curves_title(series, data, phase, variant):
    """What the picture shows, exactly: which seeds each line is, and what the bars are."""
    seed_sets = {tuple(s["seeds"]) for s in series.values()}
    if len(seed_sets) == 1:
        seeds = next(iter(seed_sets))
        what = (f"seed {seeds[0]} only (the one seed that evaluated its kept checkpoints)"
                if len(seeds) == 1 else
                f"mean of seeds {', '.join(map(str, seeds))}, bars: their range")
    else:
        what = ("per row, the seeds named in the legend (more than one: their mean, bars: their "
                "range)")
    return (f"{data}, {phase} phase, {variant}: {what}; step 0 = the row's own network at random "
            "init")


def draw_marker(draw, shape, x, y, colour, r=3):
    corners = {"square": [(x - r, y - r), (x + r, y - r), (x + r, y + r), (x - r, y + r)],
               "triangle": [(x, y - r - 1), (x - r - 1, y + r), (x + r + 1, y + r)],
               "diamond": [(x, y - r - 1), (x + r + 1, y), (x, y + r + 1), (x - r - 1, y)]}
    if shape in corners:
        return draw.polygon(corners[shape], fill=colour)
    draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)


def draw_polyline(draw, points, colour, dash, width=2):
    """A polyline, solid or dashed ((on, off) pixels along each segment)."""
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        if dash is None:
            draw.line([xa, ya, xb, yb], fill=colour, width=width)
            continue
        length = max(((xb - xa) ** 2 + (yb - ya) ** 2) ** 0.5, 1e-9)
        t = 0.0
        while t < length:
            u = min(t + dash[0], length)
            draw.line([xa + (xb - xa) * t / length, ya + (yb - ya) * t / length,
                       xa + (xb - xa) * u / length, ya + (yb - ya) * u / length],
                      fill=colour, width=width)
            t += dash[0] + dash[1]


def curves_picture(series, title, pixels=None, panel=(420, 300), margin=(56, 30, 20, 40)):
    """Two panels (the metrics of CURVES), one line per row (ROW_STYLES: colour, dash, marker), the
    range over the drawn seeds as a vertical bar at each step, the raw pixels' 20-NN (`pixels`) as
    a grey dashed level, a legend below: uint8 [3, H, W]. margin: left, top, right, bottom of each
    plot."""
    # dashed rows last: drawn on top
    rows = sorted(series, key=lambda row: ROW_STYLES.get(row, (None, None))[1] is not None)
    left, top, right, bottom = margin
    legend_height = 16 * ((len(rows) + 1) // 2) + 10
    width, height = 2 * panel[0], panel[1] + legend_height + 34
    picture = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(picture)
    for i, line in enumerate(textwrap.wrap(title, 130)[:2]):
        draw.text((8, 4 + 12 * i), line, fill="black")
    steps = sorted({s for rs in series.values() for s, _ in rs["points"]}) or [0, 1]
    for p, (metric, label) in enumerate(CURVES):
        x0, y0 = p * panel[0] + left, 34 + top
        x1, y1 = (p + 1) * panel[0] - right, 34 + panel[1] - bottom
        level = pixels if metric == "knn_top1" else None
        values = ([v for rs in series.values() for _, m in rs["points"] for v in m[metric]]
                  + [level] * (level is not None) or [0.0, 1.0])
        low, high = min(values), max(values)
        pad = max(high - low, 1.0) * 0.08
        low, high = low - pad, high + pad

        def xy(step, value):
            return (x0 + (x1 - x0) * (step - steps[0]) / max(steps[-1] - steps[0], 1),
                    y1 - (y1 - y0) * (value - low) / (high - low))

        draw.rectangle([x0, y0, x1, y1], outline="black")
        draw.text((x0, y0 - 14), label, fill="black")
        for k in range(5):                                  # value ticks
            value = low + (high - low) * k / 4
            y = xy(steps[0], value)[1]
            draw.line([x0 - 4, y, x0, y], fill="black")
            draw.text((x0 - 44, y - 6), f"{value:6.1f}", fill="black")
        for step in steps:                                  # step ticks
            x = xy(step, low)[0]
            draw.line([x, y1, x, y1 + 4], fill="black")
            draw.text((x - 10, y1 + 6), str(step), fill="black")
        draw.text(((x0 + x1) / 2 - 30, y1 + 20), "training steps", fill="black")
        if level is not None:
            draw_polyline(draw, [(x0, xy(steps[0], level)[1]), (x1, xy(steps[0], level)[1])],
                          (128, 128, 128), (4, 4), 1)
            draw.text((x0 + 4, xy(steps[0], level)[1] - 12), f"raw pixels {level:.1f}",
                      fill=(96, 96, 96))
        for row in rows:
            colour, dash, marker = ROW_STYLES.get(row, (OTHER_ROW, None, "circle"))
            points = [(xy(s, m[metric][0]), xy(s, m[metric][1]), xy(s, m[metric][2]))
                      for s, m in series[row]["points"]]
            if len(points) > 1:
                draw_polyline(draw, [mean for mean, _, _ in points], colour, dash)
            for (x, y), (_, y_low), (_, y_high) in points:
                if y_high != y_low:
                    draw.line([x, y_low, x, y_high], fill=colour, width=1)
                    draw.line([x - 3, y_low, x + 3, y_low], fill=colour)
                    draw.line([x - 3, y_high, x + 3, y_high], fill=colour)
                draw_marker(draw, marker, x, y, colour)
    seed_sets = {tuple(s["seeds"]) for s in series.values()}
    for i, row in enumerate(series):                        # legend: two columns, the log's order
        colour, dash, marker = ROW_STYLES.get(row, (OTHER_ROW, None, "circle"))
        x, y = 20 + (i % 2) * panel[0], 34 + panel[1] + 4 + 16 * (i // 2)
        draw_polyline(draw, [(x, y + 6), (x + 24, y + 6)], colour, dash, width=3)
        draw_marker(draw, marker, x + 12, y + 6, colour)
        seeds = ("" if len(seed_sets) == 1
                 else f" (seeds {', '.join(map(str, series[row]['seeds']))})")
        draw.text((x + 30, y), row + seeds, fill="black")
    return pil_to_tensor(picture)


def get_args_parser():
    p = argparse.ArgumentParser("curves.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--log", default="docs/data/compare_32px.jsonl",
                   help="extras/experiments/compare.py's JSON lines")
    p.add_argument("--data", default="fashion_mnist", help="which comparison: its --data")
    p.add_argument("--phase", default="test", choices=["val", "test"],
                   help="which comparison: its --phase")
    p.add_argument("--variant", default="recipe", help="which comparison: its --variant")
    p.add_argument("--output", default="curves.png", type=str, help="PNG file to write")
    return p


def main(args):
    # before any work: one line, not a traceback once the picture is drawn
    if Path(args.output).is_dir():
        common.die(f"--output {args.output} is a folder; name the PNG file to write (e.g. "
                   "curves.png in it)")
    series, title, pixels = curves_inputs(args)
    data = curves_data(series, title, pixels)
    return save_curves(curves_picture(series, title, pixels), data, args)


def curves_inputs(args):
    """(series, title, raw-pixel level) of the curves picture that `args` (the curves command's)
    draws from its --log."""
    records = compare_tables.current(compare_tables.read_checked(args.log))   # as shown
    series = curve_series(records, args.data, args.phase, args.variant)
    if not series:
        common.die(f"{args.log} has no learning curve of --data {args.data} --phase {args.phase} "
                   f"--variant {args.variant} (extras/experiments/compare.py logs one for each "
                   f"seed in --curve_seeds)")
    pixels = next((r["knn_top1"] for r in records
                   if (r["data"], r["phase"], r["row"]) == (args.data, args.phase, "pixels")), None)
    return series, curves_title(series, args.data, args.phase, args.variant), pixels


def curves_data(series, title, pixels):
    """What a curves picture is drawn from, as the JSON text it carries (its PNG's "curves" chunk):
    a test compares it with a redraw's, which no font or library version can change."""
    return json.dumps({"title": title, "series": series, "pixels": pixels}, sort_keys=True)


def save_curves(picture, data, args):
    """The curves picture, with the data it is drawn from and the Pillow that drew its text (a
    pixel comparison with a redraw holds only under the same Pillow) in its PNG text chunks."""
    info = PngInfo()
    info.add_text("curves", data)
    info.add_text("pillow", PILLOW)
    with common.open_for_writing(args.output, "wb") as f:  # never through a symbolic link
        to_pil_image(picture).save(f, format="PNG", pnginfo=info)
    common.log(f"curves picture written to {args.output}")
    return picture


if __name__ == "__main__":
    common.run_script(main, get_args_parser())
