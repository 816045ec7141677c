"""The model flags' own checks, before any work (GPTConfig checks the same fields later, after
MPI started and the data was read, naming the fields; these name the flags): the block's
(--arch, --n-kv-head, --rope-theta, --norm-eps: `check_arch`) and the Mixture of Experts'
(--moe-*: `check_moe`). cli.check_flags calls both; each raises cli.UsageError.
Tests: tests/test_cli.py, tests/test_llama.py, tests/test_moe.py.
"""
from minidist.train.cli import UsageError


def check_arch(args):
    """--n-kv-head, --rope-theta, --norm-eps and --arch llama's head size (GPTConfig's own
    checks, as flags, before MPI starts)."""
    kv = args.n_kv_head
    if args.arch == "gpt2":
        typed = [f for f, on in (("--n-kv-head", kv), ("--rope-theta",
                                                      args.rope_theta != 10000.0)) if on]
        if typed:
            raise UsageError(f"{typed[0]}: belongs to --arch llama's block (GPT-2's has "
                             "multi-head attention and learned positions); add --arch llama "
                             f"or leave {typed[0]} out")
    if args.arch == "llama" and "bias" in getattr(args, "given", []):
        raise UsageError("--no-bias: --arch llama has no biases already; leave --no-bias out")
    if kv and args.n_head % kv:
        raise UsageError(f"--n-kv-head {kv}: --n-head {args.n_head} is not a multiple of it "
                         "(each k and v head serves --n-head / --n-kv-head q heads); give a "
                         f"divisor of {args.n_head}")
    if not args.rope_theta > 0:
        raise UsageError(f"--rope-theta {args.rope_theta}: must be positive (Llama: 10000)")
    if not 0 < args.norm_eps < 1:
        raise UsageError(f"--norm-eps {args.norm_eps}: must be between 0 and 1 (1e-5, or a "
                         "folder's own)")
    if args.arch == "llama" and (args.n_embd // args.n_head) % 2:
        raise UsageError(f"--arch llama: the head size --n-embd / --n-head = "
                         f"{args.n_embd // args.n_head} must be even (rotary positions turn "
                         "pairs of columns)")


MOE_FLAGS = ("moe_top_k", "moe_every", "moe_capacity_factor", "moe_aux_loss_coef",
             "moe_z_loss_coef", "moe_shared", "moe_bias_rate")


def check_moe(args):
    """The --moe-* flags, in their own names and before any work (GPTConfig checks the same
    fields later, after MPI started and the data was read, naming the fields)."""
    experts = args.moe_experts
    if experts < 0 or experts == 1:
        raise UsageError(f"--moe-experts {experts}: 0 (a dense model) or at least 2 experts")
    if not experts:
        from minidist.train.args import train_default    # (args.py imports cli.py)
        weights = getattr(args, "resume", None) or getattr(args, "init_from", None)
        for name in MOE_FLAGS:                  # a flag that would do nothing: refused
            value = getattr(args, name, None)   # (a planner's flags have no --moe-bias-rate)
            if value is not None and value != train_default(name):
                flag = "--" + name.replace("_", "-")
                fix = (f"the model of {weights} is dense: leave {flag} out" if weights else
                       f"add --moe-experts E, 2 or more, or leave {flag} out")
                raise UsageError(f"{flag} {getattr(args, name)}: only used with --moe-experts "
                                 f"({fix})")
        return
    if not 1 <= args.moe_top_k <= experts:
        raise UsageError(f"--moe-top-k {args.moe_top_k}: experts per token, from 1 to "
                         f"--moe-experts {experts}")
    if not 1 <= args.moe_every <= args.n_layer:
        raise UsageError(f"--moe-every {args.moe_every}: from 1 (every block is MoE) to "
                         f"--n-layer {args.n_layer}")
    if args.moe_shared < 0:
        raise UsageError(f"--moe-shared {args.moe_shared}: shared experts, 0 or more")
    for flag in ("--moe-capacity-factor", "--moe-aux-loss-coef", "--moe-z-loss-coef",
                 "--moe-bias-rate"):
        value = getattr(args, flag[2:].replace("-", "_"), 0)      # (a planner: no bias rate)
        if value < 0:
            raise UsageError(f"{flag} {value}: must not be negative")
