"""The rows of extras/experiments/compare.py's controlled comparison (backbones, each method's own
flags, the random-init rows, the summary's columns) and the fields of its log lines that the
tables and the curves read. Not a script."""


BACKBONES = {"vit": "--arch vit_pico --patch_size 4", "swin": "--arch swin_pico3 --fit_window true"}
# row: (backbone, script, the method's own flags)
METHOD_FLAGS = {
    "vit_dino": ("vit", "dino.py", ""),
    "vit_selfpatch": ("vit", "selfpatch.py", "--patch_out_dim 1024"),     # K_p = K
    "vit_esvit": ("vit", "esvit.py", "--use_region_loss true"),
    "vit_glsd": ("vit", "glsd.py", "--local_matching geometric"),
    "swin_dino": ("swin", "dino.py", ""),
    "swin_esvit": ("swin", "esvit.py", "--use_region_loss true"),
    "swin_glsd_geometric": ("swin", "glsd.py", "--local_matching geometric"),
    "swin_glsd_similarity": ("swin", "glsd.py", "--local_matching similarity"),
}
# random-init row: the row whose network (at its first step) it evaluates
RANDOM_ROWS = {"vit_random": "vit_dino", "swin_random": "swin_dino",
               "vit_selfpatch_random": "vit_selfpatch"}
ROWS = [*METHOD_FLAGS, *RANDOM_ROWS, "pixels"]
# column: {backbone: its row}; a backbone without the method shows n/a
SUMMARY_COLUMNS = {"DINO": {"vit": "vit_dino", "swin": "swin_dino"},
                   "EsViT": {"vit": "vit_esvit", "swin": "swin_esvit"},
                   "SelfPatch": {"vit": "vit_selfpatch"},
                   "GLSD geometric": {"vit": "vit_glsd", "swin": "swin_glsd_geometric"},
                   "GLSD similarity": {"swin": "swin_glsd_similarity"}}


def trained(r):
    return r.get("row") in METHOD_FLAGS


def evaluated(r):
    return r.get("row") != "pixels"


def always(r):
    return True


# every field of a log line that the tables and the curves read: (key, kind, for which lines,
# optional); provenance.check_fields refuses a line without them in one line
FIELDS = [("data", "text", always, False), ("row", set(ROWS), always, False),
          ("variant", "text", always, False), ("phase", {"val", "test"}, always, False),
          ("seed", "integer", always, False), ("steps", "integer", always, False),
          ("knn_top1", "number", always, False), ("utc", "text", always, True),
          ("withdrawn", "text", always, True),
          *((f"correspondence.{p}.{k}", "number", evaluated, False)
            for p, k in (("esvit", "top10_accuracy"), ("esvit", "accuracy"),
                         ("overlap", "accuracy"))),
          ("random_init", "true", lambda r: r.get("row") in RANDOM_ROWS, False),
          ("linear_top1", "number or null", evaluated, True),
          ("commands", "list", lambda r: trained(r) and "network" not in r, False),
          ("network", "object", evaluated, True), ("start_of", "text", evaluated, True),
          ("train_seconds", "number", evaluated, True),
          ("peak_memory_mb", "number", evaluated, True),
          ("teacher_entropy", "number", evaluated, True),
          ("mean_target_entropy", "number", evaluated, True),
          ("ln_k", "number", lambda r: "teacher_entropy" in r or "mean_target_entropy" in r, False),
          ("cpu_seconds", "object", evaluated, True), ("curve", "list", trained, True),
          ("machine", "object", lambda r: "utc" in r, True), ("extra", "text", always, True),
          ("knn_top1_by_k", "object", always, True)]
CURVE_FIELDS = [("step", "integer", always, False), ("knn_top1", "number", always, False),
                ("overlap_accuracy", "number", always, False)]
