"""Run by .venv-vllm's interpreter (transformers, torch and the CPU build of vLLM), never
imported by the tests: `make DIR DTYPE [DIR DTYPE...]` writes small random Llama checkpoints
offline in those dtypes; `load DIR...` loads each in turn with real vLLM, in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: one start's imports for all), and prints, one JSON line each,
the bytes of the parameters and buffers of the model vLLM built. `make-shapes OUT` writes the KV
cache shapes (SHAPES: grouped KV heads, tied embeddings, a sliding window, a hybrid of sliding
and full layers whose last ones share the cache, MLA) and `kv BUDGET MAX_MODEL_LEN BATCHED
DIR...` starts each with a KV budget of BUDGET bytes (--kv-cache-memory-bytes) and prints what
vLLM says that holds (its `KV cache size: N tokens` and maximum concurrency, set on
cache_config by update_kv_cache_capacity).

The CPU build does not log `Model loading took X GiB` (vllm/v1/worker/cpu_model_runner.py:62
load_model logs only "Starting to load model"; the line is the GPU runners':
vllm/v1/worker/gpu_model_runner.py:5150): the bytes of the loaded module are what that line
measures on a GPU, less the allocator's rounding.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

# the checkpoint: GQA (8 heads, 4 KV heads), a vocabulary vLLM pads (1000 -> 1024), untied
CONFIG = {"vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1024,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False}


def make(out: str, dtype: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.config.torch_dtype = getattr(torch, dtype)
    model.save_pretrained(out)


# The KV shapes (tests/vllm/test_sizing_vllm.py): each small, head_dim 64 (the CPU build refuses
# 16), a context of 16384 so that a sliding window (256) is far shorter than a sequence.
SHAPES: dict[str, dict[str, Any]] = {
    "dense-gqa": {"arch": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
                  "num_key_value_heads": 2},
    "tied": {"arch": "llama", "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 1, "tie_word_embeddings": True},
    "sliding": {"arch": "mistral", "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 2, "sliding_window": 256},
    # Gemma 4's layout: sliding and full layers (a hybrid), the full ones wider
    # (global_head_dim), the last two sharing earlier layers' cache (num_kv_shared_layers)
    "hybrid-shared": {"arch": "gemma4", "num_hidden_layers": 8, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "global_head_dim": 128, "sliding_window": 256,
                      "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
                      "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
                      "vocab_size_per_layer_input": 1000, "pad_token_id": 0},
    # DeepSeek-V2's attention: the CPU build's MLA kernel takes kv_lora_rank 512 + rope 64 only
    # (vllm/v1/attention/backends/mla/cpu_mla.py:24-25, 61-64 of 0.32.0); every layer dense
    "mla": {"arch": "deepseek_v2", "num_hidden_layers": 2, "num_attention_heads": 4,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
            "v_head_dim": 64, "q_lora_rank": None, "first_k_dense_replace": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "n_shared_experts": 1},
}
SHAPE_BASE = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
              "head_dim": 64, "max_position_embeddings": 16384, "bos_token_id": 0,
              "eos_token_id": 1}


def make_shape(out: str, name: str) -> None:
    import torch
    import transformers

    spec = {**SHAPE_BASE, **SHAPES[name]}
    arch = spec.pop("arch")
    if arch == "deepseek_v2":
        spec.pop("head_dim")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**spec)).to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(out)


def kv(budget: int, max_model_len: int, batched: int, path: str) -> None:
    """Start `path` with a KV cache of `budget` bytes and print what vLLM says it holds."""
    from vllm import LLM

    with counted_as_loaded() as loaded:
        llm = LLM(model=path, max_model_len=max_model_len, enforce_eager=True,
                  skip_tokenizer_init=True, dtype="auto", kv_cache_memory_bytes=budget,
                  max_num_batched_tokens=batched)
    cache = llm.llm_engine.vllm_config.cache_config
    print("KV " + json.dumps({
        "model": path, "budget": budget, "max_model_len": max_model_len,
        "tokens": cache.kv_cache_size_tokens, "max_concurrency": cache.kv_cache_max_concurrency,
        "blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
        "weights": loaded[0]}), flush=True)
    from vllm.distributed import cleanup_dist_env_and_memory

    del llm
    cleanup_dist_env_and_memory()


def make_int8(out: str, source: str) -> None:
    """A pre-quantized copy of `source`: compressed-tensors W8A8 int8 (what llm-compressor's
    W8A8 recipe writes), each linear layer's weight int8 with an fp32 scale per output row,
    the embeddings, norms and LM head left as they were (`ignore`)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{source}/model.safetensors")
    quantized = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
            quantized[name] = (t.float() / scale).round().clamp(-128, 127).to(torch.int8)
            quantized[name + "_scale"] = scale.to(torch.float32)
        else:
            quantized[name] = t
    shutil.copytree(source, out)
    save_file(quantized, f"{out}/model.safetensors", metadata={"format": "pt"})
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False,
              "strategy": "channel"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": scheme,
            "input_activations": {**scheme, "dynamic": True, "strategy": "token"}}}}
    with open(f"{out}/config.json", "w") as f:
        json.dump(config, f)


@contextlib.contextmanager
def counted_as_loaded() -> Iterator[list[dict[str, Any]]]:
    """The bytes of each model vLLM loads meanwhile, counted as its loader leaves them, before
    process_weights_after_loading. What the CPU build does then depends on the processor:
    where its packed GEMM kernels run (oneDNN, the sgl kernels of an AVX-512 BF16 or AMX
    processor, zentorch), it packs each linear layer's weight and drops the parameter
    (vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm, remove_weight=True,
    0.32.0), so counting after it measures the processor, not the checkpoint. A GPU drops
    nothing of an unquantized model."""
    from vllm.model_executor.model_loader import base_loader

    loaded: list[dict[str, Any]] = []
    original = base_loader.process_weights_after_loading

    def counting(model: Any, *args: Any, **kwargs: Any) -> Any:
        loaded.append(count(model))
        return original(model, *args, **kwargs)

    base_loader.process_weights_after_loading = counting
    try:
        yield loaded
    finally:
        base_loader.process_weights_after_loading = original


def count(module: Any) -> dict[str, Any]:
    params = list(module.parameters())
    buffers = list(module.buffers())
    return {"params_bytes": sum(p.numel() * p.element_size() for p in params),
            "buffers_bytes": sum(b.numel() * b.element_size() for b in buffers),
            "dtype": str(params[0].dtype)}


def load(path: str) -> None:
    """The model's bytes as vLLM's loader leaves them, before process_weights_after_loading:
    the CPU build then packs each linear layer's weight for oneDNN and drops the parameter
    (vllm/model_executor/layers/linear.py:216, dispatch_cpu_unquantized_gemm(layer,
    remove_weight=True)), which a GPU does not do to an unquantized model."""
    from vllm import LLM

    with counted_as_loaded() as loaded:
        llm = LLM(model=path, max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
                  dtype="auto")
    after = llm.apply_model(count)[0]
    print("SIZING " + json.dumps({"model": path, **loaded[0], "after_processing": after}),
          flush=True)
    # the next model in this process: vLLM's engine and its process group go first
    from vllm.distributed import cleanup_dist_env_and_memory

    del llm
    cleanup_dist_env_and_memory()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if sys.argv[1] == "make-shapes":
        for shape in SHAPES:
            make_shape(f"{sys.argv[2]}/{shape}", shape)
    elif sys.argv[1] == "kv":
        for model in sys.argv[5:]:
            kv(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), model)
    elif sys.argv[1] == "make-int8":
        make_int8(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "make":
        for out, dtype in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
            make(out, dtype)
    else:
        for model in sys.argv[2:]:
            load(model)
