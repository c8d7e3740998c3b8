"""The checks of rlmem's vLLM weight-transfer backend, without vLLM: the checkpoint's manifest read from its
safetensors headers, an update refused before a byte is loaded (each fault named), and the verification
that loads the sent tensors again into shadows and finds a parameter that differs by one element, a
stacked parameter's rows included, with the model's loaders left as they were."""

from __future__ import annotations

import json

import pytest
import torch

from rlmem.benchmarks.verify import TINY, StackedLayout, _whole_loader, hf_shapes, layer_groups
from rlmem.colocate.weight_check import Checkpoint, check_update, read_checkpoint, shadow_verify

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [True, False])
def test_the_checkpoint_is_what_it_holds(tmp_path, tied):
    cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    got = read_checkpoint(str(tmp_path))
    want = {n: (tuple(p.shape), "BF16") for n, p in model.state_dict().items()}
    if tied:  # saved once, under the embedding's name
        want.pop("lm_head.weight")
    assert got.tensors == want and got.tied is tied and got.path == str(tmp_path)
    with pytest.raises(LookupError, match="neither a directory here nor"):
        read_checkpoint(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LookupError, match="has no safetensors files"):
        read_checkpoint(str(tmp_path / "empty"))


DOWN0, DOWN1 = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
STEPS, HEAD, EMBED = "model.layers.0.steps", "lm_head.weight", "model.embed_tokens.weight"
TENSORS = {
    EMBED: ((8, 4), "BF16"),
    DOWN0: ((4, 6), "BF16"),
    "model.layers.0.mlp.up_proj.weight": ((6, 4), "BF16"),
    DOWN1: ((4, 6), "BF16"),
    "model.norm.weight": ((4,), "BF16"),
    STEPS: ((1,), "I64"),
    "model.rotary_emb.inv_freq": ((2,), "F32"),  # in old checkpoints, skipped by the models' loaders
}
CKPT = Checkpoint("/ckpt", TENSORS, tied=True)


def _sent(**change):
    out = {
        n: torch.ones(s, dtype=torch.int64 if d == "I64" else torch.float32) for n, (s, d) in TENSORS.items()
    }
    out.pop("model.rotary_emb.inv_freq")
    out.update(change)
    return [(n, t) for n, t in out.items() if t is not None]


def test_a_good_update_passes_with_casts_where_the_loader_casts():
    check_update(_sent(), CKPT, False, "the server")  # float32 into bfloat16: a cast, as loading does
    check_update(_sent(**{HEAD: torch.ones(8, 4)}), CKPT, False, "the server")  # equal to its embedding
    check_update([("model.norm.weight", torch.ones(4))], CKPT, True, "the server")


@pytest.mark.parametrize(
    "change, partial, words",
    [
        ({DOWN0: torch.ones(4, 8)}, False, f"'{DOWN0}' was given with shape [4, 8], the model of the server"),
        ({DOWN0: torch.ones(6, 4)}, False, "was given with shape [6, 4]"),
        ({DOWN1: None}, False, "1 of the 7 tensors of the model of the server (its checkpoint /ckpt)"),
        ({"model.layers.9.x.weight": torch.ones(1)}, True, "'model.layers.9.x.weight' is not a tensor"),
        ({STEPS: torch.ones(1)}, False, f"'{STEPS}' was given as torch.float32, the model of the server"),
        ({HEAD: torch.full((8, 4), 2.0)}, False, "its lm_head is tied to the embedding"),
        ({HEAD: torch.ones(8, 4), EMBED: None}, True, "its lm_head is tied to the embedding"),
    ],
    ids=["larger", "transposed", "incomplete", "unknown", "int-as-float", "tied-differs", "tied-alone"],
)  # fmt: skip
def test_a_bad_update_is_refused_naming_the_parameter(change, partial, words):
    with pytest.raises(ValueError, match="nothing was loaded") as e:
        check_update(_sent(**change), CKPT, partial, "the server")
    assert words in str(e.value)
    with pytest.raises(ValueError, match="is given twice"):
        check_update([*_sent(), (DOWN0, torch.ones(4, 6))], CKPT, False, "the server")


def _served(dtype=torch.float32):
    shapes = hf_shapes(TINY)
    gen = torch.Generator().manual_seed(0)
    sent = {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}
    served = StackedLayout(shapes, dtype, torch.device("cpu"))
    served.load_weights(sent.items())
    groups = [[(n, sent[n]) for n in g] for g in layer_groups(sent)]
    return sent, served, groups


def test_verification_passes_on_a_faithful_load_and_leaves_the_loaders_as_they_were():
    _, served, groups = _served()
    loaders = {n: p.__dict__.get("weight_loader") for n, p in served.params.items()}
    before = {n: p.detach().clone() for n, p in served.params.items()}
    assert shadow_verify(served.params, served.load_weights, groups, default_loader=_whole_loader) == []
    assert {n: p.__dict__.get("weight_loader") for n, p in served.params.items()} == loaders
    assert all(torch.equal(before[n], p) for n, p in served.params.items())  # the model itself untouched
    assert len(groups) == TINY["num_hidden_layers"] + 1  # a group per layer, and the rest


@pytest.mark.parametrize(
    "victim, index",
    [
        ("model.layers.0.self_attn.qkv_proj.weight", -1),  # the last row: v's
        ("model.layers.1.mlp.gate_up_proj.weight", 0),
        ("model.layers.1.self_attn.qkv_proj.bias", 3),
        ("model.embed_tokens.weight", 100),
        ("model.norm.weight", 0),
    ],
)
def test_verification_finds_one_element_that_differs(victim, index):
    _, served, groups = _served()
    served.params[victim].data.view(-1)[index] += 1e-3
    assert shadow_verify(served.params, served.load_weights, groups, default_loader=_whole_loader) == [victim]


def test_an_emptied_parameter_is_left_to_the_probe_with_its_loaded_shape():
    # vLLM's CPU backend empties a linear layer's weight once it has packed it: the shadow takes the shape
    # it was loaded with (NaN where nothing was loaded) and the probe compares it with the packed copy
    _, served, groups = _served()
    name = "model.layers.0.mlp.gate_up_proj.weight"
    packed = served.params[name].detach().clone()
    full = tuple(packed.shape)
    served.params[name].data = torch.empty(0)
    seen = {}

    def probe(shadows):
        for key, shadow in shadows.items():
            if key == id(served.params[name]):
                seen["shadow"] = shadow.clone()
        return [] if "shadow" not in seen or torch.equal(seen["shadow"], packed) else [name]

    def template(n, p):
        return torch.empty(full, device="meta") if n == name else p

    kw = dict(default_loader=_whole_loader, template=template, probe=probe)
    assert shadow_verify(served.params, served.load_weights, groups, **kw) == []
    assert seen["shadow"].shape == full and not torch.isnan(seen["shadow"]).any()
    packed[0, 0] += 1  # the packed copy stale
    assert shadow_verify(served.params, served.load_weights, groups, **kw) == [name]


def test_the_benchmark_runs_on_the_cpu(tmp_path):
    from rlmem.benchmarks import verify

    out = tmp_path / "v.json"
    assert verify.main(["--device", "cpu", "--preset", "tiny", "--repeats", "1", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["detects_one_element"] == 1.0 and summary["verify_s_per_gib"] > 0
