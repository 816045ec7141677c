"""Pipeline schedules: the order in which one stage runs its micro-batches' forwards (F),
backwards (B) and, split off the backward, weight gradients (W). A schedule is a function of
(link, steps) that only calls `steps` (minidist/pp/microbatches.py: the compute) and `link`
(minidist/pp/link.py: the sends and receives), so the very same functions train under MPI
and run on a logical clock in one process (`python -m minidist.pp.simulate` draws them).

    stage 0: embedding + blocks [0, L/pp)   ...   stage pp-1: blocks [.., L) + ln_f + head + loss

    gpipe             all forwards, then all backwards (Huang et al. 2019)
    one_f_one_b       warmup p-s-1 forwards, then one forward one backward, then the rest
                      of the backwards (PipeDream-Flush, Megatron-LM's 1F1B)
    interleaved_1f1b  v chunks of layers per rank, round robin (virtual stage k = chunk * p +
                      rank): 1F1B over m * v chunk-micro-batches in Megatron-LM's order
                      (Narayanan et al. 2021); the bubble shrinks v-fold, p2p traffic grows
                      v-fold
    zb_h1             1F1B with each backward split into B (dL/d input: what the previous
                      stage waits for) and W (dL/d weights: nothing waits for it); stage s
                      holds back s W's to fill its bubble (Qi et al. 2023, "ZB-H1"): at
                      most p micro-batches in flight on any stage, as 1F1B's first stage

`bubble_fraction(schedule, p, m, v)` gives each schedule's idle share of a step (equal
stages, free messages); the simulator reproduces it exactly (tests/test_pipeline.py).

Every schedule runs each parameter's backward contributions in micro-batch order 0..m-1, so
all of them add every gradient in the same order: GPipe, 1F1B and ZB-H1 end a step bitwise
equal (checked in tests/scripts/pp_check.py).
Tests: tests/test_pipeline.py (exactness vs one process, in-flight activations, bad input).
"""
import itertools


def split_layers(n_layer, n_stages):
    """Stage s's blocks: contiguous ranges, as equal as possible (earlier stages get the
    remainder). More stages than blocks is an error: a stage needs at least one block."""
    if n_stages < 1 or n_stages > n_layer:
        raise ValueError(f"pipeline: {n_stages} stages for {n_layer} blocks; every stage "
                         f"needs at least one block, so use --pp between 1 and --n-layer "
                         f"({n_layer})")
    base, extra = divmod(n_layer, n_stages)
    sizes = [base + (s < extra) for s in range(n_stages)]
    ends = list(itertools.accumulate(sizes))
    return [range(end - n, end) for n, end in zip(sizes, ends)]


def block_stages(n_layer, n_stages, n_chunks=1):
    """Each block's pipeline stage, block i's at [i]: split_layers' ranges, as the pipeline
    builds them (the planners count each stage's parameters, activations and work from it:
    6 blocks on 4 stages are 2, 2, 1, 1; i * p // L, counted before, made them 2, 1, 2, 1).
    Under interleaving (n_chunks v > 1) chunk_layers' pieces, piece k on stage k % p: about
    as many blocks a stage, but others of them (4 blocks, p = v = 2: stage 0 holds blocks 0
    and 2, not 0 and 1; with an MoE block every second one, stage 1 holds both MoE blocks)."""
    pieces = split_layers(n_layer, n_stages * n_chunks)
    return [k % n_stages for k, blocks in enumerate(pieces) for _ in blocks]


def chunk_layers(n_layer, n_stages, n_chunks, stage):
    """The blocks of each of `stage`'s chunks under interleaving: the model cut into
    n_stages * n_chunks contiguous pieces, piece k on rank k % n_stages (chunk k // n_stages):
    with 8 blocks, p = 2, v = 2, rank 0 holds blocks 0-1 and 4-5, rank 1 blocks 2-3 and 6-7."""
    pieces = split_layers(n_layer, n_stages * n_chunks)
    return [pieces[c * n_stages + stage] for c in range(n_chunks)]


# ---- the schedules -------------------------------------------------------------------------

def gpipe(link, steps):
    """All forward, then all backward (GPipe, Huang et al. 2019)."""
    m = steps.n_micro
    # all forward: micro-batch i reaches stage s at slot s + i
    for i in range(m):
        x = link.recv_forward(i)
        link.send_forward(steps.forward(i, x), i)
    # all backward, in the same micro-batch order
    for i in range(m):
        g = link.recv_backward(i)
        link.send_backward(steps.backward(i, g), i)


def one_f_one_b(link, steps):
    """One forward, one backward (PipeDream-Flush / Megatron-LM's 1F1B, Narayanan et al.)."""
    m = steps.n_micro
    n_warmup = min(link.n_stages - link.stage - 1, m)   # forwards before the first backward
    n_steady = m - n_warmup
    # warmup: forwards only, filling the pipeline
    for i in range(n_warmup):
        x = link.recv_forward(i)
        link.send_forward(steps.forward(i, x), i)
    # steady state: forward micro-batch n_warmup + k, then backward micro-batch k
    x = link.recv_forward(n_warmup) if n_steady else None
    for k in range(n_steady):
        i_fwd, i_bwd = n_warmup + k, k
        out = steps.forward(i_fwd, x)
        g = link.send_forward_recv_backward(out, i_fwd, i_bwd)
        g_in = steps.backward(i_bwd, g)
        if k == n_steady - 1:
            link.send_backward(g_in, i_bwd)
        else:
            x = link.send_backward_recv_forward(g_in, i_bwd, i_fwd + 1)
    # cooldown: the backwards of the warmup's micro-batches
    for i in range(n_steady, m):
        g = link.recv_backward(i)
        link.send_backward(steps.backward(i, g), i)


def interleaved_1f1b(link, steps):
    """1F1B over virtual stages (Megatron-LM's interleaved schedule, Narayanan et al. 2021).
    Rank r holds v chunks; its k-th forward is of chunk (k mod pv) // p, micro-batch
    (k // pv) p + k mod p: p micro-batches through chunk 0, the same p through chunk 1, ...,
    then the next p. Its k-th backward walks the chunks in reverse (chunk v-1 first). Warmup
    is (p-r-1)*2 + (v-1)*p forwards (Megatron's count), then one forward one backward, then
    the remaining backwards. Needs m a multiple of p (the strategy refuses the rest)."""
    p, v, m = link.n_stages, link.n_chunks, steps.n_micro
    total = m * v
    n_warmup = min((p - link.stage - 1) * 2 + (v - 1) * p, total)

    def micro_batch(k):
        return (k // (p * v)) * p + k % p

    def forward(k):
        i, chunk = micro_batch(k), (k % (p * v)) // p
        x = link.recv_forward_chunk(i, chunk)
        link.isend_forward(steps.forward(i, x, chunk), i, chunk)

    def backward(k):
        i, chunk = micro_batch(k), v - 1 - (k % (p * v)) // p
        g = link.recv_backward_chunk(i, chunk)
        link.isend_backward(steps.backward(i, g, chunk), i, chunk)
    # warmup: forwards only, deep enough that every rank's first backward finds its input
    for k in range(n_warmup):
        forward(k)
    # steady state: forward n_warmup + k, then backward k
    for k in range(total - n_warmup):
        forward(n_warmup + k)
        backward(k)
    # cooldown: the remaining backwards
    for k in range(total - n_warmup, total):
        backward(k)
    link.wait_sends()


def zb_h1(link, steps):
    """ZB-H1 (Qi et al. 2023): 1F1B's order of F and B, with each backward split. B keeps
    1F1B's place, so gradients reach the previous stage as early as ever; W (the weight
    gradients) follows it, except that stage s holds back its first s W's: the later stages,
    which would wait for forwards, do W's then instead, and the held-back ones fill the tail.
    A micro-batch is in flight until its W, so stage s holds at most (p-s) + s = p: the peak
    of 1F1B's first stage, on every stage. Sends are posted (as in interleaved_1f1b), so a W
    can run between sending a gradient and receiving the next input."""
    m, s = steps.n_micro, link.stage
    n_warmup = min(link.n_stages - s - 1, m)
    w_next = 0                                   # the next micro-batch whose W is due

    def forward(i):
        x = link.recv_forward_chunk(i, 0)
        link.isend_forward(steps.forward(i, x), i, 0)

    def backward_input(i):
        g = link.recv_backward_chunk(i, 0)
        link.isend_backward(steps.backward_input(i, g), i, 0)
    # warmup: forwards only, filling the pipeline
    for i in range(n_warmup):
        forward(i)
    # steady state: F of n_warmup + k, B of k, then a W (none in the first s rounds)
    for k in range(m - n_warmup):
        forward(n_warmup + k)
        backward_input(k)
        if k >= s:
            steps.backward_weight(w_next)
            w_next += 1
    # cooldown: the warmup's B's, each followed by a W
    for i in range(m - n_warmup, m):
        backward_input(i)
        steps.backward_weight(w_next)
        w_next += 1
    # the W's held back fill the tail, where a 1F1B stage would wait
    for i in range(w_next, m):
        steps.backward_weight(i)
    link.wait_sends()


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}


def schedule_function(name, n_chunks=1):
    """The schedule for --schedule NAME and --pp-virtual n_chunks (1F1B with more than one
    chunk per rank is the interleaved one)."""
    if n_chunks > 1:
        if name != "1f1b":
            raise ValueError(f"--pp-virtual {n_chunks} interleaves 1F1B; use --schedule 1f1b")
        return interleaved_1f1b
    return SCHEDULES[name]


def bubble_fraction(schedule, p, m, v=1, t_f=1.0, t_b=1.0, t_w=1.0):
    """The share of a step each stage idles, for equal stages and free messages (the
    simulator's pictures measure exactly this). t_f, t_b, t_w: a (chunk's) forward, input-
    gradient and weight-gradient time; schedules that do not split backward run B and W
    together.
        gpipe, 1f1b      (p-1) / (m+p-1): p-1 slots of F+B+W idle out of m+p-1
        1f1b, v > 1      (p-1) / (v m + p-1): the same p-1 slots, each 1/v as long, i.e.
                         (p-1)/(v m) of the ideal step (Narayanan et al.)
        zb-h1            (p-1)(t_f+t_b-t_w) / (m(t_f+t_b+t_w) + (p-1)(t_f+t_b-t_w)): the
                         W's fill t_w of each idle slot (for t_w < t_f + t_b);
                         (p-1)/(3m+p-1) for equal times.
                         With m < p there are too few W's: the step is F and B through
                         all stages, (m+p-1)(t_f+t_b), and the first stage's last W"""
    if schedule == "zb-h1" and v == 1:
        work = m * (t_f + t_b + t_w)
        step = max(work + (p - 1) * (t_f + t_b - t_w),      # m >= p: W's fill the bubble
                   (m + p - 1) * (t_f + t_b) + t_w)        # m < p: too few W's to fill it
        return 1 - work / step
    if schedule in ("gpipe", "1f1b") and (v == 1 or schedule == "1f1b"):
        return (p - 1) / (v * m + p - 1)
    raise ValueError(f"no bubble formula for schedule {schedule!r} with v = {v}")


def peak_in_flight(schedule, p, stage, m, v=1):
    """The most micro-batches (interleaved: chunk-micro-batches) stage `stage` of p holds
    the activations of at once, in the order these functions run them:
        gpipe             m on every stage: all forwards come first
        1f1b              min(m, p - s): the warmup's p - s - 1 forwards and one more
        zb-h1             min(m, p) on every stage: a micro-batch is held until its W
        1f1b, v > 1       min(m v, 2 (p - s - 1) + (v - 1) p + 1): Megatron's warmup and one
    (tests/test_pipeline.py checks them against the simulator's count). The memory planner
    (minidist/train/activations.py) prices activations with them."""
    if v > 1:
        if schedule not in ("1f1b", "interleaved"):
            raise ValueError(f"v = {v} chunks per stage interleave 1F1B, not {schedule!r}")
        return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    counts = {"gpipe": m, "1f1b": min(m, p - stage), "interleaved": min(m, p - stage),
              "zb-h1": min(m, p)}
    if schedule not in counts:
        raise ValueError(f"schedule must be gpipe, 1f1b, interleaved or zb-h1, not {schedule!r}")
    return counts[schedule]


def waiting_for_weights(schedule, p, stage, m):
    """At the peak of a ZB-H1 stage, how many of its micro-batches in flight are past their
    B, waiting for their W (0 for the other schedules, which run B and W together): stage s
    holds 1F1B's min(m, p - s) whole, and then the W's it holds back, min(s, m - (p - s)),
    at once (the round of the steady state that ends the holding-back; peak_in_flight counts
    both). Such a micro-batch keeps only what its weights' gradients read (the matmuls'
    inputs and output gradients: minidist/train/activations.py weight_work_bytes)."""
    if schedule != "zb-h1":
        return 0
    return min(m, p) - min(m, p - stage)


def measured_bubble(events_by_rank):
    """The measured bubble of the last step: on each rank, the share of the window from the
    first micro-batch's start to the last one's end (over all ranks) spent not computing
    (its F/B/W events, recorded by microbatches.traced). Returns (mean over ranks, [per
    rank])."""
    steps = []
    for events in events_by_rank:
        compute = [e for e in events if e["group"] == "compute" and e["op"][0] in "FBW"]
        starts = [k for k, e in enumerate(compute) if e["op"] == "F0"]
        steps.append(compute[starts[-1]:] if starts else [])
    t0 = min(e["start"] for step in steps for e in step)
    t1 = max(e["end"] for step in steps for e in step)
    idle = [1.0 - sum(e["end"] - e["start"] for e in step) / (t1 - t0) for step in steps]
    return sum(idle) / len(idle), idle
