"""rlmem.integrations.verl against verl's own code: verl 0.9.1 from PyPI in a venv of its own
(tests/_verl_env.py; verl pins transformers < 5.11 and Python < 3.13), loading rlmem the way verl's users
will (``VERL_USE_EXTERNAL_MODULES=rlmem.integrations.verl``), replaying its actor's calls on two Gloo ranks
(tests/_verl_replay.py): FSDP2 and FSDP1 under verl's ``FSDPEngineWithLMHead``, Megatron-Core under its
``MegatronEngine``. With verl's offload flags on, what verl sends to the rollout, the eval mode's logits,
the losses and the final weights and optimizer states are bit-equal to a run with them off; the state is
where verl asked at every point (the weights alone back in the eval mode and the weight sync, nothing
resident in rollout); ``state_dict()`` is read while it is away; and every function patched is there with the
parameters tested (else importing verl's engine fails, naming it). Skipped, saying why, only where the venv
cannot be made.
"""

from __future__ import annotations

import json
import os

import pytest
from _helpers import ROOT, run_launcher
from _verl_env import venv, with_rlmem

CASES = {
    # FSDP2 with both of rlmem's options: the optimizer states back only for the step, NCCL (here the host
    # stand-in over Gloo) suspended from the switch to rollout, through verl's own update_weights
    "fsdp2-step-suspend": ("fsdp2", {"RLMEM_VERL_OPTIMIZER": "step", "RLMEM_VERL_COMMS": "suspend"}),
    "fsdp1": ("fsdp1", {}),
    "megatron": ("megatron", {}),
}


@pytest.fixture(scope="module")
def python():
    py, why = venv()
    if py is None:
        pytest.skip(why)
    why = with_rlmem(py)
    if why:
        pytest.skip(why)
    return py


@pytest.mark.parametrize("case", list(CASES))
def test_verl_engines_offload_through_rlmem_bit_for_bit(python, tmp_path, case):
    kind, extra = CASES[case]
    out = tmp_path / "ranks.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLMEM_VERL_", "VERL_"))}
    env.update(PYTHONPATH=str(ROOT), VERL_USE_EXTERNAL_MODULES="rlmem.integrations.verl", **extra)
    script = ROOT / "tests" / "_verl_replay.py"
    proc = run_launcher([str(python), str(script), str(out), kind, "2"], timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["settings"] == {"comms": extra.get("RLMEM_VERL_COMMS", "keep"), **_opt(extra)}
        # the engine modules imported here, patched as verl imported them, whole
        engine = (
            "verl.workers.engine.megatron.transformer_impl"
            if kind == "megatron"
            else ("verl.workers.engine.fsdp.transformer_impl")
        )
        assert r["patched"][engine] == r["signatures"][engine]
        if extra.get("RLMEM_VERL_COMMS") == "suspend":
            for mod in ("verl.workers.engine.base", "verl.workers.engine_workers"):
                assert r["patched"][mod] == r["signatures"][mod], mod
            # verl's update_weights: the weights woken, the update sent, NCCL suspended, then the KV cache
            assert r["rollout calls"] == [
                "resume weights suspended=0",
                "update_weights",
                "resume kv_cache suspended=1",
            ]
        for key in ("sent", "logits", "losses", "final"):
            assert r[f"{key} equal"], key
        assert r["final tensors"] > 0
        checks = r["checks"]
        assert checks["adopted at initialize"] == [True]
        assert all(v == [True] * 3 for k, v in checks.items() if k != "adopted at initialize"), checks
        assert len(checks) >= 6
        if kind == "fsdp1":  # FSDP1 with CPU offload: refused at verl's first offload, nothing touched
            assert "cannot adopt verl's FSDPEngineWithLMHead" in r["refusal"]
            assert "CPU offload" in r["refusal"] and "VERL_USE_EXTERNAL_MODULES" in r["refusal"]
            assert r["refused untouched"] and not r["refused adopted"]


def _opt(extra: dict[str, str]) -> dict[str, str]:
    return {"optimizer": extra.get("RLMEM_VERL_OPTIMIZER", "offload")}
