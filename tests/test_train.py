"""The training loop end to end on a tiny model and corpus: --log-json rows, a resumed run that
continues bit-identically, polite refusals of not-yet-available parallel flags, bad input,
the per-step statistics, the evaluation's split over replicas. What a resume takes from the
checkpoint and what it refuses: tests/test_train_resume.py. (--dp and world size > 1, i.e.
data parallelism: tests/test_ddp.py, test_ddp_exact.py, test_ddp_train.py.)"""
import json
import resource
import subprocess
import sys

import numpy as np
import pytest

from minidist.strategy import checkpoint
from minidist.train.args import train_parser
from minidist.train.cli import UsageError
from minidist.train.data import DataError
from minidist.train.loop import train
from minidist.train.strategy import make_strategy
from mpirun import device_flags
from tests.train_cases import _args, _rows


def test_log_json_rows_and_final_summary(corpus, tmp_path, device):
    log = tmp_path / "log.jsonl"
    summary = train(_args(device, corpus, tmp_path, "--steps", "4", "--eval-every", "2",
                          "--grad-accum", "2", "--log-json", str(log), "--sample", "20"))
    rows = _rows(log)
    assert [r["step"] for r in rows[:-1]] == [0, 1, 2, 3] and rows[-1]["final"]
    for r in rows[:-1]:        # "step" counts from 0 (the console's "step 2/4" is step 1)
        evaluated = r["step"] in (1, 3)                           # --eval-every 2: its row
        assert set(r) == {"step", "loss", "lr", "tokens_per_s", "ms_per_step", "grad_norm",
                          "mem", "comm_bytes", "model_tflops"} | (
                              {"val_loss"} if evaluated else set())
        assert set(r["mem"]) == {"params", "grads", "optimizer", "activations", "total"}
        assert r["mem"]["optimizer"] == 2 * r["mem"]["params"] and r["comm_bytes"] == 0
        assert r["mem"]["activations"] > 0
    assert rows[-1]["val_loss"] == summary["val_loss"] and len(summary["sample"]) >= 20
    assert rows[3]["val_loss"] == summary["val_loss"] and 0 < rows[1]["val_loss"] < 10


def test_resume_continues_bit_identically(corpus, tmp_path, device, capsys):
    common = ["--steps", "6", "--eval-every", "0", "--dropout", "0.1"]
    straight = tmp_path / "straight.jsonl"
    train(_args(device, corpus, tmp_path, *common, "--log-json", str(straight), "--save",
                str(tmp_path / "a")))
    stopped = train(_args(device, corpus, tmp_path, *common, "--save", str(tmp_path / "b"),
                          "--stop-at", "3"))
    # the summary's steps are the steps done (it said 6: plot.py put the val loss at step 5),
    # and a stop is said as one (walk 41: "final val loss" at a --stop-at, read as the end)
    assert (stopped["steps"], stopped["schedule_steps"], stopped["stopped_at"]) == (3, 6, 3)
    run = stopped["run"]                        # which run it was, for a sweep's logs
    assert (run["flags"]["lr"], run["flags"]["stop_at"], run["ranks"]) == (1e-2, 3, 1), run
    said = capsys.readouterr().out
    assert "\nval loss at step 3 of 6 (--stop-at) " in said
    # the run's hyperparameters in one line (walk 41: a sweep's logs named none of them)
    assert ("\nrun: adamw, lr 0.01 -> 0.001 (cosine, warmup 0 of 6 steps), weight decay 0.1, "
            "betas (0.9, 0.95), grad clip 1; global batch 4 x 16 = 64 tokens/step "
            "(grad-accum 1); seed 1337\n" in said), said
    resumed = tmp_path / "resumed.jsonl"
    train(_args(device, corpus, tmp_path, *common, "--resume", str(tmp_path / "b"), "--save",
                str(tmp_path / "b"), "--log-json", str(resumed)))
    want = [r["loss"] for r in _rows(straight)[3:6]]
    assert [r["loss"] for r in _rows(resumed)[:3]] == want
    a = checkpoint.load(tmp_path / "a")[0]      # --save DIR: its latest numbered folder
    b = checkpoint.load(tmp_path / "b")[0]
    assert all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("flags, says", [  # --tp (with --zero): test_tensor_parallel
    (["--pp", "2"], "pipeline parallelism: --pp 2 = 2 ranks per replica .*, but this job "
     "has 1"),
    (["--micro-batches", "2"], "--grad-accum")])             # more: tests/test_pipeline.py
def test_parallel_flags_refuse_politely(flags, says):
    with pytest.raises(UsageError, match=says):
        make_strategy(train_parser().parse_args(flags))


def test_missing_data_path_is_a_clear_error(tmp_path, device):
    with pytest.raises(DataError, match="no such file or directory"):
        train(_args(device, str(tmp_path / "nope.txt"), tmp_path, "--steps", "1"))


def test_script_refusal_has_no_traceback(device):
    out = subprocess.run([sys.executable, "examples/train_gpt.py", "--pp", "2",
                          *device_flags(device)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pipeline parallelism: " in out.stderr
    assert "Traceback" not in out.stderr


def test_log_json_starts_a_new_file_unless_resuming(corpus, tmp_path, device):
    """Two runs with one --log-json do not mix; --resume appends to the run it continues."""
    log = tmp_path / "log.jsonl"
    common = ["--steps", "3", "--eval-every", "0", "--log-json", str(log)]
    train(_args(device, corpus, tmp_path, *common, "--save", str(tmp_path / "ck"),
                "--stop-at", "2"))
    train(_args(device, corpus, tmp_path, *common, "--resume", str(tmp_path / "ck")))
    assert [r.get("step") for r in _rows(log)] == [0, 1, None, 2, None]
    train(_args(device, corpus, tmp_path, *common))
    assert [r.get("step") for r in _rows(log)] == [0, 1, 2, None]


def test_per_step_statistics_are_bounded():
    """A long run keeps the last 100 steps' rows for the DDP summary, not a growing list;
    the mean leaves out the warm-up step while it is kept."""
    from minidist.ddp.strategy import StepStats
    stats = StepStats(keep=100)
    for step in range(3000):
        stats.add(compute_s=float(step == 0) * 100 + 1.0)
    assert len(stats.rows) == 100 and stats.count == 3000 and stats.mean("compute_s") == 1.0
    few = StepStats()
    few.add(compute_s=9.0)
    few.add(compute_s=1.0)
    assert few.mean("compute_s") == 1.0


def test_evaluation_splits_each_batch_over_the_replicas_as_training_does(corpus, tmp_path):
    """Every data-parallel rank evaluated the whole global batch (4 ranks: the work 4 times,
    on the README's mpirun -n 4 more time than the training steps). evaluate() now takes the
    rows training would (strategy.local_rows) and averages the replicas' means
    (global_mean): here rank r of 2, played in one process, sees only its 2 rows of 4, and
    the two ranks' mean is the whole batch's loss. Under --grad-accum (`parts`) a rank's rows
    go through in training's micro-batches: the same mean, a micro-batch's memory."""
    from minidist.nn import GPT, GPTConfig
    from minidist.strategy.base import SingleProcess, dp_rows
    from minidist.train.data import TokenData
    from minidist.train.loop import evaluate

    class RankOfTwo(SingleProcess):
        def __init__(self, rank):
            super().__init__()
            self.rank = rank

        def local_rows(self, *arrays):
            return dp_rows(arrays, self.rank, 2)

    class Counted(GPT):
        def forward(self, idx, targets=None):
            rows.append(len(idx))
            return super().forward(idx, targets)
    data = TokenData(corpus, str(tmp_path / "cache"))
    model = Counted(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16,
                              vocab_size=data.vocab_size), seed=0, dtype="float64")
    rows = []
    whole = float(evaluate(SingleProcess(), model, data, 4, 16, 3))
    assert rows == [4, 4, 4]
    rows.clear()
    halves = [float(evaluate(RankOfTwo(r), model, data, 4, 16, 3)) for r in (0, 1)]
    assert rows == [2] * 6 and halves[0] != halves[1]
    assert abs((halves[0] + halves[1]) / 2 - whole) < 1e-12, (halves, whole)
    assert model.training                      # evaluate puts back the mode it found
    rows.clear()                # --grad-accum 2: each batch in two forwards of half its rows
    parts = float(evaluate(SingleProcess(), model, data, 4, 16, 3, parts=2))
    assert rows == [2] * 6 and abs(parts - whole) < 1e-12, (parts, whole)


def test_a_log_json_row_that_cannot_be_written_stops_the_log_not_the_run(capsys, tmp_path):
    """First-use walk 37: --log-json on a disk that filled mid-run aborted the job at its
    next logged step (a traceback, exit 1, the steps since the last save lost). Now one
    warning, the log stops there, training goes on (/dev/full: every write is ENOSPC)."""
    from minidist.train.progress import Logger
    log = Logger(0, "/dev/full")
    log.json0({"step": 4, "loss": 1.0})
    log.json0({"step": 5, "loss": 1.0})
    err = capsys.readouterr().err
    assert err == ("warning: --log-json /dev/full: cannot write (No space left on device); "
                   "no rows from step 5 on, training goes on\n"), err
    assert log.log_json is None
    # a disk that fills in the middle of a row (a child's file size limit stands for it):
    # the part written is taken back, the rows before are whole
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\n')
    code = ("from minidist.train.progress import Logger\n"
            f"Logger(0, {str(path)!r}).json0({{'step': 1, 'text': 'x' * 5000}})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, preexec_fn=lambda: resource.setrlimit(
                             resource.RLIMIT_FSIZE, (2048, 2048)))
    assert out.returncode == 0 and "File too large" in out.stderr, out
    assert path.read_text() == '{"step": 0}\n'


def test_a_diverged_run_logs_strict_json_a_summary_row_and_exit_status_3(corpus, tmp_path,
                                                                         device):
    """First-use walk 41: a diverged run's rows held NaN and Infinity (no JSON to node, 1.8e308
    to jq), it left no summary row, and it exited 2 like a bad flag. Now the rows hold null
    there, a summary row says it diverged and which run it was, and the error's exit status
    is 3."""
    from minidist.train.loop import Diverged
    log = tmp_path / "d.jsonl"
    with pytest.raises(Diverged) as e:
        train(_args(device, corpus, tmp_path, "--lr", "1e30", "--grad-clip", "0", "--steps",
                    "20", "--log-json", str(log)))
    assert e.value.exit_status == 3

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    rows = [json.loads(line, parse_constant=refuse) for line in open(log)]
    last = rows[-1]
    assert last["final"] and last["diverged"] and last["loss"] is None, last
    assert last["run"]["flags"]["lr"] == 1e30 and last["val_loss"] is None
    assert any(r.get("loss") is None for r in rows[:-1] if "step" in r)


@pytest.mark.parametrize("layout", [[], ["--zero", "1"], ["--amp"], ["--optimizer", "muon"]])
def test_a_resume_given_another_hyperparameter_trains_with_it(layout, corpus, tmp_path,
                                                              device):
    """The flags set the resumed optimizer's hyperparameters, not the checkpoint it loads: a
    resume given --weight-decay 5 trained on with the checkpoint's 0.1 (the same losses as a
    resume without it), though its line said the decay had changed. One process, ZeRO-1
    (whose update reads the optimizer's weight_decay), --amp's master weights and Muon's
    groups; the resumed run's checkpoint holds the new decay."""
    common = [*layout, "--steps", "4", "--eval-every", "0", "--lr", "3e-2"]
    train(_args(device, corpus, tmp_path, *common, "--stop-at", "2",
                "--save", str(tmp_path / "ck")))
    losses = {}
    for wd in ("0.1", "5"):
        folder = tmp_path / f"wd{wd}"
        subprocess.run(["cp", "-r", str(tmp_path / "ck"), str(folder)], check=True, timeout=60)
        train(_args(device, corpus, tmp_path, *common, "--resume", str(folder), "--save",
                    str(folder), "--weight-decay", wd, "--log-json", str(tmp_path / wd)))
        losses[wd] = [r["loss"] for r in _rows(tmp_path / wd) if "loss" in r]
    assert len(losses["5"]) == 2 and losses["5"][0] == losses["0.1"][0]    # step 2: the
    assert losses["5"][1] != losses["0.1"][1]                             # same weights
    if "--zero" not in layout:
        state = json.loads((tmp_path / "wd5" / "step-00000004" / "state.json").read_text())
        decays = [g["weight_decay"] for g in state["optimizer"]["groups"]]
        assert decays == ([5.0, 5.0, 0.0] if "muon" in layout else [5.0, 0.0]), decays


@pytest.mark.parametrize("layout", [[], ["--zero", "1"]])
def test_the_adam_betas_are_flags(layout):
    """--beta1 and --beta2 reach the optimizer the strategies build, one process's and ZeRO's
    over its shards (EP's experts take optimizer_settings too); defaults (0.9, 0.95)."""
    from minidist.strategy.base import optimizer_settings
    assert optimizer_settings(train_parser().parse_args([]))["betas"] == (0.9, 0.95)
    args = train_parser().parse_args(["--beta1", "0.8", "--beta2", "0.99", *layout])
    assert optimizer_settings(args)["betas"] == (0.8, 0.99)
    from minidist.nn import GPTConfig
    strategy = make_strategy(args)
    model = strategy.build_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16,
                                           vocab_size=32), 0, "float32")
    opt = strategy.build_optimizer(model, args)
    assert {g["betas"] for g in opt.param_groups} == {(0.8, 0.99)}


def test_the_rows_give_the_models_flops_per_rank_and_mfu_against_a_peak(corpus, tmp_path,
                                                                        device):
    """Each --log-json row's model_tflops is the step's model FLOPs (train/cost.py
    model_flops, the planners' MFU numerator) per rank over its time; --peak-tflops adds mfu,
    that over the peak, to the rows and the log lines (walk 41: no MFU in a training log)."""
    from minidist.nn import GPTConfig
    from minidist.train.cost import model_flops
    log = tmp_path / "log.jsonl"
    train(_args(device, corpus, tmp_path, "--steps", "3", "--eval-every", "0",
                "--peak-tflops", "0.05", "--log-json", str(log), "--log-every", "1"))
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256)
    for row in _rows(log)[:-1]:
        flops = row["model_tflops"] * 1e12 * row["ms_per_step"] / 1e3
        assert flops == pytest.approx(model_flops(config, 4, 16), rel=1e-9)
        assert row["mfu"] == pytest.approx(row["model_tflops"] / 0.05, rel=1e-12)


def test_a_checkpoint_that_records_no_runs_flags_keeps_its_optimizer_and_says_so(
        corpus, tmp_path, device, capsys):
    """One of your own loop's checkpoints records no run's flags: a resume keeps the
    optimizer settings it saved, and says which given flags it did not apply (review 43:
    --weight-decay 5 was dropped without a word)."""
    train(_args(device, corpus, tmp_path, "--steps", "4", "--stop-at", "2", "--eval-every",
                "0", "--save", str(tmp_path / "ck")))
    params, opt_sd, meta = checkpoint.load(tmp_path / "ck")
    meta["extra"] = {}                                   # as a library save writes it
    checkpoint.save(tmp_path / "own", params, opt_sd, meta)
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, "--steps", "4", "--eval-every", "0", "--resume",
                str(tmp_path / "own"), "--weight-decay", "5", "--beta2", "0.99"))
    assert ("records no run's flags (a checkpoint of your own loop?): its optimizer keeps "
            "the settings it saved, not --weight-decay, --beta2") in capsys.readouterr().out
