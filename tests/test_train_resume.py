"""The training loop's --resume on a tiny model and corpus: a resumed run takes its model, data,
schedule and hyperparameters from the checkpoint (unless given), a checkpoint from before
keyed dropout resumes; a resume past the last step, on other contents at the same path, or
from a corrupt newest checkpoint is refused or named, and so is what changes its numbers."""
import numpy as np
import pytest

from minidist.strategy import checkpoint
from minidist.train.args import train_parser
from minidist.train.cli import UsageError
from minidist.train.loop import train
from mpirun import device_flags
from tests.train_cases import _args, _rows


def test_a_resumed_run_takes_its_model_from_the_checkpoint(corpus, tmp_path, device):
    """--resume needed every model flag retyped (a --n-layer 2 run resumed without it was
    refused, "n_layer: 2 in the checkpoint, 4 here"), though the checkpoint holds its config.
    Now the model flags, --dtype and --amp are the checkpoint's (cli.check_flags, before any
    work): a run resumed with none of them continues the straight run bit for bit; a model
    flag typed with another value is one error naming it; --dropout may change."""
    from minidist.train.cli import check_flags
    data = ["--data", corpus, "--cache-dir", str(tmp_path / "cache"), *device_flags(device),
            "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "1", "--sample", "0",
            "--log-every", "1", "--eval-every", "0", "--steps", "5"]
    model = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
             "--no-bias", "--dropout", "0.1", "--dtype", "float64"]

    def args(*flags):
        a = train_parser().parse_args(data + list(flags))
        check_flags(a)
        return a
    straight = tmp_path / "straight.jsonl"
    train(args(*model, "--log-json", str(straight)))
    train(args(*model, "--save", str(tmp_path / "ck"), "--stop-at", "2"))
    resumed = tmp_path / "resumed.jsonl"
    a = args("--resume", str(tmp_path / "ck"), "--log-json", str(resumed))
    assert (a.n_layer, a.n_head, a.n_embd, a.block_size, a.bias, a.dropout, a.dtype, a.amp) \
        == (2, 2, 16, 16, False, 0.1, "float64", False)
    train(a)
    assert [r["loss"] for r in _rows(resumed)[:3]] == [r["loss"] for r in _rows(straight)[2:5]]
    for typed, says in ((["--n-embd", "32"], "--n-embd 32: --resume .*step-00000002 holds a "
                         "model with n_embd 16; leave --n-embd out \\(a resumed run takes "
                         "its model from the checkpoint\\)"),
                        (["--no-bias"], None),                      # the same: accepted
                        (["--n-layer", "2", "--dtype", "float32"], "--dtype float32: --resume "
                         ".* was trained in float64; leave --dtype out"),
                        (["--moe-experts", "4"], "--moe-experts 4: .* holds a model with "
                         "moe_experts 0")):
        if says is None:
            args("--resume", str(tmp_path / "ck"), *typed)
            continue
        with pytest.raises(UsageError, match=says):
            args("--resume", str(tmp_path / "ck"), *typed)
    assert args("--resume", str(tmp_path / "ck"), "--dropout", "0.2").dropout == 0.2
    moe = ["--moe-experts", "2", "--moe-top-k", "1"]            # its losses' weights and
    train(args(*model[:-2], *moe, "--save", str(tmp_path / "moe"), "--stop-at", "1"))
    a = args("--resume", str(tmp_path / "moe"), "--moe-aux-loss-coef", "0.1",    # capacity
             "--moe-capacity-factor", "2")                      # hold no parameter either
    assert (a.moe_experts, a.moe_aux_loss_coef, a.moe_capacity_factor) == (2, 0.1, 2.0)
    train(a)
    train(args(*model[:-4], "--amp", "--save", str(tmp_path / "amp"), "--stop-at", "1"))
    a = args("--resume", str(tmp_path / "amp"))          # a 16-bit checkpoint: an --amp run's
    assert a.amp and a.amp_dtype == "float16" and a.dtype == "float32"
    train(a)


def test_a_resumed_run_takes_its_data_from_the_checkpoint(corpus, tmp_path):
    """Resumed without --data, a run trained on --data X went on with Python's sources,
    silently. Now the checkpoint's recorded --data is taken; a recorded file that is gone is
    one error naming it; a given --data is kept."""
    import shutil
    from minidist.train.cli import check_flags
    mine = tmp_path / "mine.py"
    shutil.copyfile(corpus, mine)
    base = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
            "--batch-size", "4", "--eval-iters", "1", "--sample", "0", "--steps", "2",
            "--cache-dir", str(tmp_path / "cache")]

    def args(*flags):
        a = train_parser().parse_args(base + list(flags))
        check_flags(a)
        return a
    train(args("--data", str(mine), "--save", str(tmp_path / "ck"), "--stop-at", "1"))
    assert args("--resume", str(tmp_path / "ck")).data == str(mine)
    assert args("--resume", str(tmp_path / "ck"), "--data", corpus).data == corpus
    mine.unlink()
    with pytest.raises(UsageError, match=f"was trained on --data {mine}, which is not there"):
        args("--resume", str(tmp_path / "ck"))


def test_a_wsd_run_saved_before_its_decay_extends_into_the_longer_run(corpus, tmp_path,
                                                                   device, capsys):
    """--lr-schedule wsd: the rate depends on --steps only in the last --decay-steps, so a run
    of 8 steps saved at step 4 (its decay begins at 5) and resumed with --steps 12 trains the
    12-step run's steps 4..11 bit for bit, and the resume says nothing changed. Cosine's rate
    depends on --steps from step 0: the same extension is noted as a different run."""
    common = ["--eval-every", "0", "--warmup", "2", "--decay-steps", "3"]
    straight = tmp_path / "straight.jsonl"
    train(_args(device, corpus, tmp_path, *common, "--lr-schedule", "wsd", "--steps", "12",
                "--log-json", str(straight)))
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, *common, "--lr-schedule", "wsd", "--steps", "8",
                "--stop-at", "4", "--save", str(tmp_path / "wsd")))
    # first-use walk 28: "step 4/4" read as a schedule cut to 4 steps
    assert ("--stop-at 4: the log counts to step 4; the lr schedule spans --steps 8"
            in capsys.readouterr().out)
    extended = tmp_path / "extended.jsonl"
    train(_args(device, corpus, tmp_path, *common, "--lr-schedule", "wsd", "--steps", "12",
                "--resume", str(tmp_path / "wsd"), "--log-json", str(extended)))
    said = capsys.readouterr().out
    assert "resumed from" in said and "(note:" not in said and "; note:" not in said, said
    rows = _rows(extended)[:-1]
    assert [r["loss"] for r in rows] == [r["loss"] for r in _rows(straight)[4:12]]
    assert [r["lr"] for r in rows] == [r["lr"] for r in _rows(straight)[4:12]]
    train(_args(device, corpus, tmp_path, "--eval-every", "0", "--steps", "8", "--stop-at",
                "4", "--save", str(tmp_path / "cos")))
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, "--eval-every", "0", "--steps", "12", "--resume",
                str(tmp_path / "cos")))
    said = capsys.readouterr().out
    assert "(note: steps 8 -> 12 changed, so the run will differ" in said and "jumps" not in said
    # first-use walk 26: a wsd run resumed past its decay with a larger --steps went from
    # --min-lr back to the peak in one step, noted only as "steps changed"
    decayed = tmp_path / "decayed"
    train(_args(device, corpus, tmp_path, *common, "--lr-schedule", "wsd", "--steps", "8",
                "--save", str(decayed), "--save-every", "4", "--keep", "2"))
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, *common, "--lr-schedule", "wsd", "--steps", "12",
                "--resume", str(decayed), "--save", str(decayed), "--keep", "2"))
    said = capsys.readouterr().out
    lr = float(_args(device, corpus, tmp_path).lr)
    # first-use walk 27: it named no checkpoint, and --keep then removed the one it meant
    assert (f"; note: the learning rate jumps from {lr / 10:.2e} (the checkpoint's last step) "
            f"to {lr:.2e} (step 9), with no warmup; its run's decay began after step 5: "
            f"--resume {decayed / 'step-00000004'} extends it (this run's first save, keeping "
            "--keep 2, would remove it: --save another folder or raise --keep)") in said, said


def test_a_resume_takes_the_runs_hyperparameters_unless_given(corpus, tmp_path, device,
                                                              capsys):
    """`--resume ck --steps N` alone continues the run the checkpoint holds: its --lr,
    --batch-size, --grad-accum, --warmup, --weight-decay, --beta2, --grad-clip, --seed
    (RUN_RESUMED), not this parser's defaults; one given is the run's, and the resume notes
    it (--dropout too, which a resume may change)."""
    from minidist.train.cli import check_flags
    from minidist.train.inputs import RUN_RESUMED
    run = ["--lr", "1e-3", "--batch-size", "8", "--grad-accum", "2", "--warmup", "1",
           "--weight-decay", "0.05", "--beta2", "0.99", "--grad-clip", "0.5", "--seed", "7",
           "--eval-every", "0", "--steps", "6"]
    straight = tmp_path / "straight.jsonl"
    train(_args(device, corpus, tmp_path, *run, "--log-json", str(straight)))
    train(_args(device, corpus, tmp_path, *run, "--stop-at", "3", "--save",
                str(tmp_path / "ck")))
    bare = [*device_flags(device), "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
            "--eval-iters", "2", "--sample", "0", "--steps", "6", "--eval-every", "0",
            "--resume", str(tmp_path / "ck")]                  # no TINY: its --lr, --batch-size
    resumed = train_parser().parse_args(bare + ["--log-json", str(tmp_path / "r.jsonl")])
    check_flags(resumed)
    assert {n: getattr(resumed, n) for n in RUN_RESUMED} == {
        "seed": 7, "batch_size": 8, "grad_accum": 2, "lr": 1e-3, "min_lr": None, "warmup": 1,
        "lr_schedule": "cosine", "decay_steps": None, "weight_decay": 0.05, "beta1": 0.9,
        "beta2": 0.99, "grad_clip": 0.5,
        "moe_bias_rate": 0.0, "grad_dtype": None, "eval_every": 0, "eval_iters": 2,
        "steps": 6}
    capsys.readouterr()
    train(resumed)
    said = capsys.readouterr().out            # (the resumed line's notes; a loaded machine's
    assert "(note:" not in said and "; note:" not in said, said     # busy-cores note may come)
    assert [r["loss"] for r in _rows(tmp_path / "r.jsonl")[:-1]] == \
        [r["loss"] for r in _rows(straight)[3:6]]
    # the run's --eval-every and --eval-iters too (first-use walk 33: evaluations moved)
    cadence = train_parser().parse_args([a for a in bare if a not in ("--eval-iters", "2")])
    check_flags(cadence)
    assert (cadence.eval_every, cadence.eval_iters) == (0, 2)    # the run's, not 200, 20
    given = train_parser().parse_args(bare + ["--lr", "2e-3", "--dropout", "0.1"])
    check_flags(given)
    assert given.lr == 2e-3 and given.batch_size == 8
    train(given)
    assert "(note: dropout 0.0 -> 0.1, lr 0.001 -> 0.002 changed, so the run will differ" in \
        capsys.readouterr().out                 # (the values too: first-use walk 41)


def test_a_checkpoint_from_before_keyed_dropout_resumes_the_straight_run(corpus, tmp_path,
                                                                         device):
    """Checkpoints written before dropout was keyed (2026-11-25) hold a generator's state as
    "rng"/"dropout": the resume takes the keys' step from the checkpoint's step, which is
    what the straight run's keys had there."""
    common = ["--steps", "4", "--eval-every", "0", "--dropout", "0.1"]
    straight = tmp_path / "straight.jsonl"
    train(_args(device, corpus, tmp_path, *common, "--log-json", str(straight)))
    train(_args(device, corpus, tmp_path, *common, "--save", str(tmp_path / "new"),
                "--stop-at", "2"))
    params, opt_sd, meta = checkpoint.load(tmp_path / "new")
    assert meta["rng"]["dropout"] == {"step": 2, "seed": 1337}
    meta["rng"]["dropout"] = np.random.default_rng(0).bit_generator.state     # the old form
    checkpoint.save(tmp_path / "old", params, opt_sd, meta)
    resumed = tmp_path / "resumed.jsonl"
    train(_args(device, corpus, tmp_path, *common, "--resume", str(tmp_path / "old"),
                "--log-json", str(resumed)))
    assert [r["loss"] for r in _rows(resumed)[:2]] == [r["loss"] for r in _rows(straight)[2:4]]


def test_resuming_past_the_last_step_is_refused(corpus, tmp_path, device, capsys):
    """A checkpoint at step 4 resumed with --steps 2 (or --stop-at 3) trained nothing and
    exited 0 ("0.0 s of training"); it is one error line now. --steps 4, the same step, is a
    requeued run that already finished: it evaluates and ends, as before, and its --log-json
    keeps one summary row. Refused before any work (it was after the strategy's collectives
    and the checkpoint's load)."""
    ck = str(tmp_path / "ck")
    train(_args(device, corpus, tmp_path, "--steps", "4", "--eval-every", "0", "--save", ck))
    with pytest.raises(UsageError, match="--steps 2: the checkpoint .*step-00000004 is at "
                       "step 4 already; give --steps above 4 to train it further"):
        train(_args(device, corpus, tmp_path, "--steps", "2", "--resume", ck))
    with pytest.raises(UsageError, match="--stop-at 3: the checkpoint .* is at step 4"):
        train(_args(device, corpus, tmp_path, "--steps", "8", "--stop-at", "3", "--resume", ck))
    # decided from the folder's name before any work: before the data (not read: missing)
    # and the strategy (with ranks, its collectives) are made
    with pytest.raises(UsageError, match="--steps 2: the checkpoint"):
        train(_args(device, corpus, tmp_path, "--steps", "2", "--resume", ck, "--data",
                    str(tmp_path / "missing.txt")))
    log = tmp_path / "log.jsonl"
    first = train(_args(device, corpus, tmp_path, "--steps", "4", "--eval-every", "0",
                        "--save", str(tmp_path / "ck2"), "--log-json", str(log)))
    capsys.readouterr()
    done = train(_args(device, corpus, tmp_path, "--steps", "4", "--resume",
                       str(tmp_path / "ck2"), "--log-json", str(log)))
    assert "loss and norm" not in done["host_reads"] and done["val_loss"] == first["val_loss"]
    # a requeued run that finished writes no second summary (walk 41), and says so
    assert [r["steps"] for r in _rows(log) if r.get("final")] == [4]
    said = capsys.readouterr().out
    assert "holds this run's summary of 4 steps already: not written again" in said
    # and says why nothing trains (it printed "0.0 s of training" and no word why: first-use
    # walk, session 35)
    assert "at step 4: the run is done (--steps 4), nothing to train, only its evaluation " \
        "(--steps above 4 trains it further)" in said, said


def test_a_resume_on_other_contents_at_the_same_path_says_so(corpus, tmp_path, device, capsys):
    """First-use walk 33: a corpus regenerated in place (the same --data path, other text)
    was resumed on, and evaluated by --eval-only, without a word. The checkpoint records the
    tokens' digest (data_open.record_data); the same text written again (a new mtime, a new
    cache) is no change."""
    text = tmp_path / "corpus.txt"
    text.write_text(open(corpus).read())
    flags = ["--data", str(text), "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0"]
    train(_args(device, corpus, tmp_path, *flags, "--steps", "4", "--stop-at", "2",
                "--save", str(tmp_path / "ck")))
    text.write_text(open(corpus).read())             # the same text again: nothing to say
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, *flags, "--steps", "4",
                "--resume", str(tmp_path / "ck")))
    said = capsys.readouterr().out
    assert "resumed from" in said and "(note:" not in said, said
    text.write_text(open(corpus).read().replace("return", "yield"))     # regenerated
    train(_args(device, corpus, tmp_path, *flags, "--steps", "4",
                "--resume", str(tmp_path / "ck")))
    said = capsys.readouterr().out
    assert ("(note: data (the same path, other contents) changed, so the run will "
            "differ") in said, said
    from minidist.train.cli import check_flags
    evaluate = train_parser().parse_args([*device_flags(device), "--resume", str(tmp_path / "ck"),
                                          "--eval-only", "--sample", "0", "--cache-dir",
                                          str(tmp_path / "cache")])
    check_flags(evaluate)                      # (its data: the path the checkpoint recorded)
    train(evaluate)
    said = capsys.readouterr().out
    assert (f"; note: --data {text} holds other tokens than when that run trained (edited or "
            "replaced): this val loss is not the one it ended with") in said, said


def test_a_resume_names_what_changes_its_numbers_and_what_cannot_change(corpus, tmp_path,
                                                                        device, capsys):
    """First-use walk 35: an MoE loss weight given on a resume changed the losses without a
    note; another --grad-accum (the same batch, split otherwise: the same numbers) was
    "will differ"; a layout refusal on a resume asked to change a model size the
    checkpoint fixes. Now: noted; named as the checkpoint's run's; named as fixed."""
    from minidist.train.cli import check_flags
    from minidist.train.strategy import check_layout
    ck = str(tmp_path / "ck")
    moe = ["--moe-experts", "4", "--eval-every", "0"]
    train(_args(device, corpus, tmp_path, *moe, "--steps", "4", "--stop-at", "2",
                "--save", ck))
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, *moe, "--steps", "4", "--resume", ck,
                "--moe-aux-loss-coef", "0", "--grad-accum", "2"))
    said = capsys.readouterr().out
    assert ("(note: moe_aux_loss_coef 0.01 -> 0.0 changed, so the run will differ from an "
            "uninterrupted "
            "one); note: the checkpoint's run had --grad-accum 1 (the same numbers under any "
            "schedule or split of the batch, up to rounding") in said, said
    args = train_parser().parse_args(["--resume", ck, "--cp", "3", "--steps", "4"])
    check_flags(args)
    with pytest.raises(UsageError, match=(
            rf"choose a multiple of 6 \(under --resume {ck}, --block-size 16 is its "
            r"model's and cannot change: choose a layout that fits them\)$")):
        check_layout(args, 3)


def test_a_corrupt_newest_checkpoint_names_the_older_ones_beside_it(corpus, tmp_path):
    """    python examples/train_gpt.py --save ck --save-every 2 --keep 2, step 4's shard
    truncated, then --resume auto: the corrupt-checkpoint line goes on to name step 2,
    intact beside it, and how to continue from it (first-use walk 37: a requeued job failed
    on it again and again, the line naming no way out)."""
    from minidist.strategy import checkpoint_dirs
    from minidist.strategy.checkpoint import CheckpointError
    from mpirun import tiny_args
    ck = tmp_path / "ck"
    flags = ("--data", corpus, "--cache-dir", str(tmp_path / "cache"), "--save", str(ck),
             "--save-every", "2", "--keep", "2", "--eval-every", "0")
    train(tiny_args(*flags, "--steps", "4"))
    shard = next((ck / "step-00000004").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as e:
        train(tiny_args(*flags, "--steps", "6", "--resume", "auto"))
    assert "corrupt checkpoint" in str(e.value) and str(e.value).endswith(
        f"; older checkpoints beside it: {ck}/step-00000002 (--resume {ck}/step-00000002 "
        "--overwrite continues from the newest of them)"), e.value
    assert train(tiny_args(*flags, "--steps", "6", "--resume", str(ck / "step-00000002"),
                           "--overwrite"))["steps"] == 6
    assert checkpoint_dirs.read_latest(str(ck)) == "step-00000006"      # the corrupt one
    assert "step-00000004" not in checkpoint_dirs.numbered(str(ck))      # replaced, pruned


def test_a_resume_keeps_the_runs_checkpoints_and_cadence_unless_given(corpus, tmp_path,
                                                                       device, capsys):
    """First-use walk 41: a run saved every 2 steps with --keep 100, then `--resume ck --steps
    N` alone, fell back to --keep 1 and removed the run's kept checkpoints without a word
    (--save-every and --log-every fell back too). They are the run's now (RUN_SAVING); a
    --keep given that removes several folders at once says which; --keep 0 keeps all."""
    ck = tmp_path / "ck"
    train(_args(device, corpus, tmp_path, "--steps", "4", "--eval-every", "0", "--save-every",
                "2", "--keep", "100", "--log-every", "2", "--peak-tflops", "0.05",
                "--save", str(ck)))
    bare = [*device_flags(device), "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
            "--eval-iters", "2", "--sample", "0", "--resume", str(ck), "--save", str(ck)]
    from minidist.train.cli import check_flags

    def parsed(*flags):                        # as train_gpt.py reads them (check_flags)
        args = train_parser().parse_args(bare + list(flags))
        check_flags(args)
        return args
    longer = parsed("--steps", "6")
    train(longer)
    assert (longer.keep, longer.save_every, longer.log_every, longer.peak_tflops) == \
        (100, 2, 2, 0.05)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == \
        ["step-00000002", "step-00000004", "step-00000006"]
    capsys.readouterr()
    train(parsed("--steps", "8", "--keep", "1"))
    assert "saved step 8 to" in (said := capsys.readouterr().out)
    assert "; removed step-00000002, step-00000004, step-00000006 (--keep 1)" in said, said
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000008"]
    train(parsed("--steps", "12", "--keep", "0"))
    assert len([p for p in ck.iterdir() if p.name.startswith("step-")]) == 3   # 8, 10, 12
    # resumed without --save: how it saved is not taken (it was refused, for a --keep 100
    # nobody typed: "--keep 100: sets the checkpoints kept under --save, ..."); how it logs is
    unsaved = train_parser().parse_args(bare[:-2] + ["--steps", "13"])
    check_flags(unsaved)
    assert (unsaved.keep, unsaved.save_every, unsaved.log_every) == (1, 0, 2)


def test_a_resumed_log_takes_out_the_rows_a_cut_off_run_wrote_past_its_checkpoint(
        corpus, tmp_path, device, capsys):
    """First-use walk 41: after a kill -9 past the last save and a resume, the --log-json held
    steps 40-52 twice (the cut-off run's and the resumed run's). Rows of steps from the
    checkpoint on, and a half row, are taken out when the resume starts, and it says so."""
    log, ck = tmp_path / "l.jsonl", tmp_path / "ck"
    common = ["--steps", "6", "--eval-every", "0", "--log-json", str(log)]
    train(_args(device, corpus, tmp_path, *common, "--stop-at", "3", "--save", str(ck)))
    with open(log, "a") as f:                   # what a run cut off after step 5 left
        f.write('{"step": 3, "loss": 9.0}\n{"step": 4, "loss": 9.0}\n{"step": 5, "lo')
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, *common, "--resume", str(ck)))
    assert "note: --log-json " in (said := capsys.readouterr().out), said
    assert "3 row(s) of steps past step 3 taken out" in said      # (2 and a half)
    steps = [r["step"] for r in _rows(log) if "step" in r]
    assert steps == [0, 1, 2, 3, 4, 5] and 9.0 not in [r.get("loss") for r in _rows(log)]
    # a branch from an older checkpoint (newer ones beside it): those rows are its run's,
    # kept (appended after, as before); nothing is taken out
    train(_args(device, corpus, tmp_path, "--steps", "6", "--eval-every", "2", "--keep", "0",
                "--save", str(tmp_path / "all"), "--log-json", str(tmp_path / "b.jsonl")))
    before = len(_rows(tmp_path / "b.jsonl"))
    capsys.readouterr()
    train(_args(device, corpus, tmp_path, "--steps", "6", "--eval-every", "2", "--log-json",
                str(tmp_path / "b.jsonl"), "--resume", str(tmp_path / "all" / "step-00000002")))
    assert "taken out" not in capsys.readouterr().out
    assert len(_rows(tmp_path / "b.jsonl")) > before
