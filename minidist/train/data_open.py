"""Opening --data on every rank of a job, with one tokenizing per node (loop.train calls
`open_data_shared` once the strategy is made).

    open_data          what --data is: a folder of token files (read in place,
                       minidist/train/token_files.py), else text tokenized once into a cache
                       (minidist/train/data.py), in bytes or a BPE
    open_data_shared   the first rank on each node opens it first (for text: tokenizes and
                       writes the cache) while the node's other ranks wait without spinning
                       (ProcessGroup.wait_for_all); then they open it too (the cache is
                       there: they map it). Before, every rank tokenized the whole text
                       itself: 4 ranks paid 4x the CPU and memory of one build (first-use
                       walk 33: 15.0 s for a 30 MB text on 4 ranks, 7.0 s on one)

`check_resume_vocabulary`: the data is in the vocabulary of the model --resume holds.
`record_data` puts what a checkpoint records of the data beside the run's flags: the tokens'
digest and the tokenizer's identity (a resume on other contents at the same path says so,
minidist/train/resume.py; examples/sample.py and export_gpt2.py refuse another tokenizer).

The ranks then compare the data's digests: other contents on some node is one error line.
An error in either round (a missing file, an id past the vocabulary) is agreed on by every
rank (one all-gather of the error, or of None) and raised on every rank, so rank 0 prints it
once and no rank is left waiting.
Token files (read in place, nothing cached) are opened by every rank at once, in one round.
Tests: tests/test_data.py (test_one_rank_per_node_tokenizes_and_errors_are_agreed).
"""
from minidist.comm.checks import ranks_by_value, ranks_text
from minidist.launcher import local_rank_and_size
from minidist.strategy.checkpoint import CheckpointError, saved_model
from minidist.train.bpe import BPETokenizer, TokenizerError, tokenizer_files
from minidist.train.cli import UsageError
from minidist.train.data import ByteTokenizer, DataError, TokenData
from minidist.train.token_files import TokenFiles, token_file_names, tokenizer_in

OPEN_ERRORS = (UsageError, DataError, TokenizerError)   # what --data's opening can raise


def open_data(args):
    """--data: a folder of token files, else text, tokenized once and cached: into bytes, or
    by --tokenizer's BPE, else by --init-from's folder's where it has one (vocab.json,
    merges.txt). The token files' tokenizer (for the sample) is --tokenizer's, else meta.pkl's
    or the BPE beside them, else --init-from's."""
    names = token_file_names(args.data) if args.data else None
    given = getattr(args, "tokenizer", None)
    if not names:
        return TokenData(args.data, args.cache_dir, tokenizer_in(given or args.init_from))
    if given:
        return TokenFiles(args.data, names, BPETokenizer.from_folder(given),
                          f"--tokenizer {given}", made_them=True)
    if tokenizer_files(args.data):
        return TokenFiles(args.data, names, BPETokenizer.from_folder(args.data),
                          f"{args.data} (beside the files)")
    return TokenFiles(args.data, names, tokenizer_in(args.init_from),
                      f"--init-from {args.init_from}")


def open_data_shared(args, group, first_on_node=None):
    """open_data on every rank of `group` (the job's; None: one process), the first rank on
    each node first (module docstring). `first_on_node`: whether this rank opens first
    (default: its local rank is 0, from the launcher's environment; a launcher that sets
    none makes every rank first, which is the old way: each tokenizes)."""
    if group is None or group.size == 1:
        return open_data(args)
    if args.data and token_file_names(args.data):   # read in place: nothing to build first,
        data = _open_agreed(args, group, True)      # all at once (a review: twice the time)
    else:
        if first_on_node is None:
            first_on_node = local_rank_and_size()[0] == 0
        data = _open_agreed(args, group, first_on_node)
        later = _open_agreed(args, group, not first_on_node)
        data = data if first_on_node else later
    _check_same_contents(args, data, group)
    return data


def _check_same_contents(args, data, group):
    """Every rank read the same tokens (their digests, all-gathered): a node whose copy of
    the data differs (a stale node-local copy) would train on other text without a word
    (first-use walk 36). DataError on every rank, naming the ranks, where they differ."""
    found = ranks_by_value(group.all_gather_object(data.digest))
    if len(found) > 1:
        where = "; ".join(f"{digest} on {ranks_text(ranks)}" for digest, ranks in found.items())
        raise DataError(f"--data {args.data or '(Python sources)'}: the ranks read other "
                        f"contents (their digests: {where}): do the nodes' copies differ?")


def _open_agreed(args, group, opens):
    """open_data where `opens`, then every rank of `group` waits for the others (napping)
    and raises the first error any rank met, the same on all; the data (or None)."""
    data = error = None
    if opens:
        try:
            data = open_data(args)
        except OPEN_ERRORS as e:
            error = e
    group.wait_for_all()
    errors = group.all_gather_object(error)
    first = next((i for i, e in enumerate(errors) if e is not None), None)
    if first == group.rank:
        raise error                          # this rank's own, with its traceback
    if first is not None:
        raise errors[first]
    return data


def record_data(args, data):
    """What the run's checkpoints record of its data, beside the flags (state.json's
    "extra" is vars(args)): `data_digest` (TokenData's, TokenFiles' `.digest`) and
    `tokenizer_key` (the identity of the tokenizer its ids are in: "bytes", a BPE's hash
    of its vocabulary and merges, "chars-N-<hash of its table>"; None for token files of no
    known tokenizer)."""
    args.data_digest = data.digest
    args.tokenizer_key = data.tokenizer.key if data.tokenizer is not None else None


def check_resume_vocabulary(args, data):
    """A --resume's model reads the vocabulary --data is in: else one line naming --data and
    what each holds (first-use walk 33: a bytes checkpoint resumed on GPT-2 token files was a
    "config mismatch" about model flags nobody typed). A checkpoint the load cannot read is
    left to the load, whose verification names what is wrong."""
    if not args.resume:
        return
    try:
        folder, config, _, flags = saved_model(args.resume)
    except CheckpointError:
        return
    theirs = config.get("vocab_size")
    if theirs is None or theirs == data.vocab_size:
        return
    kind = data.tokenizer.name if data.tokenizer is not None else data.format
    hint = ("text, read as bytes" if theirs == ByteTokenizer.vocab_size else
            "its token files, or its text with its --tokenizer")
    recorded = flags.get("data")
    raise UsageError(f"--data {args.data or '(Python sources)'}: in a {data.vocab_size:,}-token "
                     f"vocabulary ({kind}); --resume {folder} holds a model of "
                     f"{theirs:,} tokens: give the data it was trained on ({hint}"
                     + (f": --data {recorded}" if recorded else "") + ")")
