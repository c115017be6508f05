"""DINO's four k in docs/COMPARISON.md: every line that logged the k-NN at k = 10, 20, 100 and 200
(`knn_top1_by_k`), and each trained row against the raw pixels at the same k, seed by seed, with
the findings rule of claims.py (not a script)."""
import claims
import provenance
from compare_rows import METHOD_FLAGS, RANDOM_ROWS
from compare_tables import signed

KS = ("10", "20", "100", "200")
IMAGES = {"fashion_mnist": 10000, "fashion_mnist_8k": 2000, "shapes": 2000}   # evaluated


def knn_k_table(records):
    """The lines that logged the k-NN at DINO's four k (`knn_top1_by_k`), one per line."""
    lines = ["| row | data | phase | steps | seed | " + " | ".join(f"{k}-NN top-1 (%)" for k in KS)
             + " | logged (UTC) |", "|---" * (6 + len(KS)) + "|"]
    for r in records:
        if isinstance(r.get("knn_top1_by_k"), dict):
            values = [r["knn_top1_by_k"].get(k) for k in KS]
            cells = [f"{v:.2f}" if provenance.is_number(v) else "—" for v in values]
            steps = "—" if r["row"] == "pixels" or r["row"] in RANDOM_ROWS else r["steps"]
            lines.append(f"| {r['row']} | {r['data']} | {r['phase']} | {steps} | {r['seed']} | "
                         + " | ".join(cells) + f" | {provenance.when(r)} |")
    return "\n".join(lines) if len(lines) > 2 else "No line holds the k-NN at four k yet."


def all_four_k(record):
    """Whether the line holds a number at each of the four k (a line without them is no row of
    the differences, rather than a KeyError)."""
    by_k = record.get("knn_top1_by_k")
    return isinstance(by_k, dict) and all(provenance.is_number(by_k.get(k)) for k in KS)


def knn_k_pixels_table(records, data="fashion_mnist", phase="test"):
    """Each trained row's k-NN minus the raw pixels' at the same k (same split, same vote), seed by
    seed from unrounded values, and whether the difference is a finding (claims.finding: beyond the
    seeds' spread and one evaluation's binomial error)."""
    by_k = [r for r in records if (r["data"], r["phase"]) == (data, phase) and all_four_k(r)]
    pixels = next((r["knn_top1_by_k"] for r in by_k if r["row"] == "pixels"), None)
    groups = {}
    for r in sorted(by_k, key=lambda r: (r["steps"], r["row"], r["seed"])):
        if r["row"] in METHOD_FLAGS and pixels:      # a variant is a setting of its own
            groups.setdefault((r["row"], r["variant"], r["steps"]), []).append(r["knn_top1_by_k"])
    header = " | ".join(f"{k}-NN minus pixels (seed 0, 1, ...)" for k in KS)
    lines = [f"| row | variant | steps | seeds | {header} |", "|---" * 8 + "|"]
    for (row, variant, steps), seeds in groups.items():
        cells = []
        for k in KS:
            diffs = [values[k] - pixels[k] for values in seeds]
            error = claims.binomial_error([v[k] for v in seeds] + [pixels[k]], IMAGES[data])
            verdict = claims.finding(diffs, error) if len(diffs) > 1 else "one seed"
            cells.append(f"{signed(diffs)} ({', '.join(f'{d:+.2f}' for d in diffs)}): {verdict}")
        lines.append(f"| {row} | {variant} | {steps} | {len(seeds)} | " + " | ".join(cells) + " |")
    return ("\n".join(lines) if len(lines) > 2
            else f"No trained row on {data}'s {phase} split holds the k-NN at four k yet.")
