"""The README and docs/ say what the code does: every command in them that runs one of the project's
scripts (`python X.py ...`, `torchrun ... X.py ...`) parses with that script's own
`get_args_parser()`; every argument has its --help text; the README stays under 350 lines; every
file they link to exists; and no issue numbers. Only parsing: the paths in the commands need not
exist."""
import contextlib
import importlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))



ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


def command_lines(markdown):
    """Logical lines of the ```bash blocks: backslash continuations joined, and the variables that
    a block assigns (`COMMON="--epochs 2 ..."`) expanded in the lines after them."""
    lines, in_block, current, variables = [], False, "", {}
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block and line.strip() in ("```bash", "```sh")
            variables = {}
            continue
        if not in_block:
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        line, current = current + line, ""
        line = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
        assignment = ASSIGNMENT.match(line.strip())
        if assignment:
            variables[assignment.group(1)] = " ".join(shlex.split(assignment.group(2)))
            continue
        lines.append(line)
    return lines


def script_commands(markdown):
    """(script path, its arguments) of every line that runs one of the project's Python scripts."""
    found = []
    for line in command_lines(markdown):
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word.endswith(".py") and (ROOT / word).is_file():
                arguments = words[i + 1:]
                if arguments and arguments[-1] == "&":
                    arguments = arguments[:-1]
                found.append((word, arguments))
                break
    return found


def parser_of(script):
    path = ROOT / script
    for folder in (str(ROOT), str(path.parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    module = importlib.import_module(path.stem)
    assert hasattr(module, "get_args_parser"), f"{script} has no get_args_parser()"
    return module.get_args_parser()


def parse_error(script, arguments):
    """None when `arguments` parse with the script's parser, else argparse's message."""
    parser, stderr = parser_of(script), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(arguments)
    except SystemExit:
        return (stderr.getvalue().strip().splitlines() or ["argparse exited"])[-1]
    return None


COMMANDS = [(doc.relative_to(ROOT).as_posix(), script, arguments)
            for doc in [README, *DOCS] for script, arguments in script_commands(doc.read_text())]


def test_the_readme_and_docs_hold_commands_of_every_script():
    scripts = {script for doc, script, _ in COMMANDS if doc == "README.md"}
    assert {"dino.py", "esvit.py", "glsd.py", "selfpatch.py", "drloc.py", "eval_knn.py", "eval_linear.py"} <= scripts


@pytest.mark.parametrize("doc, script, arguments", COMMANDS,
                         ids=[f"{doc}:{script}:{i}" for i, (doc, script, _) in enumerate(COMMANDS)])
def test_command_parses_with_its_script(doc, script, arguments):
    error = parse_error(script, arguments)
    assert error is None, f"{doc}: {script} {' '.join(arguments)}\n  {error}"


def test_a_wrong_flag_is_caught():
    assert parse_error("dino.py", ["--arch", "vit_small", "--no_such_flag", "1"]) is not None
    assert parse_error("eval_linear.py", ["--avgpool_patchtokens"]) is not None   # it takes a value
    assert script_commands("```bash\ntorchrun --nproc_per_node 8 dino.py --epochs 3 \\\n    --lr 0.1 &  # note\n```") \
        == [("dino.py", ["--epochs", "3", "--lr", "0.1"])]


def test_readme_is_at_most_350_lines():
    assert len(README.read_text().splitlines()) <= 350


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_linked_files_exist(doc):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_readme_links_every_doc():
    linked = set(re.findall(r"\]\(docs/([^)#\s]+)\)", README.read_text()))
    assert {p.name for p in DOCS} <= linked


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_no_issue_numbers(doc):
    assert not re.search(r"\bissues? #?\d+|(?<![\w&])#\d+\b", doc.read_text(), re.I)


def test_every_argument_has_help_and_the_drloc_normalize_help_names_its_divisor():
    import importlib
    for script in ("dino", "esvit", "glsd", "selfpatch", "drloc", "eval_knn", "eval_linear"):
        parser = importlib.import_module(script).get_args_parser()
        assert [a.dest for a in parser._actions if not a.help] == [], script
    import drloc
    normalize = next(a for a in drloc.get_args_parser()._actions if a.dest == "drloc_normalize")
    assert "k-1" in normalize.help and "k/2" not in normalize.help
