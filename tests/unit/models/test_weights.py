"""Checkpoint loading: LLaDA and Dream naming, shards, dtypes, and every strictness error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from celeris.engine.config import read_json
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.checkpoint import load_model, open_checkpoint, save_model
from celeris.engine.families.registry import card_of
from celeris.engine.parallel.group import Group, Plan
from celeris.engine.parallel.shard import checkpoint_parameters, load_shard
from tests.helpers import random_model, tiny_config


def llada_state(model):
    return {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}


def test_llada_round_trip_with_published_names(tmp_path):
    model = random_model(tiny_config(), seed=0)
    save_model(model, tmp_path)
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"model.transformer.wte.weight", "model.transformer.blocks.0.q_proj.weight",
            "model.transformer.blocks.1.ff_out.weight", "model.transformer.ln_f.weight",
            "model.transformer.ff_out.weight", "model.transformer.blocks.0.attn_out.weight",
            "model.transformer.blocks.0.up_proj.weight", "model.transformer.blocks.0.ff_proj.weight"} <= names
    loaded = load_model(tmp_path)
    ids = torch.randint(5, 300, (1, 6))
    torch.testing.assert_close(loaded(ids), model(ids))


def test_llada_config_keys_are_read(tmp_path):
    model = random_model(tiny_config(), seed=0)
    save_model(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size", "embedding_size",
                "rope_theta", "rms_norm_eps", "mask_token_id", "eos_token_id", "weight_tying"):
        assert key in cfg
    assert load_model(tmp_path).cfg == model.cfg


def test_dream_qwen2_naming_loads(tmp_path):
    cfg = tiny_config(arch="dream", qkv_bias=True, weight_tying=False, embedding_size=300, vocab_size=300)
    model = random_model(cfg, seed=1)
    with torch.no_grad():
        for b in model.transformer.blocks:
            b.q_proj.bias.normal_()
    sd, t = {}, model.transformer
    sd["model.embed_tokens.weight"] = t.wte.weight
    sd["model.norm.weight"] = t.ln_f.weight
    sd["lm_head.weight"] = t.ff_out.weight
    for i, b in enumerate(t.blocks):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = b.attn_norm.weight
        sd[p + "post_attention_layernorm.weight"] = b.ff_norm.weight
        for x in "qkv":
            sd[p + f"self_attn.{x}_proj.weight"] = getattr(b, f"{x}_proj").weight
            sd[p + f"self_attn.{x}_proj.bias"] = getattr(b, f"{x}_proj").bias
        sd[p + "self_attn.o_proj.weight"] = b.attn_out.weight
        sd[p + "mlp.gate_proj.weight"] = b.ff_proj.weight
        sd[p + "mlp.up_proj.weight"] = b.up_proj.weight
        sd[p + "mlp.down_proj.weight"] = b.ff_out.weight
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 300,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "mask_token_id": 3, "eos_token_id": 2,
        "tie_word_embeddings": False}))
    loaded = load_model(tmp_path)
    assert loaded.cfg.arch == "dream" and loaded.cfg.qkv_bias
    ids = torch.randint(5, 300, (1, 7))
    torch.testing.assert_close(loaded(ids), model(ids))


def test_sharded_checkpoint_loads(tmp_path):
    model = random_model(tiny_config(), seed=2)
    save_model(model, tmp_path / "ref")
    state = llada_state(model)
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / fname)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (tmp_path / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    ids = torch.randint(5, 300, (1, 5))
    torch.testing.assert_close(load_model(tmp_path)(ids), model(ids))


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_is_selectable(tmp_path, dtype, torch_dtype):
    save_model(random_model(tiny_config(), seed=0), tmp_path)
    m = load_model(tmp_path, dtype=dtype)
    assert all(p.dtype == torch_dtype for p in m.parameters())


def _corrupt(tmp_path, edit):
    save_model(random_model(tiny_config(), seed=0), tmp_path)
    state = {}
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    edit(state)
    save_file(state, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    _corrupt(tmp_path, lambda s: s.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor.*blocks\.1\.up_proj\.weight"):
        load_model(tmp_path)


def test_unexpected_tensor_names_tensor_and_file(tmp_path):
    _corrupt(tmp_path, lambda s: s.update({"model.transformer.blocks.9.q_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model.transformer.blocks.9.q_proj.weight' in model.safetensors"):
        load_model(tmp_path)


def test_misshaped_tensor_names_tensor_file_and_shapes(tmp_path):
    _corrupt(tmp_path, lambda s: s.update({"model.transformer.ln_f.weight": torch.ones(63)}))
    with pytest.raises(ModelLoadError, match=r"'model.transformer.ln_f.weight' in model.safetensors has shape \(63,\), expected \(64,\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.transformer.blocks.1.up_proj.weight"), r"missing tensor\(s\) in .*blocks\.1\.up_proj"),
    (lambda s: s.update({"model.transformer.blocks.9.q_proj.weight": torch.zeros(2, 2)}),
     r"^unexpected tensor 'model.transformer.blocks.9.q_proj.weight' in model.safetensors$"),
    (lambda s: s.update({"model.transformer.ln_f.weight": torch.ones(63)}),
     r"^tensor 'model.transformer.ln_f.weight' in model.safetensors has shape \(63,\), expected \(64,\)$"),
])
def test_the_whole_and_the_sharded_loader_read_one_way(tmp_path, edit, message):
    """load_model and a tensor-parallel rank's load_shard share the strict reader
    (models/checkpoint.py): the same checkpoint fault is the same error."""
    _corrupt(tmp_path, edit)
    for load in (load_model, lambda folder: load_shard(open_checkpoint(folder), Plan(2), Group(0, 2))):
        with pytest.raises(ModelLoadError, match=message):
            load(tmp_path)


def test_a_rank_loads_its_slice_and_the_headers_count_the_whole_model(tmp_path):
    model = random_model(tiny_config(), seed=0)
    save_model(model, tmp_path)
    rank1 = load_shard(open_checkpoint(tmp_path), Plan(2), Group(1, 2))
    assert torch.equal(rank1.state_dict()["transformer.blocks.0.q_proj.weight"],
                       model.state_dict()["transformer.blocks.0.q_proj.weight"][32:])
    assert checkpoint_parameters(tmp_path) == sum(p.numel() for p in model.parameters())


def test_every_folder_json_is_read_one_way(tmp_path):
    assert read_json(tmp_path, "generation_config.json") == {}  # optional files may be absent
    with pytest.raises(ModelLoadError, match=r"^no generation_config.json in model folder "):
        read_json(tmp_path, "generation_config.json", required=True)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config.json: invalid JSON \("):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"config.json: expected a JSON object, got list"):
        load_model(tmp_path)
    save_model(random_model(tiny_config(), seed=0), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"model.safetensors.index.json: not a safetensors index"):
        load_model(tmp_path)


def test_missing_folder_config_and_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(card_of(tiny_config()).writes(tiny_config())))
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(tmp_path)


def test_missing_shard_is_named(tmp_path):
    save_model(random_model(tiny_config(), seed=0), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ModelLoadError, match="gone.safetensors"):
        load_model(tmp_path)
