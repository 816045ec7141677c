"""What examples/own_loop_ddp.py, own_loop_zero.py and own_loop_tp.py check their recipes
against: the same global batches, trained by one process with the plain loop, and the
largest difference of a run's parameters from it over every rank. Not a script: those three
import it (they run from examples/, which Python puts on the path)."""
import numpy as np

from minidist import backend, comm
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW

LR, CLIP = 1e-2, 0.5
ROWS = 8                 # a global batch's rows


def add_check_flags(p, steps):
    """The flags every script takes: --steps (default `steps`), --dropout, --tol, --device."""
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--dropout", type=float, default=0.1, help="the GPT's dropout")
    p.add_argument("--tol", type=float, default=1e-10, help="largest difference allowed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="array device")


def start(p, per_rank_split):
    """Parse `p`'s flags, set up the device and MPI: (args, the world group, the tiny GPT's
    config with --dropout). `per_rank_split(args)`: the count this rank's rows must split
    into (micro-batches; 1), refused by `p` where the global batch does not split so."""
    args = p.parse_args()
    for bad, said in ((args.steps < 1, f"--steps {args.steps}: give at least 1 (0 compared "
                       "nothing and passed)"),
                      (not 0 <= args.dropout < 1, f"--dropout {args.dropout}: a probability "
                       "in [0, 1)"),
                      (not args.tol >= 0, f"--tol {args.tol}: give a difference >= 0")):
        if bad:          # before MPI: one line from every rank's parser, not MPI_Abort
            p.error(said)
    backend.setup(device=args.device)
    group = comm.init("ring")
    split = per_rank_split(args)
    if split < 1 or ROWS % (group.size * split):
        p.error(f"{group.size} ranks x {split} micro-batches do not divide the global batch "
                f"of {ROWS} rows into equal micro-batches")
    return args, group, GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16,
                                  vocab_size=64, dropout=args.dropout)


def global_batch(step, config, rows=ROWS):
    """The step's global batch (x, y), (rows, T) token ids: the same on every rank."""
    data = np.random.default_rng([0, step]).integers(0, config.vocab_size,
                                                     (rows, config.block_size + 1))
    return data[:, :-1], data[:, 1:]


def one_process(config, steps, make_optimizer=None):
    """The reference: one process, the whole global batch, the plain loop.
    `make_optimizer(named_parameters)`: your own optimizer's (default AdamW at LR)."""
    model = GPT(config, seed=0, dtype="float64")
    opt = (make_optimizer or _adamw)(model.named_parameters())
    for step in range(steps):
        _, loss = model(*global_batch(step, config))   # advances the dropout step itself
        loss.backward()
        opt.clip_grad_norm(CLIP)
        opt.step()
        opt.zero_grad()
    return model


def _adamw(named_parameters):
    return AdamW(named_parameters, lr=LR)


def largest_difference(group, arrays, ref):
    """The largest |parameter - one process's| over `arrays` ({name: array} this rank
    holds whole; none on a rank that holds none) and every rank of `group`; inf where any
    is NaN (Python's max() and MPI's MAX could drop a NaN, and a NaN compares as passing)."""
    ref = {n: backend.to_host(p.data) for n, p in ref.named_parameters()}
    local = np.max([np.abs(backend.to_host(a) - ref[n]).max() for n, a in arrays.items()],
                   initial=0.0)
    buf = np.array([np.inf if np.isnan(local) else float(local)])
    group.all_reduce(buf, op="max")
    return float(buf[0])
