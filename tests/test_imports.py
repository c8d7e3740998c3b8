"""The shape of the package: its import graph has no cycle (imports under ``TYPE_CHECKING`` count too), no
module imports another module's private names, and ``rlmem report`` does not load the training loop."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlmem

ROOT = Path(rlmem.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Each module's rlmem imports (every ``import`` statement in the file, wherever it stands), and the
    (importer, module, name) of each private name imported from another module."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("rlmem"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:
                        edges[m].add(sub)
                        continue
                    edges[m].add(target)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append((m, target, a.name))
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    edges, _ = _imports(_modules())
    assert _cycles(edges) == []


def test_a_package_imported_by_its_own_modules_would_count_as_a_cycle():
    # The checker itself: a circle closed through a TYPE_CHECKING import is found.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names():
    _, private = _imports(_modules())
    assert private == []


# Private modules imported from outside their package, each with its reason; any other is a failure.
PRIVATE_MODULE_USES = {
    # the CUDA driver binding is memory's; the copy engine of activations and the benchmarks that time raw
    # driver calls need its calls themselves, not a Region
    ("rlmem.activations._transfer", "rlmem.memory._cuda"): "the copy engine's driver calls",
    ("rlmem.benchmarks._common", "rlmem.memory._cuda"): "the GPU's name from the driver, no CUDA context",
    ("rlmem.benchmarks.vmm_calls", "rlmem.memory._cuda"): "it times the driver's VMM calls themselves",
    ("rlmem.benchmarks.numa", "rlmem.memory._numa"): "it measures the placement itself",
    ("rlmem.benchmarks.rollout", "rlmem.rollout._gqa"): "it times the grouped decode kernel",
    # Megatron adoption lives in train/; the Megatron glue reads it
    ("rlmem.integrations.megatron", "rlmem.train._megatron"): "Megatron's storages as TrainState adopts them",
}


def _private_module_uses(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, module) for every private module imported from outside the package that owns it."""
    edges, _ = _imports(mods)
    out = set()
    for m, targets in edges.items():
        for t in targets:
            owner, _, last = t.rpartition(".")
            private = last.startswith("_") and not last.startswith("__")
            if private and t in mods and not (m == owner or m.startswith(owner + ".")):
                out.add((m, t))
    return out


def test_private_modules_are_imported_only_inside_their_package_or_as_listed():
    uses = _private_module_uses(_modules())
    assert uses - set(PRIVATE_MODULE_USES) == set()
    assert set(PRIVATE_MODULE_USES) - uses == set()  # an exception no longer needed is removed


def test_rlmem_report_does_not_import_the_training_loop(tmp_path):
    code = (
        "import sys\n"
        "from rlmem.cli import main\n"
        f"main(['report', {str(tmp_path)!r}])\n"
        "loaded = [m for m in ('rlmem.recipes.grpo', 'rlmem.recipes.policy', 'rlmem.rollout.sampler') "
        "if m in sys.modules]\n"
        "print('LOADED', loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr
    assert "has no timeline.jsonl" in out.stderr


def test_names_published_before_the_rollout_package_still_resolve():
    import rlmem.colocate
    import rlmem.integrations.hf
    import rlmem.rollout
    import rlmem.train

    assert rlmem.integrations.hf.HFSampler is rlmem.rollout.HFSampler is rlmem.HFSampler
    assert rlmem.RemoteEngine is rlmem.colocate.RemoteEngine is rlmem.rollout.RemoteEngine
    assert rlmem.colocate.PeerEngine is rlmem.rollout.PeerEngine
    assert rlmem.colocate.serve_engine is rlmem.rollout.serve_engine
    assert rlmem.colocate.FLAVORS is rlmem.rollout.FLAVORS
    assert rlmem.train.Engine is rlmem.Engine is rlmem.rollout.Engine
    for name in rlmem.colocate.__all__ + rlmem.rollout.__all__:
        getattr(rlmem.colocate if name in rlmem.colocate.__all__ else rlmem.rollout, name)


# Names that moved to rlmem.models (models load in one place), by old module: their new module and names.
MOVED_TO_MODELS = {
    "rlmem.plan.presets": ("rlmem.models.presets", ("LLAMA", "PRESETS", "QWEN2", "build", "vocab_size")),
    "rlmem.recipes.gguf": ("rlmem.models.gguf", ("INSTALL", "find", "load_model", "load_tokenizer")),
    "rlmem.recipes.user_data": (
        "rlmem.models.tokenizer",
        ("CHAT_TEMPLATES", "TextTokenizer", "load_tokenizer"),
    ),
    "rlmem.recipes.task": ("rlmem.models.tiny", ("CharTokenizer",)),
    "rlmem.recipes.config": ("rlmem.models.tiny", ("TINY",)),
}


@pytest.mark.parametrize("old", list(MOVED_TO_MODELS))
def test_names_moved_to_models_resolve_from_their_old_place_with_a_warning_naming_the_new(old):
    new, names = MOVED_TO_MODELS[old]
    for name in names:
        said = rf"{re.escape(old)}\.{name} has moved to {re.escape(new)}\.{name}"
        with pytest.warns(DeprecationWarning, match=said):
            got = getattr(importlib.import_module(old), name)
        assert got is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = importlib.import_module(old).no_such_name


def test_a_moved_name_imported_the_old_way_warns_at_the_importing_line():
    with pytest.warns(DeprecationWarning, match="rlmem.models.presets.QWEN2") as said:
        from rlmem.plan.presets import QWEN2
    assert QWEN2 is rlmem.models.presets.QWEN2
    assert [w.filename for w in said] == [__file__]


# The floors of docs/design.md, lowest first: a package imports only packages of lower floors (and the base
# modules, rlmem/_*.py and errors.py); a package on a floor of its own set beside others imports none of them.
FLOORS = [
    {"memory"},
    {"comm", "monitor", "data"},
    {"colocate"},
    {"activations"},
    {"models"},
    {"plan"},
    {"rollout"},
    {"train"},
    {"integrations"},
    {"serve"},
    {"recipes"},
    {"benchmarks"},
    {"cli"},
    {"__main__"},
]


def test_every_package_imports_only_the_floors_below_it():
    edges, _ = _imports(_modules())
    floor = {p: i for i, ps in enumerate(FLOORS) for p in ps}
    packages = {m.split(".")[1] for m in edges if m.count(".") >= 1}
    base = {p for p in packages if p.startswith("_") and p != "__main__"} | {"errors"}
    assert packages - base - set(floor) == set(), "a package without a floor"
    up = sorted(
        (a, b)
        for a, bs in edges.items()
        for b in bs
        if a.count(".") >= 1 and b.count(".") >= 1
        for pa, pb in [(a.split(".")[1], b.split(".")[1])]
        if pa != pb and pb not in base and pa not in base and floor[pb] >= floor[pa]
    )
    assert up == []
