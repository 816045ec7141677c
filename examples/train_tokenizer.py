"""Train a byte-level BPE tokenizer (GPT-2's kind) on text, for train_gpt.py --tokenizer.

    python examples/train_tokenizer.py --data input.txt --vocab-size 4096 --out tok
    python examples/train_gpt.py --data input.txt --tokenizer tok --steps 400 --save ck
    python examples/sample.py --resume ck --prompt "ROMEO:"

It learns from the train part of --data, split as train_gpt.py splits it (a folder of 20 or
more files: whole files held out; else each file's last 10%), so the val loss is measured on
text the tokenizer never saw; it prints the bytes per token on both parts (the compression).
The algorithm: minidist/train/bpe_train.py: GPT-2's pre-tokenization, then the most
frequent adjacent pair merged, merge after merge; `<|endoftext|>` is the last token. The
folder it writes holds vocab.json and merges.txt in GPT-2's format.
Tests: tests/test_bpe_train.py (test_a_trained_tokenizer_trains_samples_and_exports).
"""
import sys
import time

from minidist.train.args import a_path, example_parser
from minidist.train.bpe import BPETokenizer, TokenizerError, tokenizer_files
from minidist.train.bpe_train import train_bpe, write_tokenizer
from minidist.train.cli import UsageError, check_one_process, check_out_folder, run_main
from minidist.train.data import DataError
from minidist.train.data_files import left_out_text, not_utf8, text_splits


def tokenizer_parser():
    p = example_parser(__doc__)
    p.add_argument("--data", type=a_path, default=None, metavar="PATH",
                   help="a text file or a folder of text files (default: Python's sources, "
                   "as train_gpt.py)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="tokens, the 256 bytes and <|endoftext|> included (GPT-2: 50257)")
    p.add_argument("--out", type=a_path, required=True, metavar="DIR",
                   help="a new or empty folder to write vocab.json and merges.txt in (made "
                   "if missing; a tokenizer's folder is never replaced)")
    p.add_argument("--traceback", action="store_true",
                   help="on a user error, show the traceback (also MINIDIST_DEBUG=1)")
    return p


def check_out(out):
    """--out is a new or empty folder: not a tokenizer already (checkpoints trained with one
    record its folder: new files there would give their ids other meanings), nor a file, a
    --save directory or a folder of other files (cli.check_out_folder)."""
    if tokenizer_files(out):
        raise UsageError(f"--out {out}: holds a tokenizer already, which runs may have been "
                         "trained with (their checkpoints name its folder); give a new folder")
    check_out_folder("--out", out)


def main(args):
    check_one_process("train_tokenizer.py")
    if args.vocab_size < 257 or args.vocab_size > 1 << 32:
        raise UsageError(f"--vocab-size {args.vocab_size}: from 257 (the 256 bytes and "
                         "<|endoftext|>) to 2^32")
    # the text first: a bad --data or an empty train part leaves no --out folder behind
    train_bytes, val_bytes, left_out = text_splits(args.data)
    replaced = not_utf8(train_bytes) + not_utf8(val_bytes)
    train, val = (blob.decode("utf-8", "replace") for blob in (train_bytes, val_bytes))
    if not train:
        raise DataError(f"{args.data or 'the standard library'}: the train part is empty "
                        "(no text to learn merges from); give a file or folder with text")
    check_out(args.out)
    start = time.perf_counter()
    vocab, merges = train_bpe(train, args.vocab_size)
    seconds = time.perf_counter() - start
    try:
        write_tokenizer(args.out, vocab, merges)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot write there ({e.strerror or e}); choose a "
                         "folder you can write to") from None
    tokenizer = BPETokenizer.from_folder(args.out)           # read back as a user's would be
    per_token = {name: len(text.encode("utf-8")) / max(1, len(tokenizer.encode(text)))
                 for name, text in (("train", train), ("val", val))}
    short = (f" (no pair occurs twice past {len(merges):,} merges)"
             if len(vocab) < args.vocab_size else "")
    print(f"wrote {args.out}: {len(vocab):,} tokens{short}, {len(merges):,} merges, learnt "
          f"from {len(train.encode('utf-8')):,} bytes in {seconds:.1f} s; "
          f"{per_token['train']:.2f} bytes per token on the train text, "
          f"{per_token['val']:.2f} on val", file=sys.stdout)
    if left_out:                        # (first-use walk 36: as train_gpt.py's data line)
        print(f"note: left out of --data: {left_out_text(left_out)}")
    if replaced:
        print(f"note: {replaced:,} character(s) of the text were not UTF-8 and were learnt as "
              "U+FFFD (Latin-1 accents?): re-encode the text as UTF-8 and train again")
    return tokenizer


if __name__ == "__main__":
    run_main(main, parser=tokenizer_parser, user_errors=(DataError, TokenizerError))
