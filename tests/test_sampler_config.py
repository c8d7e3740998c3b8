"""One sampler config from the recipe to the server: every field is an HFSampler keyword, it travels to
``rlmem serve`` whole as JSON, and bad values are refused naming the field."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch

from rlmem.rollout import HFSampler
from rlmem.rollout.sampler.config import SamplerConfig, kv_batch
from rlmem.serve.main import _sampler_config, serve_parser

BASE = dict(max_len=64, batch_size=8, pad_token_id=0, eos_token_id=2)


def test_every_field_is_a_sampler_keyword_with_its_default():
    params = inspect.signature(HFSampler).parameters
    for f in dataclasses.fields(SamplerConfig):
        assert f.name in params, f.name
        if f.default is not dataclasses.MISSING:
            assert params[f.name].default == f.default, f.name


def test_json_round_trip_keeps_every_setting():
    cfg = SamplerConfig(
        **BASE, compute_dtype="bf16", sync_every=4, cuda_graphs="off", fused="off", kv_block=128, gqa="off"
    )
    back = SamplerConfig.from_json(cfg.to_json())
    assert back == cfg
    kw = back.sampler_kwargs()
    assert kw["compute_dtype"] is torch.bfloat16 and kw["kv_block"] == 128 and kw["refill"] is True


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(max_len=1), "max_len"),
        (dict(batch_size=0), "batch_size"),
        (dict(compute_dtype="int8"), "compute_dtype"),
        (dict(cuda_graphs="yes"), "cuda_graphs"),
        (dict(refill="no"), "refill"),
        (dict(pad_token_id=-1), "pad_token_id"),
    ],
)
def test_a_bad_field_is_named(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplerConfig(**{**BASE, **bad})


def test_unknown_json_fields_are_named():
    with pytest.raises(ValueError, match=r"unknown field.*temperature"):
        SamplerConfig.from_json(json.dumps({**BASE, "temperature": 1.0}))
    with pytest.raises(ValueError, match="not JSON"):
        SamplerConfig.from_json("{")


def test_serve_takes_the_config_whole_and_refuses_it_beside_the_flags_it_replaces():
    cfg = SamplerConfig(**BASE, fused="off", refill=False)
    args = serve_parser().parse_args(["tiny", "--sampler-config", cfg.to_json()])
    assert _sampler_config(args) == cfg
    args = serve_parser().parse_args(["tiny", "--sampler-config", cfg.to_json(), "--max-len", "32"])
    with pytest.raises(ValueError, match="leave out --max-len"):
        _sampler_config(args)
    assert _sampler_config(serve_parser().parse_args(["tiny"])) is None


def test_kv_batch_is_the_budget_over_a_sequence_capped():
    assert kv_batch(100, 1000, max_len=10) == 10
    assert kv_batch(100, 1000, 4, max_len=10) == 4
    with pytest.raises(ValueError, match="kv_budget must hold at least one sequence of max_len=10"):
        kv_batch(100, 99, max_len=10, field="kv_budget")
