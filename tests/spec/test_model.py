"""ModelSpec parameter counts against an independent reference: the `transformers` modules.

Each tiny config is built from the library's own config class, the model is instantiated with
random weights, and `sum(p.numel())` per decoder layer (and for the ends) is compared with the
ModelSpec parsed from `config.to_dict()`. Counts are exact (tolerance 0).
"""

from __future__ import annotations

import pytest

from lazytrain.spec.model import ModelSpec

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              num_hidden_layers=4, max_position_embeddings=64)

TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96)),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM",
                        dict(intermediate_size=96, tie_word_embeddings=True, attention_bias=True,
                             mlp_bias=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
                       head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                     dict(intermediate_size=96, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4,
                          layer_types=["linear_attention", "linear_attention",
                                       "linear_attention", "full_attention"])),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, shared_expert_intermediate_size=24, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=8, mlp_only_layers=[1])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                     head_dim=16, sliding_window=8)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(intermediate_size=96, moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                         kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)),
    "deepseek_v2_qlora": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                          dict(intermediate_size=96, moe_intermediate_size=16,
                               n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                               first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=24,
                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                               num_key_value_heads=4)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(intermediate_size=96, sliding_window=8, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(intermediate_size=96, head_dim=16, sliding_window=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(intermediate_size=96, head_dim=16, sliding_window=8,
                         sliding_window_pattern=2)),
}


def _build(case: str):
    cfg_name, model_name, extra = TINY[case]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg)
    return cfg, model


@pytest.fixture(scope="module", params=sorted(TINY))
def built(request):
    cfg, model = _build(request.param)
    return request.param, cfg, model


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_block_params_equal_transformers_layer_numel(built):
    case, cfg, model = built
    spec = ModelSpec.from_hf_config(cfg.to_dict(), name=case)
    layers = model.model.layers
    assert spec.num_blocks == len(layers)
    assert [b.params for b in spec.blocks] == [_numel(layer) for layer in layers]


def test_ends_and_total_params_equal_transformers(built):
    case, cfg, model = built
    spec = ModelSpec.from_hf_config(cfg.to_dict(), name=case)
    assert spec.embed_params == _numel(model.model.embed_tokens)
    assert spec.final_norm_params == _numel(model.model.norm)
    assert spec.total_params == _numel(model)  # parameters() dedups tied weights


def test_block_kinds_follow_the_layer_types_of_each_layer():
    _, model = _build("qwen3_5_text")
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    assert [b.kind for b in spec.blocks] == ["linear_attention"] * 3 + ["dense"]
    _, model = _build("gpt_oss")
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    assert [b.kind for b in spec.blocks] == ["sliding_attention_moe", "moe"] * 2
    assert spec.blocks[0].sliding_window == 8 and spec.blocks[1].sliding_window == 0
    _, model = _build("deepseek_v2")
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    assert [b.kind for b in spec.blocks] == ["mla"] + ["mla_moe"] * 3


def test_gemma_and_phi3_layer_kinds_match_what_transformers_builds():
    for case in ("gemma2", "gemma3_text", "phi3"):
        cfg, model = _build(case)
        spec = ModelSpec.from_hf_config(cfg.to_dict())
        if case == "phi3":  # one model-wide window: every layer sliding (Phi3Model's mask)
            expected = ["sliding_attention"] * 4
        else:
            expected = [layer.self_attn.layer_type for layer in model.model.layers]
        assert [b.attention for b in spec.blocks] == expected, case
        assert [b.sliding_window for b in spec.blocks] == \
            [8 if kind == "sliding_attention" else 0 for kind in expected], case


def test_gemma3_hub_config_without_layer_types_uses_the_5_to_1_pattern():
    config = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 16, "vocab_size": 128, "sliding_window": 512}
    spec = ModelSpec.from_hf_config({"model_type": "gemma3", "text_config": config})
    full = [b.index for b in spec.blocks if b.attention == "full_attention"]
    assert full == [5, 11]  # transformers' Gemma3TextConfig: every 6th layer global
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert [t == "full_attention" for t in hf.layer_types] == \
        [b.attention == "full_attention" for b in spec.blocks]


@pytest.mark.parametrize("config", [
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "vocab_size": 128},
    {"model_type": "mygpt", "position_embedding_type": "absolute", "hidden_size": 64}],
    ids=["gpt2", "declared_absolute"])
def test_absolute_position_model_is_refused_in_one_line_listing_the_families(config):
    with pytest.raises(ValueError) as err:
        ModelSpec.from_hf_config(config)
    message = str(err.value)
    assert "\n" not in message and "absolute" in message
    for family in ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral"):
        assert family in message


def test_moe_active_params_count_top_k_experts_only():
    cfg, model = _build("mixtral")
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    layer = model.model.layers[0]
    experts = _numel(layer.mlp.experts)
    # 4 experts, top-2: the active count drops exactly half of the expert weights.
    assert spec.blocks[0].params - spec.blocks[0].active_params == experts // 2


def test_real_qwen3_8b_total_matches_published_8_2b(shared_dir):
    spec = ModelSpec.from_hf_config(shared_dir / "models" / "qwen3-8b.json")
    # Qwen3-8B model card: "Number of Parameters: 8.2B" (6.95B non-embedding).
    assert abs(spec.total_params / 1e9 - 8.2) < 0.05
    non_embedding = spec.total_params - spec.embed_params - spec.head_params
    assert abs(non_embedding / 1e9 - 6.95) < 0.05


def test_seed_model_has_64_hybrid_blocks_and_27b_params(shared_dir):
    spec = ModelSpec.from_hf_config(shared_dir / "models" / "qwen3.5-27b.json")
    assert spec.num_blocks == 64 and spec.hidden_size == 5120
    assert sum(b.attention == "full_attention" for b in spec.blocks) == 16
    assert abs(spec.total_params / 1e9 - 26.9) < 0.05


def test_config_sha_ignores_extra_keys_and_name_but_not_shapes():
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 128}
    a = ModelSpec.from_hf_config(base, name="a")
    b = ModelSpec.from_hf_config({**base, "transformers_version": "x", "_source": "y"}, name="b")
    c = ModelSpec.from_hf_config({**base, "intermediate_size": 128})
    assert a.config_sha256 == b.config_sha256 != c.config_sha256


def test_builtin_smollm2_is_llama_with_tied_embeddings_and_135m_params():
    spec = ModelSpec.from_hf_config("smollm2-135m-instruct")
    assert spec.num_blocks == 30 and spec.tie_word_embeddings and spec.head_params == 0
    assert abs(spec.total_params / 1e6 - 134.5) < 0.1


def test_unsupported_model_type_names_the_type_and_the_supported_ones():
    with pytest.raises(ValueError, match="'bert' is not supported; supported: .*llama"):
        ModelSpec.from_hf_config({"model_type": "bert", "hidden_size": 8, "vocab_size": 8})


def test_missing_config_file_says_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="built-in names"):
        ModelSpec.from_hf_config(tmp_path / "nope.json")


@pytest.mark.parametrize("text", ["myhost\n", "[1, 2]\n", "\udcff"])
def test_a_file_that_is_not_a_json_object_is_named_as_not_a_hf_config(tmp_path, text):
    path = tmp_path / "hostname"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=f"model config {path} is not a JSON HF config"):
        ModelSpec.from_hf_config(path)
