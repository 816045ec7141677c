"""The layers of README.md's "Layers" table: each imports only the ones above it; and
every strategy class is built by the one composition, make_strategy.

Read from the source with `ast` (nothing is imported): every `import minidist.x...` and
`from minidist[.x] import ...` in minidist/, at any depth (a function-level import counts), is
an edge from the importing file's layer to the imported one. A layer may import the rows above
it and, within its own row, a peer (tp uses zero's sharded checkpoints, pp tp's state
functions), but peers never in a cycle.
Run: python -m pytest -q tests/test_layers.py
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minidist"

# top to bottom, as README.md's table; one row may hold several packages (peers)
LAYERS = [("launcher", "gemm", "backend", "kernel_count"), ("autograd",), ("nn",), ("optim",),
          ("comm",), ("strategy",), ("ddp", "zero", "tp", "pp", "cp", "ep"), ("train",)]
ROW = {name: i for i, row in enumerate(LAYERS) for name in row}


def _layer(path):
    """minidist/tp/model.py -> "tp"; minidist/backend.py -> "backend"; __init__ -> None."""
    part = path.relative_to(PACKAGE).parts[0]
    name = part[:-3] if part.endswith(".py") else part
    return None if name == "__init__" else name


def _imported(node):
    """The minidist layers one import statement names."""
    if isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        mods = [node.module]
        if node.module == "minidist":                      # from minidist import backend
            mods = [f"minidist.{a.name}" for a in node.names]
    else:
        return []
    return [m.split(".")[1] for m in mods if m.startswith("minidist.")]


def import_edges():
    """{(importer layer, imported layer): first file:line} over every file of minidist/."""
    edges = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _layer(path)
        for node in ast.walk(ast.parse(path.read_text())):
            for dst in _imported(node):
                if src is not None and dst != src:
                    edges.setdefault((src, dst), f"{path.relative_to(ROOT)}:{node.lineno}")
    return edges


def test_every_package_has_a_row():
    layers = {_layer(p) for p in PACKAGE.rglob("*.py")} - {None}
    assert layers <= set(ROW), f"not in LAYERS (add a row, and one to README.md): " \
                               f"{sorted(layers - set(ROW))}"


def test_each_layer_imports_only_the_ones_above_it():
    upward = [f"{where}: {src} imports {dst}" for (src, dst), where in import_edges().items()
              if ROW[dst] > ROW[src]]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_peers_in_a_row_import_each_other_without_a_cycle():
    edges = {(s, d) for s, d in import_edges() if ROW[s] == ROW[d]}
    graph = {}
    for s, d in edges:
        graph.setdefault(s, set()).add(d)

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,)))
                   for n in graph.get(a, ()))
    cycles = sorted(f"{s} <-> {d}" for s, d in edges if reaches(d, s))
    assert not cycles, f"peers importing each other in a cycle: {cycles}"


def test_the_readme_table_lists_the_rows_in_this_order():
    """README.md's map of the code names every row, top to bottom, in LAYERS' order."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("Each layer imports only the ones above it"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    firsts = [line.split()[0].removeprefix("minidist/").strip("/").removesuffix(".py")
              for line in block.strip().splitlines() if line.strip() and line[0] != " "]
    order = [f for f in firsts if f in ROW]
    assert [ROW[f] for f in order] == sorted(ROW[f] for f in order), order
    assert {ROW[f] for f in order} == set(range(len(LAYERS))), (order, LAYERS)


def _strategy_classes():
    """{class name: file} of every class in minidist/ that derives, at any depth, from the
    Strategy base (minidist/strategy/base.py's SingleProcess), read from the source."""
    bases = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases]
                bases[node.name] = (names, str(path.relative_to(ROOT)))
    found, grew = {"SingleProcess": bases["SingleProcess"][1]}, True
    while grew:
        grew = False
        for name, (parents, where) in bases.items():
            if name not in found and any(p in found for p in parents):
                found[name], grew = where, True
    return found


def test_every_strategy_is_made_by_the_one_composition():
    """Every Strategy class is built by minidist/train/strategy.py's make_strategy (or its
    make_data_parallel), so every layout runs the one train_step the exactness scripts run
    (tests/scripts/exact.py): a strategy added without its place in the composition fails
    here. ModelParallel is the base the model-parallel ones share, built by none."""
    tree = ast.parse((PACKAGE / "train" / "strategy.py").read_text())
    made = {node.func.id for fn in tree.body if isinstance(fn, ast.FunctionDef)
            and fn.name in ("make_strategy", "make_data_parallel")
            for node in ast.walk(fn) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)}
    classes = _strategy_classes()
    assert {"DataParallel", "ZeroDataParallel", "TensorParallel", "PipelineParallel",
            "ContextParallel", "ExpertParallel"} <= set(classes)
    missing = {n: f for n, f in classes.items() if n not in made and n != "ModelParallel"}
    assert not missing, f"strategies make_strategy never builds: {missing}"
