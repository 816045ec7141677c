"""The docs cannot go stale: every path they mention exists in the repository.

Checked in README.md, minidist/*/README.md and examples/*.md (and, by the last test, in the
docstrings of every module, class and function of minidist/, examples/ and tests/):
- every relative Markdown link `[text](target)` resolves, from the document's folder, to a file
  or folder inside the repository;
- every `minidist/...`, `tests/...`, `examples/...` or `.ci/...` path written anywhere in the
  text (prose, code spans, command lines) exists, read from the repository root
  (`tests/test_x.py::test_name`: the file defines that test);
- every bare file name in a code span (`ring.py`) exists in the document's own folder;
- every `python -m minidist...` module exists;
- nothing points outside the repository (no absolute path to a file, no `../`).
- the autograd chapter's table of kernel tests counts each file's broken variants as the
  file defines them.
Run: python -m pytest -q tests/test_docs.py
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted({ROOT / "README.md", *ROOT.glob("minidist/*/*.md"), *ROOT.glob("examples/*.md"),
               *ROOT.glob("examples/*/README.md")})

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./~<-])((?:minidist|tests|examples|\.ci)/[\w./-]*[\w/](?:::\w+)?)")
BARE_FILE = re.compile(r"`([\w-]+\.(?:py|md|cfg|toml))`")
MODULE = re.compile(r"python -m (minidist[\w.]*)")
OUTSIDE = re.compile(r"\.\./shared|/work/|/home/|\bshared/DESIGN")


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _inside(path):
    return path.resolve().is_relative_to(ROOT)


def test_docs_are_found():
    """The top README and at least one chapter beside the code."""
    names = _ids(DOCS)
    assert "README.md" in names and any(n.startswith("minidist/") for n in names), names


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_path_a_doc_mentions_exists(doc):
    text = doc.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:|#", target):              # https://..., mailto:, #anchor
            continue
        path = doc.parent / target.split("#")[0]
        if not (path.exists() and _inside(path)):
            missing.append(f"link {target}")
    for name in REPO_PATH.findall(text):
        name, _, test = name.partition("::")
        if not (ROOT / name).exists():
            missing.append(name)
        elif test and f"def {test}(" not in (ROOT / name).read_text():
            missing.append(f"{name}::{test}")
    for name in BARE_FILE.findall(text):
        if not (doc.parent / name).exists():
            missing.append(f"{name} (not in {doc.parent.relative_to(ROOT) or '.'}/)")
    for module in MODULE.findall(text):
        base = ROOT / module.replace(".", "/")
        if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
            missing.append(f"python -m {module}")
    where = doc.relative_to(ROOT)
    assert not missing, f"{where} mentions paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_nothing_points_outside_the_repository(doc):
    bad = [m.group(0) for m in OUTSIDE.finditer(doc.read_text())]
    assert not bad, f"{doc.relative_to(ROOT)} points outside the repository: {bad}"


# ---- docstrings: the same for the prose beside the code ---------------------------------------

SOURCES = sorted([*ROOT.glob("minidist/**/*.py"), *ROOT.glob("examples/*.py"),
                  *ROOT.glob("tests/**/*.py")])
NAMED_FILE = re.compile(r"(?<![\w./-])([A-Za-z][\w-]*\.(?:py|md|cfg|toml))\b")
EVERY_NAME = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
PLACEHOLDERS = {"script.py", "my_script.py", "threads.py", "nonexistent.py", "tests/test_x.py"}


def _docstrings(path):
    """(line, text) of the module's docstring and of every class's and function's."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


@pytest.mark.parametrize("source", SOURCES, ids=_ids(SOURCES))
def test_every_file_a_docstring_names_exists(source):
    """A docstring's `minidist/...`, `tests/...` or `examples/...` path exists (a `::test` in
    its file), and a bare file name (`ring.py`, `README.md`) is a file of the repository
    (PLACEHOLDERS: the names usage examples make up)."""
    missing = []
    for line, doc in _docstrings(source):
        for name in REPO_PATH.findall(doc):
            name, _, test = name.partition("::")
            if name in PLACEHOLDERS:
                continue
            if not (ROOT / name).exists():
                missing.append(f"line {line}: {name}")
            elif test and f"def {test}(" not in (ROOT / name).read_text():
                missing.append(f"line {line}: {name}::{test}")
        for name in NAMED_FILE.findall(doc):
            if name not in EVERY_NAME | PLACEHOLDERS:
                missing.append(f"line {line}: {name}")
    where = source.relative_to(ROOT)
    assert not missing, f"{where}: docstrings name files that do not exist: {missing}"


def test_every_distributed_test_gives_its_command():
    """The house style: a test that runs an mpiexec job (the `mpi` fixture) says in its docstring
    how to run it by hand, an `mpiexec`, `mpirun` or `python` command line (review 38: five
    did not)."""
    missing = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    any(a.arg == "mpi" for a in node.args.args):
                said = ast.get_docstring(node) or ""
                if not re.search(r"\b(mpiexec|mpirun|python) ", said):
                    missing.append(f"{path.name}::{node.name}")
    assert not missing, missing


MAX_LINES, MAX_WIDTH = 400, 99       # the house style: a file read in one sitting


def test_files_and_lines_keep_their_lengths():
    """Every .py file of minidist/, examples/ and tests/ under 400 lines, every line of them
    99 characters at most (review 38: sixteen test files were over, nine lines too wide, and
    nothing kept them from drifting)."""
    long_files, wide = [], []
    for path in sorted(p for folder in ("minidist", "examples", "tests")
                       for p in (ROOT / folder).rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        name = str(path.relative_to(ROOT))
        if len(lines) >= MAX_LINES:
            long_files.append(f"{name} ({len(lines)} lines)")
        wide += [f"{name}:{i}" for i, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert not long_files, f"split these by subject: {long_files}"
    assert not wide, f"lines over {MAX_WIDTH} characters: {wide}"


def broken_counts(path):
    """{name: entries} of the dicts a test file assigns at module level (BROKEN, ...)."""
    return {t.id: len(node.value.keys) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            for t in node.targets if isinstance(t, ast.Name)}


def test_the_autograd_chapters_broken_variant_counts_are_the_tests():
    """minidist/autograd/README.md's table of the CUDA-on-CPU tests says how many broken
    variants each file catches ("9 broken variants", "8 broken dropout variants"): the entries
    of that file's BROKEN (BROKEN_DROPOUT) dict, each a defect its test must catch (read48:
    two rows said 7 and 4 where the files held 9 and 7)."""
    chapter = (ROOT / "minidist/autograd/README.md").read_text()
    checked = []
    for path, text in re.findall(r"^\| `(tests/test_\w+\.py)` \|(.*)\|$", chapter, re.M):
        counts = broken_counts(ROOT / path)
        for said, dropout in re.findall(r"(\d+) broken (dropout )?variants", text):
            name = "BROKEN_DROPOUT" if dropout else "BROKEN"
            assert counts.get(name) == int(said), (path, name, said, counts.get(name))
            checked.append(path)
    assert len(checked) >= 7, checked
