"""The shape of the package: its import graph has no cycle (imports under ``TYPE_CHECKING`` count too, and
so do the names a module re-exports through importlib, ``lazy_names`` and ``moved_names``), no module
imports another module's private names, every package imports only the floors below it, the scripts import
only what exists, and ``rlmem report`` does not load the training loop."""

from __future__ import annotations

import ast
import importlib
import importlib.util
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


def _table(node: ast.expr, assigned: dict[str, ast.expr]) -> dict[str, str]:
    """A re-export table as written: a dict literal (``**`` merges included),
    ``dict.fromkeys(names, module)``,
    or the name of a module-level assignment of one."""
    if isinstance(node, ast.Name) and node.id in assigned:
        return _table(assigned[node.id], assigned)
    if isinstance(node, ast.Dict):
        out: dict[str, str] = {}
        for k, v in zip(node.keys, node.values, strict=True):
            out.update(_table(v, assigned) if k is None else {ast.literal_eval(k): ast.literal_eval(v)})
        return out
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "dict.fromkeys":
        return dict.fromkeys(ast.literal_eval(node.args[0]), ast.literal_eval(node.args[1]))
    raise AssertionError(f"a re-export table the check cannot read: {ast.unparse(node)}")


def _reexports(tree: ast.Module, package: str) -> list[str]:
    """The modules a module's ``lazy_names(...)`` / ``moved_names(...)`` tables point at: imports made through
    importlib, which no ``import`` statement shows (relative ones resolved against ``package``)."""
    assigned = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("lazy_names", "moved_names"):
            table = _table(node.args[1], assigned)
            out += [importlib.util.resolve_name(module, package) for module in table.values()]
    return out


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Each module's rlmem imports (every ``import`` statement in the file, wherever it stands, and the
    modules its importlib re-export tables name), and the (importer, module, name) of each private name
    imported from another module."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        edges[m].update(t for t in _reexports(tree, package) if t.startswith("rlmem"))
        for node in ast.walk(tree):
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
    ("rlmem.benchmarks.rollout", "rlmem.rollout.sampler._gqa"): "it times the grouped decode kernel",
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
        "loaded = [m for m in ('rlmem.recipes.grpo', 'rlmem.recipes.policy', 'rlmem.rollout.sampler.hf') "
        "if m in sys.modules]\n"
        "print('LOADED', loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr
    assert "has no timeline.jsonl" in out.stderr


def test_the_rollout_names_resolve_from_the_package_and_its_two_rooms():
    import rlmem.rollout
    import rlmem.train

    assert rlmem.RemoteEngine is rlmem.rollout.RemoteEngine is rlmem.rollout.remote.RemoteEngine
    assert rlmem.HFSampler is rlmem.rollout.HFSampler is rlmem.rollout.sampler.HFSampler
    assert rlmem.rollout.PeerEngine is rlmem.rollout.remote.PeerEngine
    assert rlmem.rollout.SamplerConfig is rlmem.rollout.sampler.SamplerConfig
    assert rlmem.train.Engine is rlmem.Engine is rlmem.rollout.Engine
    for package in (rlmem.rollout, rlmem.rollout.sampler, rlmem.rollout.remote):
        for name in package.__all__:
            getattr(package, name)


def test_colocate_no_longer_loads_the_engines_from_the_floor_above():
    import rlmem.colocate

    for name in ("RemoteEngine", "PeerEngine", "EngineSeat", "serve_engine", "FLAVORS"):
        assert not hasattr(rlmem.colocate, name)


def test_an_importlib_reexport_counts_as_an_import(tmp_path):
    # The checker itself: a lower package re-exporting a higher one's name through lazy_names (as colocate
    # once did for the engines) is an edge, which the floors test then refuses.
    pkg = tmp_path / "rlmem" / "colocate"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from .._lazy import lazy_names\n_WHERE = {'RemoteEngine': 'rlmem.rollout', 'Member': '.member'}\n"
        "__getattr__ = lazy_names(__name__, _WHERE)\n"
    )
    (pkg / "old.py").write_text("__getattr__ = moved_names(__name__, {'x': 'rlmem.serve.core'})\n")
    mods = {"rlmem.colocate": pkg / "__init__.py", "rlmem.colocate.old": pkg / "old.py"}
    edges, _ = _imports(mods)
    assert edges["rlmem.colocate"] == {"rlmem._lazy", "rlmem.rollout", "rlmem.colocate.member"}
    assert edges["rlmem.colocate.old"] == {"rlmem.serve.core"}


# Old module paths of the rollout room, by module: where their names went. Each resolves for one release.
MOVED_IN_ROLLOUT = {
    "rlmem.rollout.http_engine": {
        "RemoteEngine": "rlmem.rollout.remote.base",
        "FLAVORS": "rlmem.rollout.remote.base",
        "PAUSE_MODES": "rlmem.rollout.remote.vllm",
    },
    "rlmem.rollout.process_engine": {
        n: "rlmem.rollout.remote.peer" for n in ("EngineSeat", "PeerEngine", "serve_engine")
    },
    "rlmem.rollout.server_rollout": {
        n: "rlmem.rollout.remote.server_rollout"
        for n in ("SERVER_CATEGORIES", "EngineLostError", "ServerRollout")
    },
    "rlmem.rollout.config": {n: "rlmem.rollout.sampler.config" for n in ("SamplerConfig", "kv_batch")},
    "rlmem.integrations.hf": {n: "rlmem.rollout.sampler.hf" for n in ("HFSampler", "kv_bytes_per_token")},
}


@pytest.mark.parametrize("old", list(MOVED_IN_ROLLOUT))
def test_old_rollout_paths_resolve_with_a_warning_naming_the_new(old):
    for name, new in MOVED_IN_ROLLOUT[old].items():
        said = rf"{re.escape(old)}\.{name} has moved to {re.escape(new)}\.{name}"
        with pytest.warns(DeprecationWarning, match=said):
            got = getattr(importlib.import_module(old), name)
        assert got is getattr(importlib.import_module(new), name)


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


SCRIPTS = ROOT.parent / "scripts"
# Private names and modules the scripts use, each with its reason; any other is a failure.
SCRIPT_PRIVATE_USES = {
    ("act_overhead", "rlmem.benchmarks.activations", "_build"): "the benchmark's model, timed apart",
    ("act_overhead", "rlmem.benchmarks.activations", "_step"): "the benchmark's step, timed apart",
    ("grpo_dist_json", "rlmem.benchmarks._common", None): "a result file in the benchmarks' format",
    ("grpo_dist_json", "rlmem.comm._nccl", None): "the NCCL library's version, for that file",
}


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level, its ``__all__`` and its re-export tables' names."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if isinstance(node.value, ast.Dict):
                out.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def test_the_scripts_import_only_what_exists_and_no_private_part_unlisted():
    mods = _modules()
    missing, private = [], set()
    for script in sorted(SCRIPTS.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names if a.name.startswith("rlmem")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlmem"):
                targets = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in targets:
                if module not in mods:
                    missing.append(f"{script.name}: {module}")
                    continue
                if any(p.startswith("_") and not p.startswith("__") for p in module.split(".")):
                    private.add((script.stem, module, None))
                if name is None:
                    continue
                if f"{module}.{name}" in mods:
                    if name.startswith("_"):
                        private.add((script.stem, f"{module}.{name}", None))
                    continue
                if name not in _defined(mods[module]):
                    missing.append(f"{script.name}: {module}.{name}")
                if name.startswith("_"):
                    private.add((script.stem, module, name))
    assert missing == []
    assert private - set(SCRIPT_PRIVATE_USES) == set()
    assert set(SCRIPT_PRIVATE_USES) - private == set()  # an exception no longer needed is removed


def test_the_rollout_rooms_keep_apart():
    # rollout/sampler (this process's sampler) imports nothing of rollout/remote (the clients of other
    # processes); remote takes from the sampler its config alone (what rlmem serve is started with), and
    # both share the engine protocol of rollout/engine.py
    edges, _ = _imports(_modules())
    crossing = sorted(
        (a, b)
        for a, bs in edges.items()
        for b in bs
        for here, there in (("sampler", "remote"), ("remote", "sampler"))
        if a.startswith(f"rlmem.rollout.{here}") and b.startswith(f"rlmem.rollout.{there}")
    )
    assert crossing == [("rlmem.rollout.remote.server_rollout", "rlmem.rollout.sampler.config")]
