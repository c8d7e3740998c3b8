"""One owner per setting of ``rlmem train``: each key is defined, defaulted and validated once, in the section
of the component that uses it (``GRPOConfig`` is their flat composition, so YAML and ``key=value`` are
unchanged); one generation length default for the recipe, the server and the server clients; one sampling
rule for the recipe, the sampler and the server; one PhaseManager per run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlmem._checks import check_sampling
from rlmem.recipes import yaml_config
from rlmem.recipes.config import SECTIONS, GRPOConfig, OffloadKeys, keys_help
from rlmem.rollout.engine import DEFAULT_MAX_NEW_TOKENS, Sampling, generation_length


def test_the_sections_are_disjoint_and_make_up_the_config():
    names = [f.name for s in SECTIONS for f in dataclasses.fields(s)]
    assert len(names) == len(set(names)), "two sections define one key"
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(GRPOConfig))
    assert next(f.name for f in dataclasses.fields(GRPOConfig)) == "model"
    for s in SECTIONS:  # each default is its section's, not restated
        for f in dataclasses.fields(s):
            assert GRPOConfig.__dataclass_fields__[f.name].default == f.default
    assert all(f"    {n} " in keys_help() for n in names)


def test_a_section_reaches_its_owner_whole_and_validates_as_the_config_does():
    cfg = GRPOConfig(max_new_tokens=9, temperature=0.5, top_p=0.9, offload=False, comms="keep")
    assert Sampling.of(cfg) == Sampling(max_new_tokens=9, temperature=0.5, top_p=0.9)
    assert OffloadKeys.of(cfg) == OffloadKeys(offload=False, comms="keep", overlap_offload=False)
    assert OffloadKeys(offload=None).enabled(on_cuda=True) and not OffloadKeys(offload=None).enabled(False)
    assert not OffloadKeys(offload=False).enabled(on_cuda=True)
    for bad in ({"comms": "drop"}, {"offload": "yes"}):
        for cls in (OffloadKeys, GRPOConfig):
            with pytest.raises(ValueError, match=next(iter(bad))):
                cls(**bad)


def test_a_saved_config_loads_back_equal(tmp_path):
    cfg = GRPOConfig(temperature=0, max_new_tokens=12, steps=3, share_prompts=False)
    yaml_config.dump(cfg, tmp_path / "config.yaml")
    assert yaml_config.load(GRPOConfig, str(tmp_path / "config.yaml"), []) == cfg
    # a flat override still reaches its section
    assert yaml_config.load(GRPOConfig, None, ["temperature=0.25", "comms=keep"]).temperature == 0.25


SAMPLING = [
    (1.0, 1.0, True),
    (0, 1.0, True),  # greedy, everywhere
    (0.0, 0.5, True),
    (2, 1, True),
    (-0.1, 1.0, False),
    (float("nan"), 1.0, False),
    (float("inf"), 1.0, False),
    (True, 1.0, False),
    (1.0, 0, False),
    (1.0, 1.5, False),
    (1.0, float("nan"), False),
]


@pytest.mark.parametrize("temperature, top_p, ok", SAMPLING)
def test_one_sampling_rule_in_the_recipe_the_sampler_the_client_and_the_server(temperature, top_p, ok):
    from rlmem.models.tiny import CharTokenizer, tiny_model
    from rlmem.rollout.remote import RemoteEngine
    from rlmem.rollout.sampler import HFSampler

    def accepts(fn) -> bool:
        try:
            fn()
        except ValueError:
            return False
        except ConnectionError:  # the client checked, then tried to send: accepted
            return True
        return True

    torch.manual_seed(0)
    tok = CharTokenizer()
    sampler = HFSampler(
        tiny_model(tok.vocab_size, "cpu", torch.float32),
        max_len=16,
        batch_size=2,
        pad_token_id=0,
        eos_token_id=1,
    )
    client = RemoteEngine("http://127.0.0.1:9", "rlmem", timeout=1)  # nothing listens: a check comes first
    verdicts = {
        "check_sampling": accepts(lambda: check_sampling(temperature, top_p)),
        "recipe": accepts(lambda: GRPOConfig(temperature=temperature, top_p=top_p)),
        "sampler": accepts(
            lambda: sampler.generate([[3, 4]], max_new_tokens=2, temperature=temperature, top_p=top_p)
        ),
        "client": accepts(lambda: client.generate([[3, 4]], temperature=temperature, top_p=top_p)),
    }
    try:
        from pydantic import ValidationError

        from rlmem.serve.app import GenerateRequest
    except ImportError:  # the serve extra: its request fields state the same rule
        pass
    else:

        def server() -> None:
            try:
                GenerateRequest.model_validate(
                    {"input_ids": [[3]], "temperature": temperature, "top_p": top_p}
                )
            except ValidationError as e:
                raise ValueError(str(e)) from e

        verdicts["server"] = accepts(server)
    assert verdicts == dict.fromkeys(verdicts, ok)
    client.close()


def test_one_generation_length_default():
    assert generation_length(None) == DEFAULT_MAX_NEW_TOKENS == 256
    assert generation_length(None, room=7) == 7 and generation_length(None, room=10_000) == 256
    assert generation_length(5, room=2) == 5  # given: as given (the engine checks it against its cache)
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="max_new_tokens"):
            generation_length(bad)
        with pytest.raises(ValueError, match="max_new_tokens"):
            GRPOConfig(max_new_tokens=bad)
    assert Sampling(max_new_tokens=None).generate_kwargs(room=7)["max_new_tokens"] == 7


def test_the_recipes_prompts_resolve_the_length_once(tmp_path):
    from rlmem.recipes.prompts import make_prompts

    toy = make_prompts(GRPOConfig(), say=lambda *a: None)
    assert toy.max_new_tokens == toy.task.max_answer_tokens + 2  # the task's room, below the default
    assert make_prompts(GRPOConfig(max_new_tokens=3), say=lambda *a: None).max_new_tokens == 3


def test_one_phase_manager_per_run(tmp_path, monkeypatch):
    import rlmem.recipes.policy as policy_mod
    from rlmem.recipes.grpo import run

    built = []
    real = policy_mod.PhaseManager

    def counted(*a, **k):
        built.append(real(*a, **k))
        return built[-1]

    monkeypatch.setattr(policy_mod, "PhaseManager", counted)
    for offload in (True, False):
        built.clear()
        out = tmp_path / str(offload)
        cfg = GRPOConfig(steps=1, prompts_per_step=2, group_size=2, offload=offload, out_dir=str(out))
        summary = run(cfg, echo=lambda *a, **k: None)
        assert len(built) == 1 and built[0].enabled is offload
        assert summary["offload"] is offload
