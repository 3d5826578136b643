"""Tiny Hugging Face MoE models (no downloads) and comparison helpers for the pattern-pass tests.

Every model is built from a small config with fresh seeded random weights; `num_moe_blocks` says how many
sparse MoE blocks the model has (the pass must replace exactly that many).
"""

from __future__ import annotations

import torch

VOCAB = 64
SEQ = (2, 5)  # batch 2, 5 tokens: T = 10 tokens per MoE block


def _common(**kw):
    # one decoder layer: each case is one Dynamo trace of the whole model, and its cost grows with the layers
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    base.update(kw)
    return base


def build(name: str, impl: str, dtype: torch.dtype, seed: int = 0, **overrides):
    """-> (model, number of MoE blocks)."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "mixtral":
        cfg = tf.MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2, head_dim=16, **overrides))
        cls, n = tf.MixtralForCausalLM, cfg.num_hidden_layers
    elif name == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**_common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=24, **overrides))
        cls, n = tf.Qwen2MoeForCausalLM, cfg.num_hidden_layers
    elif name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**_common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          head_dim=16, **overrides))
        cls, n = tf.Qwen3MoeForCausalLM, cfg.num_hidden_layers
    elif name == "olmoe":
        cfg = tf.OlmoeConfig(**_common(num_experts=4, num_experts_per_tok=2, **overrides))
        cls, n = tf.OlmoeForCausalLM, cfg.num_hidden_layers
    elif name == "glm4_moe":
        cfg = tf.Glm4MoeConfig(**_common(num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                                         n_group=1, topk_group=1, head_dim=16, **overrides))
        cls, n = tf.Glm4MoeForCausalLM, cfg.num_hidden_layers - 1  # layer 0 is dense
    elif name == "gpt_oss":  # experts with biases, interleaved gate/up and [E, in, out] weights (activation "gpt_oss")
        cfg = tf.GptOssConfig(**_common(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, head_dim=16,
                                        layer_types=["full_attention"], sliding_window=8,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **overrides))
        cls, n = tf.GptOssForCausalLM, cfg.num_hidden_layers
    else:
        raise ValueError(name)
    model = cls._from_config(cfg, experts_implementation=impl, dtype=dtype)
    with torch.no_grad():  # HF inits some tensors (e.g. score-correction biases) to zeros: randomise all
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, n


MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe")  # gpt_oss: its own tests (test_patterns_graphs.py)


def loss_and_grads(model, ids, dy_seed: int = 1):
    """Forward logits and the gradients of <logits, random dy> for every parameter."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    g = torch.Generator().manual_seed(dy_seed)
    dy = torch.randn(logits.shape, generator=g).to(logits.dtype)
    (logits * dy).sum().backward()
    return logits.detach(), {k.replace("_orig_mod.", ""): p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def traces_sentinel_handling(impl: str) -> bool:
    """Whether this transformers' `impl` ("grouped_mm" / "batched_mm") experts function applies its
    expert-parallel sentinel handling always (transformers 5.17: grouped_mm's masks and in-place clamp,
    batched_mm's clamp) instead of only under `self._is_expert_parallel` (5.23). The traced graph, and so the
    rewritten one (which maps `top_experts` the same way), differs between the two."""
    import inspect

    from transformers.integrations import moe

    return "_is_expert_parallel" not in inspect.getsource(getattr(moe, f"{impl}_experts_forward"))
