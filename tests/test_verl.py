"""rlmem.integrations.verl where verl is not installed: what it refuses before patching anything (a missing
verl, a version it was not tested with, a patched function whose signature changed, a setting not allowed).
The tier that runs verl's own engines is tests/test_verl_real.py."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types

import pytest

NAME = "rlmem.integrations.verl"


@pytest.fixture
def fresh(monkeypatch):
    """Import the module anew, as verl would, with ``verl`` reporting the version given; what the import
    installed is taken away after the test."""
    real = importlib.metadata.version
    before = list(sys.meta_path)

    def load(version: str | None):
        def fake(name: str) -> str:
            if name != "verl":
                return real(name)
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version

        monkeypatch.setattr(importlib.metadata, "version", fake)
        sys.modules.pop(NAME, None)
        return importlib.import_module(NAME)

    yield load
    sys.meta_path[:] = before
    sys.modules.pop(NAME, None)


def test_without_verl_the_import_says_what_to_install(fresh):
    with pytest.raises(ImportError, match=r"needs verl installed \(pip install 'rlmem\[verl\]'\).*0\.9\.1"):
        fresh(None)


def test_an_untested_version_is_refused_and_nothing_is_patched(fresh):
    before = list(sys.meta_path)
    with pytest.raises(
        RuntimeError, match=r"tested with verl 0\.9\.1; this is verl 0\.8\.5.*patches nothing"
    ):
        fresh("0.8.5")
    assert sys.meta_path == before


def test_settings_are_validated_naming_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("RLMEM_VERL_COMMS", "destroy")
    with pytest.raises(ValueError, match=r"RLMEM_VERL_COMMS must be one of 'keep', 'suspend'; got 'destroy'"):
        fresh("0.9.1")
    monkeypatch.setenv("RLMEM_VERL_COMMS", "suspend")
    monkeypatch.setenv("RLMEM_VERL_OPTIMIZER", "later")
    with pytest.raises(ValueError, match="RLMEM_VERL_OPTIMIZER must be one of 'offload', 'step'"):
        fresh("0.9.1")
    monkeypatch.setenv("RLMEM_VERL_OPTIMIZER", "step")
    mod = fresh("0.9.1")
    assert mod.settings() == mod.Settings(comms="suspend", optimizer="step")
    assert mod.patched() == {}  # none of verl's engine modules is imported here


def _engine_module(to, **helpers) -> types.ModuleType:
    m = types.ModuleType("verl.workers.engine.fsdp.transformer_impl")
    m.FSDPEngine = type("FSDPEngine", (), {"to": to})
    for name, fn in helpers.items():
        setattr(m, name, fn)
    return m


def test_a_changed_signature_or_a_missing_function_is_refused_by_name(fresh):
    mod = fresh("0.9.1")

    def to(self, device, model=True, optimizer=True, grad=True): ...

    def model_helper(model, empty_cache=True): ...

    def load_model(model): ...

    def offload_opt(optimizer): ...

    def load_opt(optimizer, device_id): ...

    good = dict(
        offload_fsdp_model_to_cpu=model_helper,
        load_fsdp_model_to_gpu=load_model,
        offload_fsdp_optimizer=offload_opt,
        load_fsdp_optimizer=load_opt,
    )
    mod.check_signatures(_engine_module(to, **good))  # the tested shape passes

    def to_renamed(self, device, model=True, optimizer=True, grads=True): ...

    with pytest.raises(
        RuntimeError,
        match=r"FSDPEngine\.to takes \(self, device, model=True, optimizer=True, "
        r"grads=True\).*not \(self, device, model=True, optimizer=True, grad=True\)",
    ):
        mod.check_signatures(_engine_module(to_renamed, **good))
    missing = dict(good)
    del missing["load_fsdp_optimizer"]
    with pytest.raises(RuntimeError, match=r"transformer_impl\.load_fsdp_optimizer is not in verl 0\.9\.1"):
        mod.check_signatures(_engine_module(to, **missing))
