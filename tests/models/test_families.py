"""Gradient equivalence of the streaming engine with plain HF autograd for every supported
family: Llama, Qwen3.5 (hybrid Gated-DeltaNet + full attention, flat and nested configs),
Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE, Mixtral, GPT-OSS (alternating sliding/full attention with
sinks), Gemma2 (scaled embedding, soft-capped attention and final logits, alternating
sliding/full), Gemma3 (per-kind rotary, q/k norms), Phi3 and Mistral (fused projections; one
model-wide sliding window) and one model through the generic decoder path (OLMo-2). Every
sliding window is 4 tokens < SEQ = 12, so a wrong band changes the gradients.

Reference: an independent copy of the same tiny fp32 HF model (copied state_dict) run with
plain autograd (`engine_helpers.reference_grads`). Each family runs under two plans: all
blocks recomputed in segments of 2 with boundary 0 re-embedded (MegaTrain-like), and mixed
tiers dram/recompute/hbm/nvme with the last block's internals kept.

MoE: the router weights are set so that expert 0 can never be in the top-k (its logit is 0
while two +-r pairs guarantee two strictly positive logits; GPT-OSS: a -1e4 router bias), so
its gradient must be exactly zero, in HF and in the engine, at its own offset.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_helpers import (HIDDEN, SEQ, VOCAB, micro_batches, plan_for,  # noqa: E402
                            reference_grads)
from lazytrain.models import adapter_from_model  # noqa: E402
from lazytrain.models.families import (layer_attention_type, layer_mask_key,  # noqa: E402
                                       layer_sliding_window)
from lazytrain.runtime.build import make_engine  # noqa: E402

R, H, D, N = "recompute", "hbm", "dram", "nvme"
PLANS = {
    "all_recompute_segments_of_2": ([R, R, H, R, H], ()),
    "mixed_tiers_keep_last": ([D, R, H, N, H], (3,)),
}
HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SLIDING_WINDOW = 4  # tokens, < SEQ = 12: the band really cuts the causal mask
ATTN = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            tie_word_embeddings=False, pad_token_id=0)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=HYBRID)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)


def family_config(family: str):
    """A 4-layer, hidden-64 fp32 config of `family`, built from its transformers config class."""
    if family == "llama":
        return tf.LlamaConfig(intermediate_size=128, **ATTN)
    if family == "olmo2_generic":
        return tf.Olmo2Config(intermediate_size=128, **ATTN)
    if family == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(intermediate_size=128, **ATTN, **LINEAR)
    if family == "qwen3_5_nested":
        return tf.Qwen3_5Config(text_config=dict(intermediate_size=128, **ATTN, **LINEAR))
    if family == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(shared_expert_intermediate_size=32, **ATTN, **LINEAR,
                                       **MOE)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(intermediate_size=128, shared_expert_intermediate_size=32,
                                  decoder_sparse_step=1, **ATTN, **LINEAR, **MOE)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=128, decoder_sparse_step=1, **ATTN, **MOE)
    if family == "mixtral":
        return tf.MixtralConfig(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                                **ATTN)
    if family == "gpt_oss":
        return tf.GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=SLIDING_WINDOW,
                               layer_types=["sliding_attention", "full_attention"] * 2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               **ATTN)
    if family == "gemma2":  # eager attention: HF's SDPA path has no soft-capping
        return tf.Gemma2Config(intermediate_size=128, sliding_window=SLIDING_WINDOW,
                               query_pre_attn_scalar=16, final_logit_softcapping=3.0,
                               attn_logit_softcapping=5.0, **ATTN)
    if family == "gemma3_text":  # local theta 1e4 / global 1e6: a shared rotary would differ
        return tf.Gemma3TextConfig(intermediate_size=128, sliding_window=SLIDING_WINDOW,
                                   query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   **ATTN)
    if family == "phi3":
        return tf.Phi3Config(intermediate_size=128, sliding_window=SLIDING_WINDOW,
                             **{k: v for k, v in ATTN.items() if k != "head_dim"})
    if family == "mistral":
        return tf.MistralConfig(intermediate_size=128, sliding_window=SLIDING_WINDOW, **ATTN)
    if family == "deepseek_v2":  # MLA (q/kv low rank, decoupled rope), 1 leading dense layer
        return tf.DeepseekV2Config(intermediate_size=128, q_lora_rank=32, kv_lora_rank=16,
                                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                   n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                                   moe_intermediate_size=32, first_k_dense_replace=1,
                                   **{**ATTN, "num_key_value_heads": 4})
    raise KeyError(family)


FAMILIES = ["llama", "qwen3_5_text", "qwen3_5_nested", "qwen3_5_moe_text", "qwen3_next",
            "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2", "gemma2", "gemma3_text", "phi3",
            "mistral", "olmo2_generic"]
MOE_FAMILIES = ["qwen3_5_moe_text", "qwen3_next", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2"]
AUX_FAMILIES = MOE_FAMILIES[:-1]  # HF's DeepseekV2ForCausalLM defines no router aux loss
IDLE = 0  # the expert that never receives a token


def _moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """(parameter prefix, mlp) of every MoE layer."""
    return [(f"model.layers.{j}.mlp.", layer.mlp) for j, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts")]


@torch.no_grad()
def _idle_expert_zero(model) -> None:
    """Make expert IDLE unreachable in every MoE layer (see module docstring)."""
    g = torch.Generator().manual_seed(7)
    for _, mlp in _moe_blocks(model):
        router = getattr(mlp, "router", None) or mlp.gate
        if getattr(router, "bias", None) is not None:  # GPT-OSS: top-k on logits + bias
            router.bias[IDLE] = -1e4
            continue
        r1, r2 = torch.randn(2, router.weight.shape[1], generator=g) * 0.5
        router.weight[IDLE] = 0.0  # logit 0; softmax is monotone, so top-k on logits decides
        router.weight[1], router.weight[2] = r1, -r1  # one of each pair has logit > 0
        router.weight[3], router.weight[4] = r2, -r2


def _pair(config, *, idle_expert: bool):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if idle_expert:
        _idle_expert_zero(ref)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.train()
    return ref, adapter_from_model(twin)


def _run(family: str, plan_kind: str, tmp_path, *, idle_expert: bool = False):
    ref, adapter = _pair(family_config(family), idle_expert=idle_expert)
    tiers, keep = PLANS[plan_kind]
    batches = micro_batches(1)  # last row right-padded: exercises the linear-attention mask
    engine = make_engine(adapter, plan_for(adapter, tiers, keep), device="cpu",
                         nvme_dir=tmp_path / "nvme")
    try:
        torch.manual_seed(123)
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, batches)
    return ref, adapter, loss, ref_loss, grads, ref_grads


def _assert_grads_match(grads: dict, ref_grads: dict) -> None:
    assert set(grads) == set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        assert ref is not None, f"reference has no gradient for {name}"
        diff = float((grads[name] - ref).abs().max())
        assert diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3g} (grad scale {scale:.3g})"


@pytest.mark.parametrize("plan_kind", list(PLANS))
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_grads_equal_autograd_for_family(family, plan_kind, tmp_path):
    _, _, loss, ref_loss, grads, ref_grads = _run(family, plan_kind, tmp_path)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_without_tokens_gets_exactly_zero_gradient_in_hf_and_engine(family, tmp_path):
    ref, _, loss, ref_loss, grads, ref_grads = _run(family, "mixed_tiers_keep_last", tmp_path,
                                                    idle_expert=True)
    _assert_grads_match(grads, ref_grads)
    blocks = _moe_blocks(ref)
    assert blocks, "no MoE layer in the tiny config"
    for prefix, mlp in blocks:
        names = [prefix + "experts." + n for n, _ in mlp.experts.named_parameters()]
        for name in names:
            assert torch.count_nonzero(ref_grads[name][IDLE]) == 0, f"HF {name}[{IDLE}]"
            assert torch.count_nonzero(grads[name][IDLE]) == 0, f"engine {name}[{IDLE}]"
        busy = prefix + "experts.down_proj"
        assert torch.count_nonzero(grads[busy][1:]) > 0  # the other experts did train


def test_gpt_oss_layers_keep_their_own_kind_and_window_and_sinks_train(tmp_path):
    ref, adapter, _, _, grads, ref_grads = _run("gpt_oss", "all_recompute_segments_of_2",
                                                tmp_path)
    kinds = [layer_attention_type(b) for b in adapter.blocks]
    assert kinds == ["sliding_attention", "full_attention"] * 2
    assert [layer_sliding_window(b, adapter.config) for b in adapter.blocks] == \
        [SLIDING_WINDOW, None] * 2
    kwargs = adapter.block_kwargs(torch.ones(2, SEQ, dtype=torch.long),
                                  torch.zeros(2, SEQ, HIDDEN))
    assert kwargs[0]["attention_mask"] is kwargs[2]["attention_mask"]
    sliding, full = kwargs[0]["attention_mask"], kwargs[1]["attention_mask"]
    assert not torch.equal(sliding, full)  # SEQ > window: the band differs from causal
    sinks = "model.layers.1.self_attn.sinks"
    assert torch.count_nonzero(grads[sinks]) > 0
    torch.testing.assert_close(grads[sinks], ref_grads[sinks], rtol=1e-5, atol=1e-7)


def test_hybrid_layers_read_linear_or_full_from_each_layer():
    _, adapter = _pair(family_config("qwen3_5_nested"), idle_expert=False)
    assert adapter.config.model_type == "qwen3_5_text"
    assert [layer_attention_type(b) for b in adapter.blocks] == HYBRID
    ids = torch.ones(2, SEQ, dtype=torch.long)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    kwargs = adapter.block_kwargs(ids, torch.zeros(2, SEQ, HIDDEN), attention_mask=mask)
    assert torch.equal(kwargs[0]["attention_mask"], mask)  # linear: the [B, S] padding mask
    assert kwargs[1]["attention_mask"].dim() == 4  # full: a 4D causal + padding mask


AUX_CASES = {f"{f}-mixed_tiers_keep_last": (f, "mixed_tiers_keep_last", 1) for f in AUX_FAMILIES}
AUX_CASES["mixtral-all_recompute_segments_of_2"] = ("mixtral", "all_recompute_segments_of_2", 1)
AUX_CASES["qwen3_moe-grad_accum_2"] = ("qwen3_moe", "mixed_tiers_keep_last", 2)


@pytest.mark.parametrize("case", list(AUX_CASES))
def test_router_aux_loss_is_in_the_loss_and_grads_as_in_hf(case, tmp_path):
    family, plan_kind, n_micro = AUX_CASES[case]
    config = family_config(family)
    config.output_router_logits = True
    config.router_aux_loss_coef = 0.5  # large: the aux share of the gradient is visible
    ref, adapter = _pair(config, idle_expert=False)
    assert adapter.router_aux_enabled
    tiers, keep = PLANS[plan_kind]
    batches = micro_batches(n_micro)  # padded last row: HF weights the aux terms by the mask
    engine = make_engine(adapter, plan_for(adapter, tiers, keep, grad_accum=n_micro), device="cpu",
                         nvme_dir=tmp_path / "nvme", grad_accum=n_micro)
    try:
        loss = engine.compute_gradients(batches)
        grads = {k: v.clone() for k, v in engine.gradients().items()}
    finally:
        engine.close()
    ref_loss, ref_grads = reference_grads(ref, batches)
    ref.config.output_router_logits = False
    no_aux_loss, _ = reference_grads(ref, batches)
    assert ref_loss - no_aux_loss > 1e-3  # HF really added the aux loss
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_router_aux_loss_is_off_by_default_as_in_hf():
    _, adapter = _pair(family_config("mixtral"), idle_expert=False)
    assert not adapter.router_aux_enabled
    assert adapter.new_router_aux(None) is None


def test_gemma3_sliding_and_full_layers_get_their_own_rotary_embedding():
    _, adapter = _pair(family_config("gemma3_text"), idle_expert=False)
    kwargs = adapter.block_kwargs(torch.ones(1, SEQ, dtype=torch.long),
                                  torch.zeros(1, SEQ, HIDDEN))
    local_cos, global_cos = kwargs[0]["position_embeddings"][0], kwargs[1]["position_embeddings"][0]
    assert kwargs[2]["position_embeddings"] is kwargs[0]["position_embeddings"]
    assert not torch.allclose(local_cos, global_cos)  # theta 1e4 vs 1e6


def test_gemma2_embedding_is_scaled_and_logits_soft_capped_as_in_hf():
    ref, adapter = _pair(family_config("gemma2"), idle_expert=False)
    ids = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    weight = adapter.params.ends.views(adapter.params.ends.master)[adapter.embed_name]
    with torch.no_grad():
        torch.testing.assert_close(adapter.embed(ids, weight), ref.model.embed_tokens(ids))
        assert float(ref(ids).logits.abs().max()) <= 3.0  # HF caps at final_logit_softcapping
    assert adapter.logit_softcap == 3.0


@pytest.mark.parametrize("family", ["phi3", "mistral"])
def test_model_wide_sliding_window_gives_every_layer_the_banded_mask(family):
    _, adapter = _pair(family_config(family), idle_expert=False)
    kwargs = adapter.block_kwargs(torch.ones(1, SEQ, dtype=torch.long),
                                  torch.zeros(1, SEQ, HIDDEN))
    mask = kwargs[0]["attention_mask"]
    assert all(k["attention_mask"] is mask for k in kwargs)
    # query 11 sees keys 8..11 only (window 4): HF's bool mask or an additive float mask
    row = mask[0, 0, SEQ - 1]
    visible = row if row.dtype == torch.bool else row == 0
    assert visible.nonzero().flatten().tolist() == list(range(SEQ - SLIDING_WINDOW, SEQ))


def test_gpt2_is_refused_in_one_line_listing_the_supported_families():
    from lazytrain.models.families import resolve_layout
    model = AutoModelForCausalLM.from_config(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2,
                                                           vocab_size=VOCAB, n_positions=32))
    with pytest.raises(ValueError) as err:
        resolve_layout(model)
    message = str(err.value)
    assert "\n" not in message and "'gpt2'" in message and "absolute" in message
    assert all(f in message for f in ("llama", "gemma2", "gemma3_text", "phi3", "qwen3_5"))


def test_relabelled_model_is_not_taken_by_the_generic_path():
    _, adapter = _pair(family_config("olmo2_generic"), idle_expert=False)
    adapter.model.config.model_type = "mamba"
    from lazytrain.models.adapter import ModelAdapter
    with pytest.raises(ValueError, match="supported"):
        ModelAdapter(adapter.model, adapter.params)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_5_nested"])
def test_hf_saved_checkpoint_loads_into_the_store_with_hf_conversion(family, tmp_path):
    from lazytrain.models import load_adapter_from_dir
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    ref.save_pretrained(tmp_path)  # HF writes MoE experts one by one (legacy layout)
    loaded = load_adapter_from_dir(tmp_path)
    assert all(p.device.type == "meta" for p in loaded.blocks[0].parameters())
    master = loaded.params.named_master()
    for name, p in ref.named_parameters():
        assert torch.equal(master[name], p.detach()), name


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "llama"])
def test_a_rank_that_does_not_fill_the_masters_builds_no_model_and_gets_the_same_layout(
        family, tmp_path, monkeypatch):
    """Data parallel with shared masters: local ranks > 0 only map the node's copy, so they
    must not materialize the model (HF's conversion load or a random init: 4 B/param each)."""
    from transformers import AutoModelForCausalLM as Auto

    from lazytrain.models import hf_loader, load_adapter_from_config, load_adapter_from_dir
    torch.manual_seed(0)
    Auto.from_config(family_config(family), dtype=torch.float32).save_pretrained(tmp_path)
    filled = load_adapter_from_dir(tmp_path)

    def refuse(*a, **k):
        raise AssertionError("a non-filling rank built the model")
    monkeypatch.setattr(Auto, "from_pretrained", refuse)
    monkeypatch.setattr(hf_loader, "adapter_from_model", refuse)
    shared = {}

    def alloc(numel, dtype):  # stands for the node's mapping, filled by another process
        shared["flat"] = torch.full((numel,), 7.0, dtype=dtype)
        return shared["flat"]
    for load in (lambda: load_adapter_from_dir(tmp_path, masters=alloc, fills_masters=False),
                 lambda: load_adapter_from_config(family_config(family), masters=alloc,
                                                  fills_masters=False)):
        other = load()
        assert [(g.name, g.slots) for g in other.params.groups] == [
            (g.name, g.slots) for g in filled.params.groups]
        assert all(bool((t == 7.0).all()) for t in other.params.named_master().values())
        assert all(p.device.type == "meta" for p in other.model.parameters())


def test_packed_rows_are_refused_on_linear_attention_layers():
    _, adapter = _pair(family_config("qwen3_5_text"), idle_expert=False)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)  # two documents per row
    with pytest.raises(ValueError, match="linear-attention layers"):
        adapter.block_kwargs(torch.ones(2, SEQ, dtype=torch.long), torch.zeros(2, SEQ, HIDDEN),
                             position_ids=pos)


def test_vision_language_checkpoint_names_map_to_the_text_model(tmp_path):
    from safetensors.torch import load_file, save_file
    from lazytrain.models import load_adapter_from_dir
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(family_config("qwen3_5_nested"), dtype=torch.float32)
    ref.save_pretrained(tmp_path)
    flat = load_file(str(tmp_path / "model.safetensors"))
    vlm = {k.replace("model.", "model.language_model.", 1): v for k, v in flat.items()}
    vlm["model.visual.patch_embed.weight"] = torch.zeros(3)  # vision tower: skipped
    vlm["mtp.fc.weight"] = torch.zeros(2)  # multi-token prediction head: skipped
    save_file(vlm, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_adapter_from_dir(tmp_path)
    master = loaded.params.named_master()
    for name, p in ref.named_parameters():
        assert torch.equal(master[name], p.detach()), name


def test_gemma3_vision_language_checkpoint_loads_its_text_model(tmp_path):
    import json
    from safetensors.torch import load_file, save_file
    from lazytrain.models import load_adapter_from_dir
    torch.manual_seed(0)
    text = family_config("gemma3_text")
    ref = AutoModelForCausalLM.from_config(text, dtype=torch.float32)
    ref.save_pretrained(tmp_path)
    flat = load_file(str(tmp_path / "model.safetensors"))
    vlm = {k.replace("model.", "model.language_model.", 1): v for k, v in flat.items()}
    vlm["model.vision_tower.patch.weight"] = torch.zeros(3)  # vision tower: skipped
    vlm["model.multi_modal_projector.norm.weight"] = torch.zeros(2)
    save_file(vlm, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    nested = tf.Gemma3Config(text_config=text.to_dict()).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(nested))
    loaded = load_adapter_from_dir(tmp_path)
    assert loaded.config.model_type == "gemma3_text"
    master = loaded.params.named_master()
    for name, p in ref.named_parameters():
        assert torch.equal(master[name], p.detach()), name


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "olmo2_generic"])
def test_planner_spec_sees_the_blocks_the_engine_runs(family):
    """The planner's per-block kinds and parameter counts (spec/model.py, parsed from the config
    JSON) equal what the adapter streams: the same layer kinds, sliding windows and
    experts, per layer."""
    from lazytrain.spec.model import ModelSpec
    config = family_config(family)
    _, adapter = _pair(config, idle_expert=False)
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert [b.params for b in spec.blocks] == [g.numel for g in adapter.params.blocks]
    for block, layer in zip(spec.blocks, adapter.blocks):
        kind, window = layer_mask_key(layer, adapter.config, adapter.layout)
        if block.attention != "mla":
            assert block.attention == kind, block.index
        assert block.mlp == ("moe" if hasattr(layer.mlp, "experts") else "dense"), block.index
        assert block.sliding_window == (window or 0)
