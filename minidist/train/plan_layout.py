"""examples/plan.py's --layout: key=value items or a layout's name as the planners' tables
print it, read into a planner.Layout and the micro-batch counts to price. A layout
examples/train_gpt.py would not run (search.layout_problems: training's own checks), an
unknown or repeated key, a name whose precision or attention contradicts the flags: a
LayoutError whose message is plan.py's one `error:` line.
Tests: tests/test_plan_cli.py (the CLI's --layout cases).
"""
import re

from minidist.train.planner import Layout, layout_from_name
from minidist.train.search import CP_ATTENTIONS, layout_problems, micro_batch_counts


class LayoutError(ValueError):
    """A --layout plan.py cannot price; the message names the problem and the fix."""


LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "zero", "ep", "micro", "shard")


def parse_layout(text, args, config, v):
    """--layout -> (Layout, the micro-batch counts to price): key=value items
    (`layout_fields`: micro=M one count; without micro=, every count the search tries) or a
    name as the tables print it (`named_fields`: every count the search tries). A layout
    examples/train_gpt.py would not run (search.layout_problems: training's own checks) is
    one error line."""
    named = NAMED.match(text.strip())
    fields, micro = named_fields(text, args) if named else layout_fields(text)
    sp = fields.pop("sp", True)
    fields.pop("amp", None)                  # the flags' (named_fields checked the name's)
    fields.pop("tiled", None)
    if args.attention == "recompute":        # train_gpt's: the scores always recomputed
        fields.setdefault("recompute", "selective")
    fields.pop("grad32", None)               # the flag's (named_fields checked the name's)
    layout = Layout(amp=not args.fp32, sp=sp and fields.get("tp", 1) > 1,
                    tiled=args.attention == "tiled", muon=args.optimizer == "muon",
                    grad32=args.grad_dtype == "float32", **fields)
    counts = micro_batch_counts(layout.pp, args.global_batch // layout.dp, grouped=v > 1) \
        if micro is None else [micro]
    problems = layout_problems(config, layout, args.gpus, args.global_batch, counts[0],
                               args.schedule, v) if counts else \
        [f"a global batch of {args.global_batch} over dp {layout.dp} leaves no micro-batch "
         f"count for {layout.pp} stages"]
    if problems:
        raise LayoutError("--layout: " + "; ".join(problems) + " (change the layout, or leave "
                          "--layout out to search the ones train_gpt.py runs)")
    return layout, counts


NAMED = re.compile(r"(TP|PP|CP|EP)\d|ZeRO-|DDP", re.IGNORECASE)  # (key=value: tp=, zero=)


def named_fields(text, args):
    """A layout's name as plan.py's and plan_memory.py's tables print it -> (its fields,
    None: the search's micro-batch counts). Its precision and attention must be the
    flags': the name says "fp32" with --fp32 alone, "tiled" with --attention tiled alone."""
    fields = layout_from_name(text, args.gpus)
    if isinstance(fields, str):
        raise LayoutError(f"--layout: {fields}")
    amp = fields.get("amp", not args.fp32)
    tiled = fields.get("tiled", args.attention == "tiled")
    if amp == args.fp32:
        raise LayoutError(f"--layout {text!r}: names a " + (
            "mixed-precision layout: drop --fp32" if amp else "float32 layout: add --fp32"))
    if fields.get("grad32", False) != (args.grad_dtype == "float32"):
        raise LayoutError(f"--layout {text!r}: " + (
            "names float32 gradients: give --grad-dtype float32" if fields.get("grad32") else
            "has no 'fp32 grads': leave --grad-dtype out, or write the name with 'fp32 grads'"))
    if tiled != (args.attention == "tiled"):
        raise LayoutError(f"--layout {text!r}: " + (
            "names tiled attention: give --attention tiled" if tiled else
            "has no 'tiled': it names materialized attention, as plan_memory.py prices it; "
            "give --attention materialized, or write the name with 'tiled'"))
    if args.attention == "recompute" and fields.get("recompute", "none") == "none":
        raise LayoutError(f"--layout {text!r}: names attention that keeps its scores; give "
                          "--attention materialized, or write the name with 'selective "
                          "recompute'")
    return fields, None


def layout_fields(text):
    """"dp=8,tp=8,zero=1,micro=4,ckpt" -> (fields, micro-batches, None where not given);
    "nosp": TP without
    sequence parallelism; "ep=2": expert parallelism; "cpattn=ulysses": Ulysses' all-to-alls
    instead of the ring (cp > 1); "shard=8": hybrid sharding, ZeRO over each 8 dp ranks. An
    unknown or repeated key, a value that is not a whole number (cpattn: not ring or
    ulysses) are one error line naming the key."""
    fields, micro, seen = {}, None, set()      # micro None: the search's counts
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if key in seen:
            raise LayoutError(f"--layout: {key} is given twice; give each key once")
        seen.add(key)
        if item in ("ckpt", "selective") and "recompute" in fields:
            raise LayoutError("--layout: ckpt and selective: give one recompute (ckpt: full; "
                              "selective: the attention's scores)")
        if item == "ckpt":
            fields["recompute"] = "full"
        elif item == "selective":         # (search.layout_problems: where no scores are kept)
            fields["recompute"] = "selective"
        elif item == "nosp":
            fields["sp"] = False
        elif item == "ogather":
            fields["overlap_gather"] = True
        elif key == "cpattn" and eq:
            if value not in CP_ATTENTIONS:
                raise LayoutError(f"--layout: {item}: cpattn is "
                                  + " or ".join(CP_ATTENTIONS))
            fields["cp_attention"] = value
        elif key in LAYOUT_KEYS and eq:
            if not (value.isascii() and value.isdecimal()):     # -1, abc, 2.5, ""
                raise LayoutError(f"--layout: {item}: {key} takes a whole number ("
                                  + ("0 to 3" if key == "zero" else "1 or more") + ")")
            if key == "micro":
                micro = int(value)
            else:
                fields["zero_shard" if key == "shard" else key] = int(value)
        else:
            raise LayoutError(f"--layout: cannot read {item!r}; use dp=,tp=,pp=,cp=,zero=,ep=,"
                              f"micro=,shard=,cpattn=,ckpt,selective,nosp,ogather, or a name "
                              f"as the table prints it")
    return fields, micro
