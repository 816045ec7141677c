"""The tokenizer a saved model reads, found from its checkpoint or folder, and a --tokenizer
given for it checked against it (examples/sample.py, examples/export_gpt2.py).

    tokenizer_folders   where the model's tokenizer may be, in order: the folder itself (a
                        GPT-2 download holds its vocab.json and merges.txt), then the folders
                        its run named (--tokenizer, --init-from, --data: gather.run_flags)
    own_tokenizer       the first tokenizer found there (GPT-2's files, or nanoGPT's
                        meta.pkl: token_files.tokenizer_in)
    not_its_tokenizer   why a tokenizer given is not the one the model was trained in: the
                        checkpoint's `tokenizer_key` (runs record it: data_open.record_data),
                        else the one own_tokenizer finds. First-use walk 33: sample.py
                        compared the sizes only, so another BPE of the same size printed
                        garbage, and export_gpt2.py wrote it beside the model
Tests: tests/test_init_from.py (test_another_tokenizer_of_the_same_size_is_refused).
"""
from minidist.train.gather import run_flags
from minidist.train.token_files import tokenizer_in


def tokenizer_folders(path):
    """The folders where the tokenizer of the model at `path` (a checkpoint, a --save
    directory, a GPT-2 folder) may be, in the order they are looked in."""
    flags = run_flags(path)
    return [f for f in (path, flags.get("tokenizer"), flags.get("init_from"),
                        flags.get("data")) if f]


def own_tokenizer(path):
    """(tokenizer, the folder it is in) of the model at `path`, or (None, the folders looked
    in) when none holds one."""
    folders = tokenizer_folders(path)
    for folder in folders:
        tokenizer = tokenizer_in(folder)
        if tokenizer is not None:
            return tokenizer, folder
    return None, folders


def not_its_tokenizer(path, tokenizer):
    """Words saying why `tokenizer` (given for the model at `path`) is not the one it was
    trained in (other vocabulary or merges, though perhaps of the same size: its ids would
    mean other strings), or None: it is, or nothing tells (a run on GPT-2 token files
    without a tokenizer: the one given is taken)."""
    recorded = run_flags(path).get("tokenizer_key")
    if recorded:
        return None if recorded == tokenizer.key else \
            "the model was trained in another tokenizer (its checkpoint records which)"
    own, where = own_tokenizer(path)
    if own is None or own.key == tokenizer.key:
        return None
    return f"the model was trained in the tokenizer of {where}, which is another"
