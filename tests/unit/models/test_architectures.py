"""Unknown architectures are refused at load, by name (issue #30)."""

import json

import pytest

from celeris.engine.errors import ModelLoadError
from celeris.engine.families.checkpoint import load_model, parse_config, read_config
from celeris.engine.families.registry import known_architectures

DREAM = {
    "architectures": ["DreamModel"], "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 300,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "mask_token_id": 3, "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def test_dream_config_still_loads():
    assert parse_config(DREAM).arch == "dream"


@pytest.mark.parametrize("name", ["Fast_dLLM_QwenForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_relabelled_dream_config_is_refused_by_name(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps({**DREAM, "architectures": [name]}))
    with pytest.raises(ModelLoadError, match=name):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="supported: " + known_architectures()[0]):
        read_config(tmp_path)


def test_one_unknown_among_known_is_refused():
    with pytest.raises(ModelLoadError, match="Foo"):
        parse_config({**DREAM, "architectures": ["DreamModel", "Foo"]})


def test_no_architectures_key_falls_back_to_keys():
    raw = {k: v for k, v in DREAM.items() if k != "architectures"}
    assert parse_config(raw).arch == "dream"
