"""Shapes from a model config: published values of real models, numbers checked by hand.

The configs below copy the fields that matter from each model's published config.json (no
download). Expected (N, K) are worked out by hand in the comments, not by the code under test.
"""

from __future__ import annotations

import json

import pytest

from fp4select.model_shapes import ModelConfigError, model_shapes, shapes_from_path

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "head_dim": 128,
    "model_type": "llama",
}
LLAMA_31_70B = dict(
    LLAMA_31_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_hidden_layers=80,
)
QWEN25_7B = {  # no head_dim: 3584 / 28 = 128
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
}
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 64,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
QWEN35_397B = {  # nested as published: Qwen3_5MoeForConditionalGeneration + text_config
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 4096,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "attn_output_gate": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
}
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "experts_per_token": 4,
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
MISTRAL_7B = dict(LLAMA_31_8B, architectures=["MistralForCausalLM"])
del MISTRAL_7B["head_dim"]  # Mistral-7B-v0.3 has none: 4096 / 32 = 128


def table(config, tp=1, quant=None):
    return {(x.name, x.n, x.k, x.count, x.split) for x in model_shapes(config, quant, tp=tp).layers}


def test_llama_31_8b_tp1_by_hand():
    # QKV: (32 + 2*8) heads * 128 = 6144; gate_up: 2 * 14336 = 28672.
    assert table(LLAMA_31_8B) == {
        ("self_attn.qkv_proj", 6144, 4096, 32, "N"),
        ("self_attn.o_proj", 4096, 4096, 32, "K"),
        ("mlp.gate_up_proj", 28672, 4096, 32, "N"),
        ("mlp.down_proj", 4096, 14336, 32, "K"),
    }


def test_llama_31_8b_tp8_splits_columns_by_n_and_rows_by_k():
    # Per rank: 4 q heads + 1 k + 1 v = 6 * 128 = 768; o: K = 4 * 128 = 512;
    # gate_up: 28672 / 8 = 3584; down: K = 14336 / 8 = 1792.
    assert table(LLAMA_31_8B, tp=8) == {
        ("self_attn.qkv_proj", 768, 4096, 32, "N"),
        ("self_attn.o_proj", 4096, 512, 32, "K"),
        ("mlp.gate_up_proj", 3584, 4096, 32, "N"),
        ("mlp.down_proj", 4096, 1792, 32, "K"),
    }
    assert model_shapes(LLAMA_31_8B, tp=8).shapes() == [
        (768, 4096),
        (4096, 512),
        (3584, 4096),
        (4096, 1792),
    ]


def test_mistral_without_head_dim_matches_llama():
    assert table(MISTRAL_7B) == table(LLAMA_31_8B)


def test_llama_70b_kv_heads_replicate_beyond_their_count():
    # tp=8: 8 q + 1 k + 1 v heads = 1280. tp=16: 4 q + the 8 KV heads replicated, one per rank
    # (1 k + 1 v) = 6 * 128 = 768.
    assert ("self_attn.qkv_proj", 1280, 8192, 80, "N") in table(LLAMA_31_70B, tp=8)
    assert ("self_attn.qkv_proj", 768, 8192, 80, "N") in table(LLAMA_31_70B, tp=16)
    assert ("self_attn.o_proj", 8192, 512, 80, "K") in table(LLAMA_31_70B, tp=16)


def test_qwen25_derives_head_dim_and_refuses_an_indivisible_tp():
    # (28 + 2*4) * 128 = 4608; tp=2: (14 + 2*2) * 128 = 2304.
    assert ("self_attn.qkv_proj", 4608, 3584, 28, "N") in table(QWEN25_7B)
    assert ("self_attn.qkv_proj", 2304, 3584, 28, "N") in table(QWEN25_7B, tp=2)
    with pytest.raises(
        ModelConfigError, match="num_attention_heads = 28 is not divisible by tp = 8"
    ):
        model_shapes(QWEN25_7B, tp=8)


def test_qwen3_32b_uses_its_explicit_head_dim():
    # q is 64 * 128 = 8192 wide, not the hidden size 5120: (64 + 16) * 128 = 10240.
    assert table(QWEN3_32B) == {
        ("self_attn.qkv_proj", 10240, 5120, 64, "N"),
        ("self_attn.o_proj", 5120, 8192, 64, "K"),
        ("mlp.gate_up_proj", 51200, 5120, 64, "N"),
        ("mlp.down_proj", 5120, 25600, 64, "K"),
    }


def test_qwen3_moe_keeps_attention_and_leaves_routed_experts_out():
    shapes = model_shapes(QWEN3_30B_A3B)
    # (32 + 8) * 128 = 5120; o: K = 32 * 128 = 4096. No dense MLP: every layer is sparse.
    assert table(QWEN3_30B_A3B) == {
        ("self_attn.qkv_proj", 5120, 2048, 48, "N"),
        ("self_attn.o_proj", 2048, 4096, 48, "K"),
    }
    assert any("routed MoE experts are left out" in n for n in shapes.notes)
    assert any("router gates" in n for n in shapes.notes)


def test_qwen3_moe_mlp_only_layers_are_dense():
    config = dict(QWEN3_30B_A3B, mlp_only_layers=[0, 1])
    assert ("mlp.gate_up_proj", 12288, 2048, 2, "N") in table(config)


def test_qwen35_hybrid_tp1_by_hand():
    # 60 layers, every 4th full attention: 15 full, 45 linear.
    # full: q with output gate 32*256*2 = 16384, + k, v 2*2*256 = 1024 -> 17408; o K = 8192.
    # linear: qkvz 2*(16*128) + 2*(64*128) = 4096 + 16384 = 20480; ba 2*64 = 128;
    #         out_proj K = 64*128 = 8192. Shared expert 1024: gate_up 2048, down K 1024.
    assert table(QWEN35_397B) == {
        ("self_attn.qkv_proj", 17408, 4096, 15, "N"),
        ("self_attn.o_proj", 4096, 8192, 15, "K"),
        ("linear_attn.in_proj_qkvz", 20480, 4096, 45, "N"),
        ("linear_attn.in_proj_ba", 128, 4096, 45, "N"),
        ("linear_attn.out_proj", 4096, 8192, 45, "K"),
        ("mlp.shared_expert.gate_up_proj", 2048, 4096, 60, "N"),
        ("mlp.shared_expert.down_proj", 4096, 1024, 60, "K"),
    }


def test_qwen35_hybrid_tp8_by_hand():
    # full: 4 q heads * 256 * 2 = 2048 + the 2 KV heads replicated (1 k + 1 v) * 256 = 2560;
    #       o K = 4 * 256 = 1024.
    # linear: 2 key heads, 8 value heads: 2*256 + 2*1024 = 2560; ba 2*8 = 16; out K = 1024.
    # shared expert: 1024 / 8 = 128 -> gate_up 256, down K 128.
    assert table(QWEN35_397B, tp=8) == {
        ("self_attn.qkv_proj", 2560, 4096, 15, "N"),
        ("self_attn.o_proj", 4096, 1024, 15, "K"),
        ("linear_attn.in_proj_qkvz", 2560, 4096, 45, "N"),
        ("linear_attn.in_proj_ba", 16, 4096, 45, "N"),
        ("linear_attn.out_proj", 4096, 1024, 45, "K"),
        ("mlp.shared_expert.gate_up_proj", 256, 4096, 60, "N"),
        ("mlp.shared_expert.down_proj", 4096, 128, 60, "K"),
    }
    assert any("vision tower is left out" in n for n in model_shapes(QWEN35_397B).notes)


def test_qwen35_exclude_list_with_the_multimodal_prefix():
    # A checkpoint that keeps linear attention in BF16, named as the multimodal model names it.
    quant = {
        "quantization": {
            "quant_algo": "NVFP4",
            "exclude_modules": ["lm_head", "model.language_model.layers.*.linear_attn*"],
        }
    }
    rows = table(QWEN35_397B, quant=quant)
    assert not any(r[0].startswith("linear_attn.") for r in rows)
    assert ("self_attn.qkv_proj", 17408, 4096, 15, "N") in rows


def test_qwen35_split_checkpoint_parts_must_agree():
    quant = {
        "quantization": {
            "quant_algo": "NVFP4",
            "exclude_modules": ["model.language_model.layers.*.linear_attn.in_proj_z"],
        }
    }
    with pytest.raises(ModelConfigError, match=r"in_proj_qkvz.*must agree"):
        model_shapes(QWEN35_397B, quant)


def test_deepseek_v3_tp1_by_hand():
    # fused q_a + kv_a: 1536 + 512 + 64 = 2112 (replicated); q_b: 128 * (128 + 64) = 24576;
    # kv_b: 128 * (128 + 128) = 32768; o: K = 128 * 128 = 16384.
    # 3 dense layers: gate_up 2 * 18432 = 36864; 58 MoE layers, 1 shared expert of 2048.
    assert table(DEEPSEEK_V3) == {
        ("self_attn.fused_qkv_a_proj_with_mqa", 2112, 7168, 61, "none"),
        ("self_attn.q_b_proj", 24576, 1536, 61, "N"),
        ("self_attn.kv_b_proj", 32768, 512, 61, "N"),
        ("self_attn.o_proj", 7168, 16384, 61, "K"),
        ("mlp.gate_up_proj", 36864, 7168, 3, "N"),
        ("mlp.down_proj", 7168, 18432, 3, "K"),
        ("mlp.shared_experts.gate_up_proj", 4096, 7168, 58, "N"),
        ("mlp.shared_experts.down_proj", 7168, 2048, 58, "K"),
    }
    notes = " ".join(model_shapes(DEEPSEEK_V3).notes)
    assert "kv_b_proj" in notes and "MTP" in notes


def test_deepseek_v3_tp8_by_hand():
    # 16 heads per rank: q_b 16 * 192 = 3072; kv_b 16 * 256 = 4096; o K 16 * 128 = 2048.
    # dense gate_up 36864 / 8 = 4608, down K 18432 / 8 = 2304; shared gate_up 512, down K 256.
    assert table(DEEPSEEK_V3, tp=8) == {
        ("self_attn.fused_qkv_a_proj_with_mqa", 2112, 7168, 61, "none"),
        ("self_attn.q_b_proj", 3072, 1536, 61, "N"),
        ("self_attn.kv_b_proj", 4096, 512, 61, "N"),
        ("self_attn.o_proj", 7168, 2048, 61, "K"),
        ("mlp.gate_up_proj", 4608, 7168, 3, "N"),
        ("mlp.down_proj", 7168, 2304, 3, "K"),
        ("mlp.shared_experts.gate_up_proj", 512, 7168, 58, "N"),
        ("mlp.shared_experts.down_proj", 7168, 256, 58, "K"),
    }


def test_deepseek_attention_excluded_by_a_modelopt_list():
    quant = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*", "lm_head"]}}
    rows = table(DEEPSEEK_V3, quant=quant)
    assert {r[0] for r in rows} == {
        "mlp.gate_up_proj",
        "mlp.down_proj",
        "mlp.shared_experts.gate_up_proj",
        "mlp.shared_experts.down_proj",
    }


def test_gpt_oss_published_mxfp4_config_has_no_dense_fp4_layer():
    shapes = model_shapes(GPT_OSS_120B)
    assert shapes.layers == [] and shapes.format == "mxfp4"
    assert any("only the MoE experts" in n for n in shapes.notes)


def test_gpt_oss_attention_when_requantized_to_nvfp4():
    config = {k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"}
    quant = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    # (64 + 2*8) * 64 = 5120; o: K = 64 * 64 = 4096.
    assert table(config, quant=quant) == {
        ("self_attn.qkv_proj", 5120, 2880, 36, "N"),
        ("self_attn.o_proj", 2880, 4096, 36, "K"),
    }


def test_mixtral_attention_only():
    assert table(MIXTRAL_8X7B) == {
        ("self_attn.qkv_proj", 6144, 4096, 32, "N"),
        ("self_attn.o_proj", 4096, 4096, 32, "K"),
    }


def test_compressed_tensors_ignore_regex_and_format():
    config = dict(
        LLAMA_31_8B,
        quantization_config={
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "ignore": ["lm_head", "re:.*mlp\\.down_proj$"],
            "config_groups": {
                "group_0": {
                    "weights": {"num_bits": 4, "type": "float", "group_size": 16},
                    "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
                    "targets": ["Linear"],
                }
            },
        },
    )
    rows = table(config)
    assert {r[0] for r in rows} == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"}
    assert model_shapes(config).format == "nvfp4"


def test_weight_only_fp4_is_refused_with_the_reason():
    config = dict(
        LLAMA_31_8B,
        quantization_config={
            "quant_method": "compressed-tensors",
            "config_groups": {
                "group_0": {
                    "weights": {"num_bits": 4, "type": "float", "group_size": 16},
                    "input_activations": None,
                }
            },
        },
    )
    with pytest.raises(ModelConfigError, match="W4A16"):
        model_shapes(config)


def test_fp8_checkpoint_is_refused():
    quant = {"quantization": {"quant_algo": "FP8", "exclude_modules": []}}
    with pytest.raises(ModelConfigError, match="'FP8': not an FP4"):
        model_shapes(LLAMA_31_8B, quant)


def test_mixed_precision_lists_fp4_layers():
    layers = {
        f"model.layers.{i}.mlp.{p}": {"quant_algo": "NVFP4"}
        for i in range(32)
        for p in ("gate_proj", "up_proj")
    }
    layers["model.layers.0.mlp.down_proj"] = {"quant_algo": "FP8"}
    quant = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    assert table(LLAMA_31_8B, quant=quant) == {("mlp.gate_up_proj", 28672, 4096, 32, "N")}


def test_fused_parts_that_disagree_are_an_error():
    quant = {
        "quantization": {
            "quant_algo": "NVFP4",
            "exclude_modules": ["model.layers.3.self_attn.k_proj"],
        }
    }
    with pytest.raises(ModelConfigError, match=r"layer 3 self_attn\.qkv_proj"):
        model_shapes(LLAMA_31_8B, quant)


def test_whole_layer_excluded_by_a_parent_name():
    quant = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["model.layers.0"]}}
    rows = table(LLAMA_31_8B, quant=quant)
    assert ("self_attn.qkv_proj", 6144, 4096, 31, "N") in rows


def test_unknown_architecture_names_it_and_the_known_ones():
    with pytest.raises(
        ModelConfigError, match=r"'FalconForCausalLM' is not known.*LlamaForCausalLM"
    ):
        model_shapes({"architectures": ["FalconForCausalLM"], "hidden_size": 4544})


def test_missing_architectures_is_an_error():
    with pytest.raises(ModelConfigError, match="no 'architectures'"):
        model_shapes({"hidden_size": 4096})


def test_missing_field_is_named():
    config = {k: v for k, v in LLAMA_31_8B.items() if k != "intermediate_size"}
    with pytest.raises(
        ModelConfigError, match="LlamaForCausalLM: config lacks 'intermediate_size'"
    ):
        model_shapes(config)
    config = {k: v for k, v in QWEN35_397B["text_config"].items() if k != "linear_num_key_heads"}
    with pytest.raises(ModelConfigError, match="lacks 'linear_num_key_heads'"):
        model_shapes({"architectures": ["Qwen3_5MoeForCausalLM"], **config})


@pytest.mark.parametrize("tp", [0, -1, 1.5, True])
def test_bad_tp(tp):
    with pytest.raises(ModelConfigError, match="tp must be a positive int"):
        model_shapes(LLAMA_31_8B, tp=tp)


def test_reads_a_folder_with_hf_quant_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]},
            }
        )
    )
    by_folder = shapes_from_path(tmp_path, tp=8)
    by_file = shapes_from_path(tmp_path / "config.json", tp=8)
    assert by_folder.to_json() == by_file.to_json()
    assert by_folder.quantization.startswith("hf_quant_config.json")
    assert (4608, 7168) in by_folder.shapes() and (3072, 1536) not in by_folder.shapes()


def test_bad_paths_and_files(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist"):
        shapes_from_path(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match=r"without config\.json"):
        shapes_from_path(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="expected a JSON object, found array"):
        shapes_from_path(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        shapes_from_path(tmp_path)
