"""The text files of --data, and how they split into train and val (minidist/train/data.py
tokenizes and caches what these give it).

    list_files     which files: a file, or a folder read recursively in name order, linked
                   folders too, each once (hidden entries skipped; binary files, UTF-16/32
                   files, broken links and pipes, and the folders that hold a checkpoint or a
                   tokenizer left out and named);
                   no --data: the `.py` sources of this Python's standard library
    split_files    each file's train part and val part, as documents (a file's part each):
                   with 20 or more files, whole files go to val when crc32(relative path)
                   % 10 == 0 (held-out documents), unless that holds no file or more than
                   30% of the text (one big file among small ones, or names that all hash to
                   train: first-use walk 33 trained on 114 tokens and evaluated on 417,540);
                   then, and with fewer files, the last 10% of each file goes to val, cut at
                   a line's start (else a UTF-8 character's)
    text_splits    the two splits' bytes, joined (examples/train_tokenizer.py learns from the
                   train one)
Tests: tests/test_data.py.
"""
import os
import sysconfig
import zlib

HELD_OUT_AT_MOST = 0.3        # of the text, in held-out files; beyond: each file's last 10%
UTF16_32_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


class DataError(ValueError):
    """Bad or missing training data; the message says what and where."""


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def is_text(path, probe=8192):
    """Whether the file looks like text: no NUL byte in its first `probe` bytes (git's and
    grep's test; a safetensors file, a .bin of tokens, an image have them early)."""
    return not_text(path, probe) is None


def not_text(path, probe=8192):
    """Why the file is not UTF-8 text (NUL bytes in its first `probe`: "binary"; a UTF-16 or
    UTF-32 byte-order mark, what Windows Notepad and PowerShell write: "UTF-16/32 text:
    re-encode it as UTF-8"), or None."""
    with open(path, "rb") as f:
        head = f.read(probe)
    if head.startswith(UTF16_32_BOMS):
        return "UTF-16/32 text: re-encode it as UTF-8 (iconv -f UTF-16 -t UTF-8)"
    return "binary" if b"\0" in head else None


def holds_outputs(folder, names):
    """What a folder inside --data holds that is no corpus (first-use walk 33: its text
    files were trained on): a minidist checkpoint (state.json and manifest.json, or a
    `latest` pointer) or a tokenizer (vocab.json and merges.txt); None for text."""
    names = set(names)
    if {"state.json", "manifest.json"} <= names or "latest" in names:
        return "a checkpoint"
    if {"vocab.json", "merges.txt"} <= names:
        return "a tokenizer"
    return None


def list_files(path=None):
    """(root, sorted relative paths of the text files to train on, [(relative path, why
    left out)]). A file given that is not text (not_text) is refused; in a folder, such
    files are left out (as grep -I does), and so are broken links, special files, and the
    folders that hold a checkpoint or a tokenizer (holds_outputs); a folder with no text
    left is refused, naming how many were left out. The data line names what was."""
    if path is None:
        root, skip, suffix = stdlib_root(), {"site-packages", "dist-packages"}, ".py"
    else:
        if not os.path.exists(path):
            raise DataError(f"--data {path}: no such file or directory (give a text file or "
                            "a folder of text files, or leave --data out for Python's "
                            "sources)")
        if os.path.isfile(path):
            why = not_text(path)
            if why == "binary":
                raise DataError(f"--data {path}: not a text file (it holds NUL bytes); give "
                                "a text file, a folder of them, or a folder of token files "
                                "(*.bin, as nanoGPT and llm.c write them)")
            if why:
                raise DataError(f"--data {path}: {why}")
            return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)], []
        root, skip, suffix = path, set(), ""
    files, skipped = [], []
    seen = {os.path.realpath(root)}             # folders read: a linked one is read once
    for d, dirs, names in os.walk(root, followlinks=path is not None):
        dirs[:] = sorted((x for x in dirs if not x.startswith(".") and x not in skip
                          and x != "__pycache__"),           # real folders before links to
                         key=lambda x: (os.path.islink(os.path.join(d, x)), x))   # them
        for x in list(dirs):                    # (walk 33, 36: a linked folder was skipped
            real = os.path.realpath(os.path.join(d, x))      # without a word; a loop of
            if real in seen:                                 # links must end)
                skipped.append((os.path.relpath(os.path.join(d, x), root),
                                "a link to a folder read already"))
                dirs.remove(x)
            seen.add(real)
        outputs = holds_outputs(d, names) if path is not None and d != root else None
        if outputs:
            skipped.append((os.path.relpath(d, root), outputs))
            dirs[:] = []
            continue
        for n in sorted(names):
            if n.startswith(".") or not n.endswith(suffix):
                continue
            name = os.path.relpath(os.path.join(d, n), root)
            if not os.path.isfile(os.path.join(d, n)):   # a dangling link, a pipe: a
                skipped.append((name, "a broken link or special file"))   # traceback, a
                continue                                                  # hang (walk 33)
            why = not_text(os.path.join(d, n)) if path is not None else None
            if why:
                skipped.append((name, why.split(":")[0]))
                continue
            files.append(name)
    if not files:
        arrays = [n for n, _ in skipped if n.endswith((".npy", ".npz"))]
        raise DataError(f"--data {path or root}: no text files found"
                        + (f" (left out: {left_out_text(skipped)})" if skipped else "")
                        + (f"; {', '.join(arrays[:2])}: numpy files are not read: write the "
                           "token ids as bare uint16 train.bin and val.bin "
                           "(np.load(f).astype(np.uint16).tofile('train.bin'))"
                           if arrays else ""))
    return root, sorted(files), skipped


def left_out_text(skipped, most=3):
    """"a.bin (binary); ck (a checkpoint); 2 more": what list_files left out, for people."""
    shown = "; ".join(f"{name} ({why})" for name, why in skipped[:most])
    return shown + (f"; {len(skipped) - most} more" if len(skipped) > most else "")


def text_splits(path=None):
    """(train bytes, val bytes, [(file, why left out)]) of --data `path` (a text file or
    folder; None: Python's sources), split as training splits them
    (examples/train_tokenizer.py learns from the train part)."""
    root, files, left_out = list_files(path)
    train, val, _ = split_files(root, files)
    return b"".join(train), b"".join(val), left_out


def split_files(root, files):
    """(train documents, val documents, the rule as words): each a list of bytes, one per
    file that has a part in that split (a newline ended where it lacks one; empty parts
    left out), in file order. Held-out files (20 or more files, and the held-out ones
    0 < val <= HELD_OUT_AT_MOST of the text), else each file's last 10%."""
    texts = {}
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            data = fh.read()
        texts[f] = data + b"\n" if data and not data.endswith(b"\n") else data
    if len(files) >= 20:
        held = [f for f in files if zlib.crc32(os.fsencode(f)) % 10 == 0]
        val = sum(len(texts[f]) for f in held)
        total = sum(len(t) for t in texts.values())
        if 0 < val <= HELD_OUT_AT_MOST * total:
            return ([texts[f] for f in files if f not in held and texts[f]],
                    [texts[f] for f in held if texts[f]],
                    f"{len(held)} of {len(files)} files held out")
        why = ("no file's name chose val" if not held else
               f"the files held out by name were {val / total:.0%} of the text")
        rule = f"the last 10% of each file ({why})"
    else:
        rule = "the last 10% of each file"
    cuts = {f: cut_point(t) for f, t in texts.items()}
    train = [t[:cuts[f]] for f, t in texts.items()]
    val = [t[cuts[f]:] for f, t in texts.items()]
    return [t for t in train if t], [t for t in val if t], rule


def cut_point(data, share=0.9, window=4096):
    """Where a file's train part ends: at `share` of its bytes, moved back to the start of
    a line within `window` bytes and 5% of the file, so the train part ends a line (under a BPE the
    <|endoftext|> after it then follows a line's end, not half a word: a review of
    data.py's documents); without a newline there, the start of the UTF-8 character the
    cut falls in."""
    cut = int(len(data) * share)
    window = min(window, len(data) // 20)     # at most 5% of the file: a long last paragraph
    line = data.rfind(b"\n", max(cut - window, 0), cut)   # moves no cut to its title
    return line + 1 if line >= 0 else utf8_boundary(data, cut)


def utf8_boundary(data, cut):
    """`cut` moved back to the start of the UTF-8 character it falls in (a continuation
    byte is 10xxxxxx): a byte cut inside one gave both splits a U+FFFD under a BPE (walk 33)."""
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def not_utf8(blob):
    """How many characters invalid UTF-8 in `blob` turns into U+FFFD under a BPE (Latin-1
    text's accents: first-use walk 33 found them mangled without a word), 0 for UTF-8."""
    try:
        blob.decode("utf-8")
        return 0
    except UnicodeDecodeError:
        return blob.decode("utf-8", "replace").count("\ufffd") - blob.count(
            "\ufffd".encode())
