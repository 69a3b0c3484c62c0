"""The code's names in prose stay true: every batchgen file path (`model/attention/op.py`,
`batchgen/engine/engine.py`) and dotted module name (`batchgen.model.checkpoint.loader`) that the
docs, the README, the scripts or batchgen's own comments name exists, and no one names a module
or class by a name it had before it moved (issue 38: model/ into folders, `Sequence` ->
`SeqState`). Read as text; docs/benchmarks.md and CHANGELOG.md are left out: they record what the
code was when they were written."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "batchgen"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())

# A path inside batchgen, with or without its `batchgen/` prefix: `model/attention/op.py`.
PATH = re.compile(r"(?<![\w/.-])((?:batchgen/)?(?:" + "|".join(SUBPACKAGES) + r")/[\w/]*\w\.py)\b")
# A path of the repository's tests and scripts.
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|scripts)/\w+\.(?:py|sh))\b")
# A dotted name under batchgen (not a file name such as `slurm/batchgen.sbatch`).
DOTTED = re.compile(r"(?<![\w./\"'-])(batchgen(?:\.[A-Za-z_]\w*)+)")
# Names modules and classes had before they moved; none should be named so now.
RETIRED = re.compile(
    r"(?<![\w.])(?:attention_op|tp_layers|moe_checkpoint|checkpoint_names|checkpoint_notes"
    r"|hf_backend|hf_lora|hf_refusal|hf_support)\b(?!\.py)"  # tests/test_hf_backend.py is a test's
    r"|(?<![\w.])tensor_parallel\.\w"  # the module, not the option tensor_parallel_size
    r"|\bsequence\.Sequence\b|\bSequence\.[a-z_]+"  # the engine's class, not collections.abc's
)
# A bare file name in batchgen's comments is one beside it, or one of these, not batchgen's.
BARE = re.compile(r"(?<![\w/.-])(\w+)\.py\b")
NOT_OURS = {"tp", "modeling_gemma2", "modeling_gemma3", "flex_decode", "bench_paged_decode"}
# Files other engineers own (issue 38), each with the stale names its owner is to fix; the test
# fails when one is fixed, so that the entry goes too.
KNOWN = {
    "batchgen/engine/pooling.py": ["Sequence.pooled", "Sequence.hittable_blocks"],
}


def _texts() -> list[Path]:
    docs = [p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"]
    scripts = [p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".py", ".sh")]
    return [ROOT / "README.md", *docs, *scripts, *PACKAGE.rglob("*.py")]


def _names(path: Path) -> set[str]:
    """The names a module defines or imports at its top level (its attributes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _dotted_error(name: str) -> str | None:
    """Why batchgen.a.b.c names nothing: its longest module prefix must exist and the next part
    be a submodule or a top-level name of it."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        module = base.with_suffix(".py")
        module = module if module.exists() else base / "__init__.py"
        if module.exists():
            rest = parts[k:]
            if rest and rest[0] not in _names(module):
                return f"{'.'.join(parts[:k])} has no {rest[0]}"
            return None
    return "no such module"


def _stale(path: Path) -> list[str]:
    found = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        for m in PATH.finditer(line):
            p = m.group(1)
            if not (ROOT / p).exists() and not (PACKAGE / p).exists():
                found.append(f"{i}: {p} does not exist")
        for m in REPO_PATH.finditer(line):
            if not (ROOT / m.group(1)).exists():
                found.append(f"{i}: {m.group(1)} does not exist")
        for m in DOTTED.finditer(line):
            if (why := _dotted_error(m.group(1))) is not None:
                found.append(f"{i}: {m.group(1)}: {why}")
        found += [f"{i}: {m.group(0)} is a retired name" for m in RETIRED.finditer(line)]
        if path.is_relative_to(PACKAGE):
            found += [
                f"{i}: {m.group(0)} is not beside it"
                for m in BARE.finditer(line)
                if m.group(1) not in NOT_OURS and not (path.parent / m.group(0)).exists()
            ]
    return found


def test_every_path_and_module_named_in_prose_exists():
    stale = {}
    for path in _texts():
        rel = str(path.relative_to(ROOT))
        found = [f for f in _stale(path) if not any(k in f for k in KNOWN.get(rel, []))]
        if found:
            stale[rel] = found
    assert not stale


def test_the_known_stale_names_are_still_there():
    """Each KNOWN entry names what its file still says; fixed, the entry goes."""
    for rel, names in KNOWN.items():
        text = (ROOT / rel).read_text()
        assert all(n in text for n in names), (rel, names)


def test_the_check_catches_the_names_before_the_move(tmp_path):
    old = tmp_path / "old.md"
    old.write_text(
        "model/attention.py, batchgen/model/loader.py, model/attention_op.py,\n"
        "batchgen.model.transformer, batchgen.engine.sequence.Sequence, `tp_layers`,\n"
        "tensor_parallel.local_config, sequence.Sequence, tests/test_no_such_file.py\n"
    )
    assert len(_stale(old)) == 10, _stale(old)
    new = tmp_path / "new.md"
    new.write_text(
        "model/attention/step.py, batchgen/model/checkpoint/loader.py, model/attention/op.py,\n"
        "batchgen.model.families.transformer, batchgen.engine.sequence.SeqState,\n"
        "parallel.sharding.local_config, tests/test_layout.py, --tensor-parallel-size\n"
    )
    assert _stale(new) == []
