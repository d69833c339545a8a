"""The pure arithmetic of a model's needs (gpud.core.sizing), on hand-made tensor lists and
configs whose figures are worked out here."""

from __future__ import annotations

from typing import Any

import pytest

from gpud.core.modelconfig import text_config
from gpud.core.sizing import (
    MIB,
    NotApplicable,
    Tensor,
    Unknown,
    kv_cache,
    model_dtype,
    need,
    shortfall,
    weights,
)
from gpud.core.vllm_versions import V034, behaviour
from tests.checkpoints import LLAMA_CONFIG, llama_tensors

# LLAMA_CONFIG's parameters: embedding and LM head 1000 x 256 each (vLLM pads to 1024 rows),
# per layer q 256x256, k and v 128x256, o 256x256, MLP 3 x 512x256, two norms of 256.
LINEAR = 2 * (256 * 256 * 2 + 128 * 256 * 2 + 3 * 512 * 256)
NORMS = 2 * 2 * 256 + 256
VOCAB = 1024 * 256  # padded rows
ROPE = 4096 * 64  # the cos/sin cache: max_position_embeddings x head_dim


def tensors(dtype: str = "BF16", cfg: dict[str, Any] = LLAMA_CONFIG) -> list[Tensor]:
    return [Tensor(n, d, tuple(s)) for n, (d, s) in llama_tensors(dtype, cfg).items()]


@pytest.mark.parametrize(("stored", "config_dtype", "width"), [
    ("BF16", "bfloat16", 2), ("F16", "float16", 2), ("F32", "float32", 2),
])
def test_unquantized_weights_in_the_model_dtype(stored: str, config_dtype: str,
                                                width: int) -> None:
    """fp32 checkpoints run in bf16 (vLLM's auto dtype downcasts them); the embedding and LM
    head padded to 64 rows."""
    cfg = {**LLAMA_CONFIG, "dtype": config_dtype}
    w = weights(tensors(stored, cfg), cfg)
    assert w.bytes == (LINEAR + NORMS + 2 * VOCAB + ROPE) * width
    assert w.dtype == ("float16" if config_dtype == "float16" else "bfloat16")
    assert not w.estimate
    assert weights(tensors(stored, cfg), cfg, dtype_arg="float32").bytes == \
        (LINEAR + NORMS + 2 * VOCAB + ROPE) * 4


def test_a_tied_lm_head_is_the_embedding() -> None:
    cfg = {**LLAMA_CONFIG, "tie_word_embeddings": True}
    ts = [*tensors("BF16", cfg), Tensor("lm_head.weight", "BF16", (1000, 256))]
    assert weights(ts, cfg).bytes == (LINEAR + NORMS + VOCAB + ROPE) * 2


def test_online_fp8_quantizes_the_linear_layers_only() -> None:
    w = weights(tensors(), LLAMA_CONFIG, quantization="fp8_per_tensor")
    linear_layers = 2 * 7  # one fp32 scale each
    assert w.bytes == LINEAR + linear_layers * 4 + (NORMS + 2 * VOCAB + ROPE) * 2
    assert w.estimate and "online fp8_per_tensor (estimate)" in w.how
    with pytest.raises(NotApplicable, match=r"'fp8' does not apply to an unquantized .* use "
                                            "fp8_per_tensor"):
        weights(tensors(), LLAMA_CONFIG, quantization="fp8")
    with pytest.raises(Unknown, match="does not estimate it"):
        weights(tensors(), LLAMA_CONFIG, quantization="bitsandbytes")


def test_a_pre_quantized_checkpoint_counts_as_stored() -> None:
    """An FP8-Dynamic layout: linear weights F8_E4M3 with an F32 scale per row, embeddings and
    LM head left bf16 by the recipe; the serve's quantization does not change it, and one
    that names another method does not apply (vLLM refuses it)."""
    cfg = {**LLAMA_CONFIG, "quantization_config": {"quant_method": "compressed-tensors"}}
    ts: list[Tensor] = []
    for t in tensors():
        if t.name.endswith("proj.weight"):
            ts += [Tensor(t.name, "F8_E4M3", t.shape),
                   Tensor(t.name + "_scale", "F32", (t.shape[0], 1))]
        else:
            ts.append(t)
    scales = 2 * (256 + 128 + 128 + 256 + 512 + 512 + 256) * 4
    for q in (None, "compressed-tensors"):
        w = weights(ts, cfg, quantization=q)
        assert w.bytes == LINEAR + scales + (NORMS + 2 * VOCAB + ROPE) * 2
        assert "pre-quantized: compressed-tensors" in w.how and not w.estimate
    with pytest.raises(NotApplicable, match="'fp8' does not apply: the checkpoint is "
                                            "pre-quantized \\(compressed-tensors"):
        weights(ts, cfg, quantization="fp8")
    gptq = {**LLAMA_CONFIG, "quantization_config": {"quant_method": "gptq"}}
    assert weights(ts, gptq, quantization="gptq_marlin").bytes == w.bytes  # vLLM's override


def test_tensor_parallel_splits_the_weights() -> None:
    one = weights(tensors(), LLAMA_CONFIG)
    assert weights(tensors(), LLAMA_CONFIG, devices=2).bytes == -(-one.bytes // 2)


def test_kv_per_token_from_the_config() -> None:
    kv = kv_cache(LLAMA_CONFIG)
    # 2 layers x K and V x 2 KV heads x 64 x 2 bytes
    assert kv.per_token_bytes == 2 * 2 * 2 * 64 * 2 == 1024
    # whole blocks of 16 tokens, and the null block vLLM's pool keeps (0.33's rules)
    assert kv.bytes_for(1000) == (1008 + 16) * 1024
    # vLLM 0.34's blocks are 64 tokens: 16 of them for 1000 tokens, and the null block
    assert kv.bytes_for(1000, behaviour(V034).kv) == 17 * 64 * 1024
    assert kv_cache(LLAMA_CONFIG, cache_dtype="fp8").per_token_bytes == 512
    assert kv_cache({**LLAMA_CONFIG, "dtype": "float32"}).per_token_bytes == 1024  # bf16
    no_kv_heads = {k: v for k, v in LLAMA_CONFIG.items()
                   if k not in ("num_key_value_heads", "head_dim")}
    assert kv_cache(no_kv_heads).per_token_bytes == 2 * 2 * 4 * 64 * 2
    assert kv_cache(LLAMA_CONFIG, devices=2).per_token_bytes == 512


def test_sliding_window_and_hybrid_layers() -> None:
    hybrid = {**LLAMA_CONFIG, "num_hidden_layers": 6, "sliding_window": 512,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    kv = kv_cache(hybrid)
    layer = 2 * 2 * 64 * 2
    assert (kv.full_layers, kv.sliding_layers, kv.window) == (1, 5, 512)
    # 1 full and 5 sliding layers: groups of one layer (5 >= 1.5 x 1), 1 full and 5 sliding;
    # a sliding group holds the window - 1 + 2 batches of 2048 in flight (async scheduling),
    # in blocks, plus one block; and the null block (a block is one layer's 16 tokens)
    assert kv.groups() == (1, 1, 5)
    held = -(-(511 + 2 * 2048) // 16) + 1
    assert kv.blocks_per_request(32768) == 2048 + 5 * held
    assert kv.bytes_for(32768) == (2048 + 5 * held + 1) * 16 * layer
    # never more than the sequence, plus the block a window may straddle
    assert kv.bytes_for(256) == (16 + 5 * 17 + 1) * 16 * layer
    # fewer in flight (--max-num-batched-tokens 512): fewer blocks held in the window
    assert kv.blocks_per_request(32768, batched_tokens=512) == 2048 + 5 * (
        -(-(511 + 1024) // 16) + 1)
    mistral = {**LLAMA_CONFIG, "sliding_window": 4096}
    assert kv_cache(mistral).sliding_layers == 2
    qwen = {**LLAMA_CONFIG, "sliding_window": 4096, "use_sliding_window": False}
    assert kv_cache(qwen).sliding_layers == 0
    shared = {**hybrid, "num_kv_shared_layers": 2}
    kv = kv_cache(shared)
    assert (kv.full_layers, kv.sliding_layers) == (0, 4)
    assert "2 layers share" in kv.note
    linear = {**LLAMA_CONFIG, "num_hidden_layers": 4,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    kv = kv_cache(linear)
    assert (kv.full_layers, kv.sliding_layers) == (1, 0) and "3 non-attention" in kv.note


def test_the_rope_cache_follows_the_rotary_dim() -> None:
    from gpud.core.sizing import rope_cache_bytes

    assert rope_cache_bytes(LLAMA_CONFIG, 2) == ROPE * 2
    assert rope_cache_bytes({**LLAMA_CONFIG, "partial_rotary_factor": 0.5}, 2) == ROPE
    assert rope_cache_bytes({"num_attention_heads": 8, "max_position_embeddings": 10,
                             "qk_rope_head_dim": 64, "head_dim": 192}, 2) == 10 * 64 * 2
    assert rope_cache_bytes({"num_attention_heads": 8}, 2) == 0


def test_mla_and_multimodal_nesting() -> None:
    mla = {"num_hidden_layers": 3, "num_attention_heads": 16, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "dtype": "bfloat16"}
    assert kv_cache(mla).per_token_bytes == 3 * 576 * 2
    nested = {"model_type": "gemma3", "text_config": LLAMA_CONFIG, "vision_config": {}}
    assert text_config(nested) is LLAMA_CONFIG
    assert kv_cache(nested).per_token_bytes == 1024
    assert model_dtype(nested) == "bfloat16"


def test_the_minimum_and_what_fits_instead() -> None:
    w = weights(tensors(), LLAMA_CONFIG)
    kv = kv_cache(LLAMA_CONFIG)
    n = need(w, kv, 4096, 512)
    # 4096 tokens x 1024 bytes and the null block (16 KiB): 5 MiB, rounded up
    assert (n.weights_mib, n.kv_mib, n.context_mib) == (w.mib, 5, 512)
    assert n.minimum_mib == w.mib + 5 + 512
    assert shortfall(n.minimum_mib, n, kv) is None
    why = shortfall(n.minimum_mib - 2, n, kv)
    assert why is not None and f"set vram_mib >= {n.minimum_mib}" in why
    # 3 MiB of KV room left: 3072 tokens at 1024 bytes a token, less the null block's 16
    assert "max_model_len <= 3056" in why
    why = shortfall(w.mib, n, kv)
    assert why is not None and "no shorter max_model_len fits" in why
    assert need(w, kv, 4096, 512, kv_cache_mib=100).kv_mib == 100
    assert kv.longest_fitting(3 * MIB, 1 << 20) == 3056


def test_gemma4_s_wider_full_layers_and_unified_pages() -> None:
    """Gemma 4's full-attention layers: global_head_dim (512 when its config.json omits it),
    num_global_key_value_heads only with attention_k_eq_v; transformers 5 writes them as
    per_layer_config instead. Pages of different sizes are unified as vLLM does: the
    smaller kind's blocks made longer."""
    types = ["sliding_attention"] * 3 + ["full_attention"]
    g4 = {"model_type": "gemma4_text", "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "layer_types": types,
          "sliding_window": 128, "dtype": "bfloat16"}
    assert kv_cache(g4).full_bytes == 2 * 2 * 512 * 2  # the default global_head_dim
    assert kv_cache({**g4, "global_head_dim": 128}).full_bytes == 2 * 2 * 128 * 2
    # the kv-head override is gated by attention_k_eq_v
    assert kv_cache({**g4, "global_head_dim": 128, "num_global_key_value_heads": 1}
                    ).full_bytes == 2 * 2 * 128 * 2
    assert kv_cache({**g4, "global_head_dim": 128, "num_global_key_value_heads": 1,
                     "attention_k_eq_v": True}).full_bytes == 2 * 1 * 128 * 2
    written = {**g4, "per_layer_config": {"3": {"head_dim": 128}}}
    kv = kv_cache(written)
    assert (kv.full_bytes, kv.layer_bytes_per_token) == (1024, 512)
    assert kv.per_token_bytes == 1024 + 3 * 512
    # pages: a full layer's 16 x 1024, a sliding layer's 16 x 512 made 32 tokens long
    assert kv.pages() == (16384, 16, 32)
    # groups of 1 layer (3 >= 1.5 x 1): a block is one 16 KiB page
    assert kv.block_bytes() == 16384
    # a sliding layer: the window - 1 and two batches of 2048, at most the 4096 of a sequence
    assert kv.blocks_per_request(4096) == 256 + 3 * (-(-min(127 + 2 * 2048, 4096) // 32) + 1)
    # the same widths everywhere: nothing changes
    assert kv_cache(LLAMA_CONFIG).full_layer_bytes_per_token is None
