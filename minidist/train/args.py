"""The command-line flags of examples/train_gpt.py and examples/bench_step.py, in one place.

The project's command-line contract fixes these names, which tests, docs and benchmarks rely
on (--dp --tp --pp --zero --comm --device --dtype --amp --ckpt-activations --n-layer --n-head
--n-embd --block-size --batch-size --grad-accum --micro-batches --steps --lr --seed --data
--eval-every --save --resume --log-json --trace --sample); the rest were added since.
`--batch-size` is global, in sequences.
Tests: tests/test_train.py.
"""
import argparse
import functools
import os
import sys

from minidist.launcher import launcher_rank
from minidist.train.cli import device_problem
from minidist.train.given import Given, GivenFalse, GivenSwitch


def add_model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=4, action=Given, help="transformer blocks")
    g.add_argument("--n-head", type=int, default=4, action=Given, help="attention heads")
    g.add_argument("--n-embd", type=int, default=128, action=Given, help="embedding width")
    g.add_argument("--block-size", type=int, default=128, action=Given,
                   help="context length, in tokens")
    g.add_argument("--dropout", type=float, default=0.0, action=Given,
                   help="dropout probability")
    g.add_argument("--attention", choices=("auto", "materialized", "tiled", "recompute"),
                   default="auto",
                   help="tiled: FlashAttention-style tiles, O(T) memory (attention dropout "
                   "drawn per tile); auto: tiled from --block-size 256 on (faster there); "
                   "recompute: materialized, but its (T, T) weights are not kept for "
                   "backward, which computes them again (Megatron's selective recompute)")
    g.add_argument("--attention-block", type=int, default=64, help="tile size, --attention tiled")
    g.add_argument("--no-bias", dest="bias", action=GivenFalse,
                   help="no biases in Linear and LayerNorm layers")
    g.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", action=Given,
                   help="the block: gpt2 (LayerNorm, GELU, learned positions) or llama "
                   "(RMSNorm, SwiGLU, rotary positions, no biases)")
    g.add_argument("--n-kv-head", type=int, default=0, action=Given,
                   help="k and v heads, shared by groups of q heads (grouped-query "
                   "attention; 1: multi-query); 0: --n-head")
    g.add_argument("--rope-theta", type=float, default=10000.0, action=Given,
                   help="rotary positions' base, --arch llama")
    g.add_argument("--ffn-hidden", type=int, default=0, action=Given,
                   help="the MLP's hidden width; 0: 4 x --n-embd, or for --arch llama's "
                   "SwiGLU 8/3 x --n-embd rounded up to a multiple of 64")
    g.add_argument("--norm-eps", type=float, default=1e-5, action=Given,
                   help="the norms' epsilon (GPT-2's and Llama 2's: 1e-5)")
    g.add_argument("--batch-size", type=int, default=16, action=Given,
                   help="global batch, in sequences")
    add_moe_bias_arg(add_moe_args(p))
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when CuPy sees a GPU, else cpu")
    g.add_argument("--dtype", choices=("float32", "float64"), default="float32", action=Given,
                   help="parameter and compute dtype (float64: the exactness tests)")
    g.add_argument("--seed", type=int, default=1337, action=Given,
                   help="initial weights, batches and dropout all follow from it")
    return p


def arch_fields(args):
    """GPTConfig's block fields from add_model_args' --arch, --n-kv-head, --rope-theta,
    --ffn-hidden, --norm-eps and --no-bias (a Llama-style block has no biases)."""
    return dict(arch=args.arch, n_kv_head=args.n_kv_head, rope_theta=args.rope_theta,
                ffn_hidden=args.ffn_hidden, norm_eps=args.norm_eps,
                bias=args.bias and args.arch == "gpt2")


def add_moe_args(p):
    """Mixture of Experts (minidist/nn/moe.py); without --moe-experts the model is dense.
    Returns the group (the planners, minidist/train/planner.py, add to it)."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--moe-experts", type=int, default=0, metavar="E", action=Given,
                   help="each (--moe-every n-th) block's MLP becomes E experts behind a router")
    g.add_argument("--moe-top-k", type=int, default=1, metavar="K", action=Given,
                   help="experts per token")
    g.add_argument("--moe-capacity-factor", type=float, default=1.25, metavar="F", action=Given,
                   help="an expert takes ceil(F K T / E) tokens of a sequence; 0: no dropping")
    g.add_argument("--moe-aux-loss-coef", type=float, default=0.01, action=Given,
                   help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coef", type=float, default=0.0, action=Given,
                   help="weight of the router z-loss")
    g.add_argument("--moe-every", type=int, default=1, metavar="N", action=Given,
                   help="every N-th block is MoE (the others keep their MLP)")
    g.add_argument("--moe-shared", type=int, default=0, metavar="S", action=Given,
                   help="shared experts every token runs beside its routed ones, ungated "
                   "(DeepSeekMoE), as one MLP S x the experts' width; split by --tp as a "
                   "dense MLP")
    return g


def add_moe_bias_arg(g):
    """--moe-bias-rate, in the MoE group `g` of training's flags only (a planner, which shares
    add_moe_args, prices no bias update: minidist/nn/moe_bias.py)."""
    g.add_argument("--moe-bias-rate", type=float, default=0.0, metavar="GAMMA", action=Given,
                   help="auxiliary-loss-free balancing (DeepSeek-V3: 0.001, with "
                   "--moe-aux-loss-coef 0 or a small one): each block's per-expert bias, "
                   "added to the router's probabilities to pick the experts (not to weight "
                   "them), moves by GAMMA after every step: up for an expert below the mean "
                   "load of the step's global batch, down above it; 0: not updated")


def add_parallel_args(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, default=None,
                   help="data-parallel ranks (default: the MPI processes left by the other "
                        "axes, processes / (tp x pp x cp x ep))")
    g.add_argument("--ddp", choices=("naive", "bucketed", "overlapped"), default="overlapped",
                   help="how DDP averages gradients (minidist/ddp/README.md)")
    g.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket size, MiB")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: layer norms and dropout on sequence shards")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks: each sequence split over them (attention: "
                   "--cp-attention)")
    g.add_argument("--cp-split", choices=("zigzag", "naive"), default="zigzag",
                   help="with --cp: zigzag (rank r holds chunks r and 2N-1-r, balanced) or "
                   "naive (contiguous; the last rank does the most causal work)")
    g.add_argument("--cp-attention", choices=("ring", "ulysses"), default="ring",
                   help="with --cp: ring (each rank's queries against every rank's keys and "
                   "values, passed around a ring) or ulysses (all-to-alls trade tokens for "
                   "heads: each rank attends with n_head/cp heads over the whole sequence; "
                   "heads must divide by cp)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: each holds E/ep experts (minidist/ep/)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage instead of DDP: 1 shards the optimizer state, 2 also the "
                   "gradients, 3 also the parameters")
    g.add_argument("--zero-shard", type=int, default=None, metavar="K",
                   help="with --zero: hybrid sharding, each group of K neighbouring ranks of "
                   "ZeRO's group (the dp ranks, times --ep and --cp where given; one node's) "
                   "holds one sharded replica; gathers and reduce-scatters stay in the group, "
                   "only the gradient shards are averaged across groups (FSDP's "
                   "HYBRID_SHARD; default: one group of all of them)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --zero 1 or 2: the updated parameters' all-gathers run in the "
                   "background after the step, each block's waited for just before the next "
                   "forward runs it (Megatron-LM's --overlap-param-gather)")
    g.add_argument("--comm", choices=("ring", "naive", "mpi", "hier", "nccl"), default="ring",
                   help="collective algorithm: ring (minidist's), naive (reduce + broadcast), "
                   "mpi (the MPI library's), hier (reduce-scatter in a node, all-reduce across, "
                   "all-gather in the node), nccl (GPU to GPU; needs CuPy)")
    # default None, not False: comm.init then reads MINIDIST_SYNC_COMM=1 (rankpdb sets it)
    g.add_argument("--sync-comm", action="store_true", default=None,
                   help="run every collective in the calling thread, for a debugger: a "
                   "breakpoint in the ring then stops for DDP's gradient buckets too; costs "
                   "the overlap of communication with backward (minidist/comm/README.md: "
                   "Debugging)")
    g.add_argument("--comm-timeout", type=float, default=None, metavar="SECONDS",
                   help="a collective waiting longer aborts the job, naming the ranks that did "
                   "not arrive (default: MINIDIST_COMM_TIMEOUT or 600; 0: never)")
    g.add_argument("--micro-batches", type=int, default=None,
                   help="pipeline micro-batches per step (default: up to 2 x pp)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe", "zb-h1"), default="1f1b",
                   help="pipeline schedule (minidist/pp/README.md)")
    g.add_argument("--pp-virtual", type=int, default=1, metavar="V",
                   help="chunks of layers per pipeline rank: V > 1 interleaves 1F1B")
    g.add_argument("--amp", action="store_true",
                   help="16-bit compute (bfloat16 on CuPy, float16 on numpy), float32 master")
    g.add_argument("--amp-dtype", choices=("float16", "bfloat16"), default=None,
                   help="the 16-bit type of --amp (default: MINIDIST_AMP_DTYPE, else as "
                   "--amp says; bfloat16 on numpy is emulated and slow)")
    g.add_argument("--grad-dtype", choices=("float32",), default=None, action=Given,
                   help="with --amp: accumulate gradients over micro-batches and reduce them "
                   "over ranks in float32 (Megatron-LM's main_grad; 4 bytes a parameter, not "
                   "2); default: --amp's 16-bit type")
    g.add_argument("--ckpt-activations", action="store_true",
                   help="keep only each block's input; recompute the rest in backward")
    g.add_argument("--no-memory-check", action="store_true",
                   help="start even where the planner's count of the run's memory is more "
                   "than its hosts or GPUs have free (the `memory:` line)")
    return p


def add_train_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=800, action=Given,
                   help="optimizer steps (on --resume: its run's unless given)")
    g.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop (and --save) at this step; the lr schedule still spans --steps")
    g.add_argument("--grad-accum", type=int, default=1, action=Given,
                   help="micro-steps per step; an evaluation (--eval-only's too) runs a "
                   "batch in as many forwards")
    g.add_argument("--lr", type=float, default=4e-3, action=Given, help="peak learning rate")
    g.add_argument("--lr-schedule", choices=("cosine", "wsd"), default="cosine", action=Given,
                   help="after --warmup: cosine decay to --min-lr over the run, or wsd: "
                   "warmup-stable-decay, --lr until the last --decay-steps, then down to "
                   "--min-lr (a wsd run saved before its decay can be extended: --resume with "
                   "a larger --steps)")
    g.add_argument("--decay-steps", type=int, default=None, action=Given,
                   help="with --lr-schedule wsd: the steps of the final decay (default: "
                   "steps / 5)")
    g.add_argument("--min-lr", type=float, default=None, action=Given, help="default lr / 10")
    g.add_argument("--warmup", type=int, default=None, action=Given, help="default steps / 20")
    g.add_argument("--weight-decay", type=float, default=0.1, action=Given,
                   help="decoupled weight decay, on matrices")
    g.add_argument("--beta1", type=float, default=0.9, action=Given,
                   help="AdamW's first-moment decay, in [0, 1)")
    g.add_argument("--beta2", type=float, default=0.95, action=Given,
                   help="AdamW's second-moment decay, in [0, 1) (nanoGPT's small runs: 0.99)")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", action=Given,
                   help="adamw, or muon: the blocks' matrices by Muon (momentum, "
                   "orthogonalised by Newton-Schulz, scaled to AdamW's RMS: one --lr), "
                   "the rest by AdamW (--resume: the checkpoint's)")
    g.add_argument("--muon-momentum", type=float, default=0.95, action=Given,
                   help="with --optimizer muon: its (Nesterov) momentum, in [0, 1)")
    g.add_argument("--muon-ns-steps", type=int, default=5, action=Given,
                   help="with --optimizer muon: its Newton-Schulz iterations per step")
    g.add_argument("--grad-clip", type=float, default=1.0, action=Given, help="0: no clipping")
    g.add_argument("--data", default=None, type=a_path,
                   help="text file or folder of text files, or a folder of token files "
                   "(train.bin and val.bin, or shards <name>_train_<N>.bin, as nanoGPT and "
                   "llm.c write them) (default: Python's stdlib sources; --resume: the "
                   "checkpoint's)")
    g.add_argument("--tokenizer", default=None, type=a_path, metavar="DIR",
                   help="a folder with a BPE's vocab.json and merges.txt (a GPT-2 download's, "
                   "or examples/train_tokenizer.py's): text --data is tokenized with it, token "
                   "files are checked against it and sampled with it (default: bytes; "
                   "--init-from's, where it has them)")
    g.add_argument("--cache-dir", default=None, type=a_path,
                   help="where text data's tokens are cached (token files are read in place; "
                   "default: .minidist-cache/ beside --data where writable, else "
                   "$MINIDIST_CACHE or ~/.cache/minidist)")
    g.add_argument("--eval-every", type=int, default=200, action=Given,
                   help="0: only at the end")
    g.add_argument("--eval-iters", type=int, default=20, action=Given,
                   help="val batches per eval")
    g.add_argument("--eval-only", action="store_true",
                   help="train nothing: evaluate the weights of --resume DIR or --init-from "
                   "DIR on --eval-iters val batches (in any layout), print the val loss and "
                   "perplexity, sample --sample tokens, and exit; of a checkpoint, on its "
                   "run's val batches (its --seed, --batch-size, --eval-iters) unless given")
    g.add_argument("--log-every", type=int, default=25, action=Given,
                   help="steps between log lines (--resume: the run's unless given)")
    g.add_argument("--peak-tflops", type=float, default=None, action=Given,
                   help="a rank's device's dense peak, TFLOP/s: the log lines and rows add "
                   "mfu, the model's FLOP/s per rank over it")
    g.add_argument("--save", default=None, type=a_path, metavar="DIR",
                   help="checkpoint folder: DIR/step-<N>/ per save and DIR/latest naming the "
                   "newest, written at evals, --save-every and the end, and on SIGTERM, "
                   "SIGUSR1 or Ctrl-C. A DIR that already holds a checkpoint is refused "
                   "unless the run resumes from it (--resume) or --overwrite is given")
    g.add_argument("--save-every", type=int, default=0, action=Given,
                   help="0: at evals and at the end (--resume: the run's unless given)")
    g.add_argument("--async-save", action="store_true",
                   help="a save stalls the step only for host copies of what each rank "
                   "writes; a thread writes the files while the next steps train, and the "
                   "checkpoint is committed (`latest`) once every rank's are written (at most "
                   "one in flight; waited for before the next save and at the end)")
    g.add_argument("--keep", type=int, default=1, metavar="K", action=Given,
                   help="numbered checkpoint folders kept under --save (the newest K; 0: "
                   "all; --resume: the run's unless given)")
    g.add_argument("--keep-best", action=GivenSwitch, default=False,
                   help="also keep the checkpoint of the lowest val loss, named by DIR/best "
                   "(--resume DIR/best; a checkpoint is saved at every evaluation); "
                   "--resume: the run's unless given")
    g.add_argument("--overwrite", action="store_true",
                   help="--save into a DIR holding checkpoints of another (or a newer) run: "
                   "this run's saves then replace them (its folders of later steps too, "
                   "once this run's save is complete); --log-json into a file holding "
                   "another run's rows: replaced")
    g.add_argument("--resume", default=None, type=a_path, metavar="DIR",
                   help="continue from a checkpoint folder or a --save DIR (its newest; the "
                   "model flags, --dtype and --amp follow it). `--resume auto`: from --save "
                   "DIR's newest if it holds one, else start fresh, so a requeued job reruns "
                   "the same command")
    g.add_argument("--init-from", default=None, type=a_path, metavar="DIR",
                   help="start a new run (fresh optimizer, step 0) from the weights of a "
                   "GPT-2 or Llama folder (config.json, model.safetensors, as Hugging Face "
                   "writes them) or of a minidist checkpoint, instead of the seed's; the "
                   "model flags follow it, --block-size at most its positions; train on data "
                   "of its vocabulary (--data: token files, or text when the folder has "
                   "vocab.json and merges.txt, or the checkpoint's run had a --tokenizer)")
    g.add_argument("--log-json", default=None, type=a_path, metavar="FILE",
                   help="rank 0 writes one JSON object per step (appended with --resume)")
    g.add_argument("--trace", default=None, type=a_path, metavar="FILE",
                   help="Chrome trace of compute and communication (chrome://tracing); "
                   "needs more than one rank, or --zero")
    g.add_argument("--sample", type=int, default=400,
                   help="tokens sampled at the end (bytes, on text data)")
    g.add_argument("--threads", type=int, default=None, help="BLAS threads (default: auto, "
                   "the node's cores over its ranks; on busy cores 1 can be much faster)")
    g.add_argument("--traceback", action="store_true",
                   help="on a user error, show the traceback, not just the one error line "
                        "(also MINIDIST_DEBUG=1)")
    return p


class HelpWithDefaults(argparse.HelpFormatter):
    """--help lists each flag's default, where it has one (not for switches, not None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.nargs != 0 and not any(action.default is v
                                              for v in (None, False, argparse.SUPPRESS))
        if shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as every other user error (minidist/train/cli.py): one
    `error:` line from the launcher's rank 0 only, exit status 2, no usage block per rank;
    and no abbreviations: `--seq 256` (plan.py's flag) is an unknown --seq, not
    --sequence-parallel with a stray 256, and `--step 3` does not run as --steps 3."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        if launcher_rank() == 0:
            sys.stderr.write(f"error: {message} ({os.path.basename(self.prog)} --help lists "
                             "the flags)\n")
        sys.exit(2)


class ExampleParser(Parser):
    """Parser, and a --device cuda (or --algos/--comm naming nccl) where CuPy sees no GPU is
    its one `error:` line too: the benchmarks set the device up after parsing, where
    backend.setup raised a traceback on every rank. (train_gpt.py checks this among its
    flags, where the ranks agree on it: cli.check_device.)"""

    def __init__(self, *args, cpu_only=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu_only = cpu_only       # why the script refuses --device cuda, or None

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        device = getattr(parsed, "device", None)
        if self.cpu_only and device == "cuda":
            self.error(f"--device cuda: {self.cpu_only} (leave --device out)")
        algos = "nccl" in (getattr(parsed, "algos", None) or [])
        problem = device_problem(device, algos or getattr(parsed, "comm", None) == "nccl",
                                 "--algos nccl" if algos else "--comm nccl")
        if problem:
            self.error(problem)
        return parsed


def example_parser(doc, cpu_only=None):
    """The parser of a script in examples/: the first paragraph of its docstring `doc` as the
    description, each flag's default in --help, a bad flag one `error:` line (ExampleParser;
    `cpu_only`: why the script refuses --device cuda)."""
    return ExampleParser(description=" ".join(doc.split("\n\n")[0].split()),
                         formatter_class=HelpWithDefaults, cpu_only=cpu_only)


def check_at_least(p, args, table):
    """The benches' range checks: for each (flag, lowest value, what it is) of `table`, a
    value given below its lowest, or NaN (attention_memory.py --max-gib nan allocated the
    whole batch's 16 GiB), is p.error's one `error:` line, exit status 2 (None, a flag left
    unset, is not checked)."""
    for flag, low, what in table:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value >= low:
            p.error(f"{flag} {value}: must be at least {low} ({what})")


def a_path(text):
    """The argparse type of a flag that names a file or folder: `text`, refused when empty
    (`--save "$CKPT"` with the variable unset crashed in os.makedirs; `--log-json ""` and
    `--cache-dir ""` were dropped without a word, as if not given: tests/scripts/fuzz_cli.py)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (a shell variable left unset?): give "
                                         "a file or folder, or leave the flag out")
    return text


def train_parser():
    p = Parser(description="Train a GPT, on one process or many (README.md; the step: "
                        "minidist/train/README.md).",
               formatter_class=HelpWithDefaults)
    return add_train_args(add_parallel_args(add_model_args(p)))


@functools.cache
def _checking_parser():
    """One train_parser, built on first use, for the checks below (never handed out)."""
    return train_parser()


def parse_train_flags(argv):
    """train_gpt.py's flags `argv` parsed, by one parser built once: building one takes
    about 3 ms, and the planners check thousands of layouts as training's flags."""
    return _checking_parser().parse_args(argv)


def train_default(name):
    """train_gpt.py's default of the flag whose dest is `name` (e.g. "muon_ns_steps")."""
    return _checking_parser().get_default(name)
