"""Image folders and evaluation splits read right: unusual image modes are converted, the test
split's labels are numbered by the train split's class names, --holdout of a class-sorted folder
is drawn from every class (a named dataset keeps its last images), hidden folders and FIFOs are
no images, an unreadable evaluation image is left out (never replaced by its neighbour), and the
sparse labels of saved features are voted as classes."""
import os
import shutil
import sys
from argparse import Namespace

import torch

from conftest import (ROOT, EVAL, FOLDER_ARGS, run_here, parse, image_folder, make_folder,
                      save_features)
import common
import eval_knn
sys.path.append(str(ROOT / "extras" / "tools"))
import eval_correspondence  # noqa: E402
import teacher_outputs  # noqa: E402


def test_unusual_image_modes_are_converted(tmp_path):
    make_folder(tmp_path / "data", bad=False)
    r = run_here("dino.py", *FOLDER_ARGS, "--data_path", str(tmp_path / "data"), "--output_dir",
                 str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]


def test_knn_on_a_val_split_with_fewer_classes_is_right(tmp_path):
    """val/ = copies of train/'s class-b images: their nearest train image is themselves (1-NN
    top-1 100%); numbered per split, val's b would be class 0 and score 0%."""
    image_folder(tmp_path / "train", ["a", "b"])
    (tmp_path / "val").mkdir()
    shutil.copytree(tmp_path / "train" / "b", tmp_path / "val" / "b")
    r = run_here("eval_knn.py", *EVAL, "--dataset", "folder", "--data_path", str(tmp_path),
                 "--nb_knn", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1-NN classifier result: top-1 100.00%" in r.stdout


def test_holdout_of_a_class_sorted_folder_is_drawn_from_every_class(tmp_path):
    image_folder(tmp_path / "train", ["a", "b", "c"], per_class=6)
    args = Namespace(dataset="folder", data_path=str(tmp_path), holdout=6, skip_bad_images=False)
    train, held = common.build_eval_splits(args)
    assert len(set(held.dataset.targets[i] for i in held.indices)) > 1        # it was class c alone
    assert sorted(train.indices + held.indices) == list(range(18))
    again = common.build_dataset(args, train=False)          # every script, every run: one split
    assert again.indices == held.indices


def test_holdout_of_a_named_dataset_is_still_its_last_images():
    """The logged results' validation splits (Fashion-MNIST, synthetic) stay as they were."""
    args = Namespace(dataset="synthetic", data_path=None, holdout=5, synthetic_images=20,
                     synthetic_image_size=16, synthetic_seed=0)
    assert list(common.build_dataset(args, train=False).indices) == list(range(15, 20))
    assert list(common.build_dataset(args, train=True).indices) == list(range(15))


def test_hidden_folders_and_files_are_no_class_and_no_image(tmp_path):
    image_folder(tmp_path / "train", ["a", "b"])
    image_folder(tmp_path / "train" / ".ipynb_checkpoints", ["x"])
    shutil.copy(tmp_path / "train" / "a" / "0.png", tmp_path / "train" / "b" / "._0.png")
    train = common.build_dataset(Namespace(dataset="folder", data_path=str(tmp_path), holdout=0),
                                 train=True)
    assert train.classes == ["a", "b"] and len(train) == 8


def test_a_fifo_in_an_image_folder_is_not_listed(tmp_path):
    image_folder(tmp_path / "train", ["a", "b"])
    os.mkfifo(tmp_path / "train" / "a" / "pipe.png")          # reading it would block for ever
    train = common.build_dataset(Namespace(dataset="folder", data_path=str(tmp_path), holdout=0),
                                 train=True)
    assert len(train) == 8 and not any("pipe" in path for path, _ in train.samples)


def test_evaluating_a_holdout_leaves_unreadable_images_out_instead_of_substituting(tmp_path,
                                                                                   capsys):
    """With --holdout the evaluation splits are subsets of one image folder: an unreadable image
    is still left out, not replaced by its neighbour with the neighbour's label."""
    data = image_folder(tmp_path / "data", ["a", "b"], per_class=6)
    (data / "b" / "5.png").write_bytes(b"not an image")
    args = parse(eval_knn, [*EVAL, "--dataset", "folder", "--data_path", str(data),
                            "--skip_bad_images", "--holdout", "4", "--nb_knn", "2"])
    eval_knn.main(args)
    assert "k-NN over 8 train and 3 test images" in capsys.readouterr().out


def test_extras_leave_an_unreadable_image_out_instead_of_counting_its_neighbour_twice(
        tmp_path, patch8_checkpoint, capsys):
    data = image_folder(tmp_path / "data" / "val", ["a", "b"], per_class=2).parent
    (data / "val" / "a" / "1.png").write_bytes(b"not an image")
    flags = ["--pretrained_weights", str(patch8_checkpoint), "--dataset", "folder", "--data_path",
             str(data), "--skip_bad_images"]
    teacher_outputs.main(parse(teacher_outputs, [*flags, "--crop", "32", "--resize", "32"]))
    assert "3 images (1 unreadable, left out)" in capsys.readouterr().out
    argv = [*flags, "--crop_size", "32", "--protocols", "glsd", "--num_workers", "0", "--device",
            "cpu"]
    results = eval_correspondence.main(parse(eval_correspondence, argv))
    assert results["glsd"]["pairs"] == 3


def test_sparse_saved_labels_are_voted_as_dense_classes(tmp_path):
    """Another tool's class ids (e.g. 10 ** 12) sized the vote's one-hot rows: out of memory."""
    import eval_knn
    args = save_features(tmp_path, torch.tensor([0, 10 ** 12, 7]), torch.tensor([10 ** 12]))
    assert eval_knn.main(args) == {1: (100.0, None)}
