"""The tree is the architecture: every import of batchgen goes down the layers, none climbs
back up, and no modules import each other in a circle. Read from the source with `ast`, lazy
imports inside functions and type-checking imports included.

Layers, bottom up (a package may import its own modules and any lower layer):
    errors, choices    what fails and what an option may be; import nothing of batchgen
    data               reading inputs, writing outputs
    model              the decoder, its checkpoint loader, the paged KV cache, memory checks;
                       inside it, bottom up: config and the checks, attention/, families/,
                       parallel/, checkpoint/, hf/ (MODEL_LAYERS)
    quant              weight-only quantization, a pass over a built model
    engine             scheduler + block pool (plain Python) and the model runner
    stats              the sum of the engine's step reports, GPU sampling
    job                one job's options, model spec, input and prepared rows
    api                the Python API's parts: engine arguments, SamplingParams, prompts, outputs
    llm                the Python API: a model loaded and an engine over it
    runner             running one job: request stream -> engine -> writer
    scaleout           shards over worker processes or a Slurm array, and their merge
    report             `batchgen report`: an output directory's metrics as one HTML page
    cli                the command line
    batchgen/__init__, __main__
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "batchgen"
LAYERS = [
    ("errors", "choices"),
    ("data",),
    ("model",),
    ("quant",),
    ("engine",),
    ("stats",),
    ("job",),
    ("parallel",),
    ("api",),
    ("llm",),
    ("runner",),
    ("scaleout",),
    ("report",),
    ("cli",),
    ("__init__", "__main__"),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

# Inside model/: its flat modules (the architecture description and the checks everyone uses)
# at the bottom, then each folder; a folder imports only the flat modules and folders before
# it. A flat module not named here (not yet placed in a folder) is not checked.
MODEL_LAYERS = [
    ("config", "memory", "quiet_import", "host_malloc"),
    ("attention",),
    ("families",),
    ("parallel",),
    ("checkpoint",),
    ("hf",),
]
MODEL_LAYER = {name: i for i, names in enumerate(MODEL_LAYERS) for name in names}
MAX_LINES = 300
MAX_TOP_LEVEL_MODULES = 6


def _modules() -> dict[str, Path]:
    """batchgen's modules by dotted name."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The batchgen modules a file imports (a `from pkg import name` of a submodule counts as
    that submodule), wherever in the file the import is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("batchgen")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("batchgen"):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


GRAPH = {name: _imports(path) & set(MODULES) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    """The layer unit of a module: its top-level package or flat module under batchgen."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer():
    units = {_unit(m) for m in MODULES} | {"__main__"}
    assert units <= set(LAYER), f"add {sorted(units - set(LAYER))} to LAYERS (and docs)"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    here = _unit(module)
    climbing = [
        m
        for m in GRAPH[module]
        if _unit(m) != here and LAYER[_unit(m)] >= LAYER[here] and m != "batchgen"
    ]
    assert not climbing, f"{module} ({here}) imports {climbing}, which are not below it"


def _model_unit(module: str) -> str | None:
    """A model module's folder (or flat module) in MODEL_LAYERS; None outside model/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "model" else None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _model_unit(m) in MODEL_LAYER))
def test_model_folders_go_down(module):
    here = _model_unit(module)
    climbing = [
        m
        for m in GRAPH[module]
        if _model_unit(m) in MODEL_LAYER
        and _model_unit(m) != here
        and MODEL_LAYER[_model_unit(m)] >= MODEL_LAYER[here]
    ]
    assert not climbing, f"{module} ({here}) imports {climbing}, which are not below it in model/"


def test_no_import_circles():
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        path.append(m)
        for n in sorted(GRAPH[m]):
            if seen.get(n) == 1:
                circle = path[path.index(n) :] + [n]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if n not in seen:
                visit(n)
        path.pop()
        seen[m] = 2

    for m in sorted(GRAPH):
        if m not in seen:
            visit(m)


def test_the_bottom_imports_nothing_of_batchgen():
    for name in ("batchgen.errors", "batchgen.choices"):
        assert not GRAPH[name], (name, GRAPH[name])


def test_few_flat_modules_and_none_too_long():
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(flat) <= MAX_TOP_LEVEL_MODULES, flat
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert not {n: k for n, k in long.items() if k > MAX_LINES}


def test_formatting_is_not_dodged():
    """ruff format applies everywhere: no `fmt: skip` / `fmt: off` markers."""
    dodges = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("batchgen", "tests", "scripts")
        for p in (ROOT / d).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "# fmt: " + "skip" in line or "# fmt: " + "off" in line
    ]
    assert not dodges


def test_tests_import_nothing_from_scripts():
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    for path in Path(__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module.split(".")[0]]
            assert not set(names) & scripts, (path.name, names)
