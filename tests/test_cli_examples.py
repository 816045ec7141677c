"""The examples' command lines beside training's: examples/sample.py's bad input (SAMPLE_BAD),
an imported GPT-2's BPE vocabulary included, is one line; a sample never writes control
characters; every example states its defaults and gives every flag a help text; a flag is
not taken for its abbreviation; the flag modules load no NumPy.

    python examples/sample.py --resume /nonexistent   # error: --resume /nonexistent: no such ...
"""
import ast
import os
import subprocess
import sys

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.train.args import train_parser
from minidist.train.end_sample import printable
from tests.mpirun import ROOT, device_flags, mpi_env


# examples/sample.py: (flags, the one error line). {gpt2}: a GPT-2 folder with 50,257 BPE tokens
SAMPLE_BAD = [
    (["--resume", "/nonexistent"], "--resume /nonexistent: no such directory"),
    (["--resume", ".", "--tokens", "0"], "--tokens/--sample 0: must be at least 1"),
    (["--resume", ".", "--sample", "0"], "--tokens/--sample 0: must be at least 1"),
    (["--resume", ".", "--temperature", "-1"], "--temperature -1.0: must be a number >= 0"),
    (["--resume", ".", "--temperature", "nan"], "--temperature nan: must be a number >= 0"),
    (["--resume", "{file}"], ": is a file, not a folder (give a --save directory"),
    (["--resume", ".", "--top-k", "-1"], "--top-k -1: must not be negative"),
    (["--resume", ".", "--seed", "-1"], "--seed -1: must not be negative"),
    (["--resume", ".", "--prompt", ""], "--prompt '': give at least one character"),
    (["--resume", "examples"], "not a minidist checkpoint"),
    (["--tokens", "5"], "the following arguments are required: --resume"),
    (["--resume", "{gpt2}"], "a model of a 50,257-token vocabulary, and no tokenizer found "
     "for it (looked in "),
    (["--resume", "{gpt2}", "--tokenizer", "examples"], "--tokenizer examples: no vocab.json "
     "and merges.txt (nor meta.pkl) there"),
]


@pytest.mark.parametrize("flags,says", SAMPLE_BAD, ids=[" ".join(f) for f, _ in SAMPLE_BAD])
def test_sample_errors_are_one_line(flags, says, tmp_path, device):
    """python examples/sample.py --resume GPT2_FOLDER: refused before any array is read."""
    if "{gpt2}" in flags:
        GPT(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=8, vocab_size=50257)
            ).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "afile").write_text("x")
    out = subprocess.run([sys.executable, "examples/sample.py",
                          *[f.format(gpt2=tmp_path / "gpt2", file=tmp_path / "afile")
                            for f in flags],
                          *device_flags(device)], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and says in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


EMPTY_PATHS = [("sample.py", ["--resume", ""]),
               ("sample.py", ["--resume", ".", "--tokenizer", ""]),
               ("export_gpt2.py", ["--resume", ".", "--out", ""]),
               ("train_tokenizer.py", ["--out", ""]), ("plot.py", ["--trace", "", "-o", "x"]),
               ("plan_memory.py", ["--data", ""]), ("bench_collectives.py", ["--trace", ""])]


@pytest.mark.parametrize("script,flags", EMPTY_PATHS,
                         ids=[f"{s} {' '.join(f)}" for s, f in EMPTY_PATHS])
def test_an_empty_path_is_one_line_naming_the_flag(script, flags):
    """A flag naming a file or folder given "" (a shell variable left unset) is argparse's
    one line (minidist/train/args.py a_path), as train_gpt.py's are (tests/test_cli.py):
    they said "--out : cannot make the folder" or "--resume : no such directory"."""
    flag = flags[-2] if flags[-1] == "" else flags[-4]
    out = subprocess.run([sys.executable, f"examples/{script}", *flags], cwd=ROOT,
                         env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"error: argument {flag}: an empty path"), out.stderr
    assert out.stderr.count("\n") == 1


def test_printable_escapes_control_characters():
    assert printable("a\x1b[2Jb\tc\nd\x00") == "a\\x1b[2Jb\tc\nd\\x00"
    assert printable("def f(x):\n    return x") == "def f(x):\n    return x"
    # first-use walk 33: the zero-width joiner of an emoji sequence came back escaped; text
    # Python calls unprintable (joiners, no-break and ideographic spaces) stays, while a
    # bidirectional override (it reorders the screen) and a lone surrogate are escaped
    kept = "👩\u200d💻 \u0930\u094d\u200d \xa0\u3000"
    assert printable(kept) == kept
    assert printable("a\u202eb\ud800") == "a\\u202eb\\ud800"


def test_the_flag_modules_load_no_numpy():
    """train_gpt.py sets the BLAS thread count in the environment, then imports the flag
    modules: numpy loaded by them would have read it first (cli.py imports numpy's users
    inside the checks that need them)."""
    out = subprocess.run([sys.executable, "-c", "import sys, minidist.train.args, "
                          "minidist.train.cli; print(sorted(m for m in sys.modules "
                          "if m.split('.')[0] == 'numpy')[:3])"], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "[]\n", (out.stdout, out.stderr)


def test_every_example_states_its_defaults_and_its_first_paragraph():
    """Every script in examples/ (but plot.py and ddp_timeline.py, whose --help is their
    whole docstring) builds its parser with args.example_parser: --help shows each flag's
    default and the docstring's first paragraph (plan.py showed no default; bench_plan.py's
    description stopped mid-sentence, at its docstring's first line break). Two run here."""
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "examples"))
                     if f.endswith(".py") and f not in ("plot.py", "ddp_timeline.py")
                     and f != "own_loop_reference.py")   # (not a script: the scripts' part)
    for name in scripts:
        source = open(os.path.join(ROOT, "examples", name)).read()
        if "parse_args(" in source and "train_parser()" not in source:
            assert "example_parser(__doc__)" in source or name in ("sample.py",
                                                                   "export_gpt2.py"), name
    for name, default, ends in (("plan.py", "(default: 64)", "fastest first."),
                                ("bench_plan.py", "(default: 8)", "EP2 x CP2).")):
        out = subprocess.run([sys.executable, f"examples/{name}", "--help"], cwd=ROOT,
                             env=mpi_env(), capture_output=True, text=True, timeout=60)
        text = " ".join(out.stdout.split())
        assert out.returncode == 0 and default in text, (name, text)
        assert text.split(" options: ")[0].endswith(ends), (name, text[:600])


def test_every_flag_of_every_example_has_a_help_text():
    """Every flag of examples/*.py and minidist/train/*.py has a help text: HelpWithDefaults
    adds "(default: X)" to a flag's help text, so a flag without one shows no default, and
    README.md says --help shows every default (a first-use walk found plan_memory.py's --gpus
    and bench_sample.py's flags with no default in --help)."""
    missing = []
    for folder in ("examples", os.path.join("minidist", "train")):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read(), path)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "add_argument"
                        and any(isinstance(a, ast.Constant) and str(a.value).startswith("-")
                                for a in node.args)
                        and "help" not in {k.arg for k in node.keywords}):
                    missing.append(f"{path}:{node.lineno}")
    assert not missing, f"flags without help= (their default is not shown): {missing}"


@pytest.mark.parametrize("flags,unknown", [(["--seq", "256"], "--seq 256"),
                                           (["--step", "3"], "--step 3"),
                                           (["--opt", "muon"], "--opt muon")])
def test_a_flag_is_not_taken_for_its_abbreviation(flags, unknown, capsys):
    """argparse's prefixes are off (args.Parser): plan.py's --seq was read as
    --sequence-parallel (the error named a stray 256), and --step 3 ran as --steps 3."""
    with pytest.raises(SystemExit) as e:
        train_parser().parse_args(flags)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: unrecognized arguments: {unknown} (")
