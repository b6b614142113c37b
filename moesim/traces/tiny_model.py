"""Tiny random-weight MoE models of every supported family, built from transformers config
classes and saved to a local folder with a small word-level tokenizer (no hub access): what
``moesim tiny-model`` writes, for trying ``moesim capture`` on a CPU. The tokenizer knows the
words ``w0`` .. ``w60`` (others read as ``<unk>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(61)]


def configs() -> dict[str, Any]:
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
              "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}
    return {
        "olmoe": tf.OlmoeConfig(**common, intermediate_size=16, num_key_value_heads=4, num_experts=8,
                                num_experts_per_tok=2),
        "mixtral": tf.MixtralConfig(**common, intermediate_size=16, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**common, intermediate_size=16, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16, num_key_value_heads=4, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=False),
        "qwen3_moe": tf.Qwen3MoeConfig(**common, intermediate_size=16, moe_intermediate_size=16,  # type: ignore[call-arg]
                                       num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, head_dim=8,
                                       norm_topk_prob=True),
        "deepseek_v2": tf.DeepseekV2Config(**common, intermediate_size=16, moe_intermediate_size=16,
                                           num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                                           q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4),
        "deepseek_v3": tf.DeepseekV3Config(**common, intermediate_size=16, moe_intermediate_size=16,
                                           num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                                           q_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4,
                                           n_group=2, topk_group=1),
        "phimoe": tf.PhimoeConfig(**common, intermediate_size=16, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2),
        "gpt_oss": tf.GptOssConfig(**common, intermediate_size=16, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2, head_dim=8),
    }


def build(model_type: str, folder: Path, seed: int = 0) -> Path:
    """Save a tiny random model of ``model_type`` (a key of :func:`configs`) and a tokenizer
    to ``folder``: 3 layers, hidden size 32, 8 experts top-2 (Mixtral, Phi-MoE, GPT-OSS: 4)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(seed)
    cfg = configs()[model_type]
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # routers start at zero in some families: give them real weights
        for name, p in model.named_parameters():
            if "gate" in name or "router" in name or "correction_bias" in name:
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(folder)
    return folder
