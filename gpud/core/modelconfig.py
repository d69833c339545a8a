"""What a model's config.json says that sizing reads first: the language model's part of it
(a multimodal config nests it), its positive integers by any of the names configs give them,
and the context window vLLM allows (the longest max_model_len, and the one it takes when none
is given). Pure, standard library only (gpuctl size uses it); gpud.core.sizing builds on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config: multimodal configs nest it under text_config
    (Gemma 3/4, Llama 4, Qwen2-VL's newer layout), or llm_config (InternVL)."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = config.get(key)
        if isinstance(inner, Mapping):
            return inner
    return config


def config_int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# The keys a config gives its context length by (vllm/transformers_utils/model_arch_config_
# convertor.py of 0.33: possible_keys; the smallest one found is the model's).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE scalings whose max_position_embeddings is already scaled (vllm/config/model.py:2607-2620
# of 0.33 _get_and_verify_max_len); any other type multiplies it by its factor.
ROPE_ALREADY_SCALED = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn",
                                 "deepseek_llama_scaling"})


def model_window(config: Mapping[str, Any]) -> tuple[int, str] | None:
    """The longest max_model_len vLLM accepts for this model, and the key it comes from: the
    smallest context length the config gives, times a RoPE scaling's factor unless the type's
    positions are already scaled or the model is a Gemma 3 (vllm/config/model.py:2545-2690 of
    0.33 _get_and_verify_max_len: a longer max_model_len is refused unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)."""
    tc = text_config(config)
    found = [(v, k) for k in CONTEXT_KEYS if (v := config_int(tc, k)) is not None]
    if not found:
        return None
    length, key = min(found)
    rope = tc.get("rope_parameters") or tc.get("rope_scaling")
    model_type = str(tc.get("model_type", config.get("model_type", "")))
    if isinstance(rope, Mapping) and "gemma3" not in model_type:
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind not in ROPE_ALREADY_SCALED and isinstance(factor, (int, float)) and factor > 0:
            return int(length * factor), f"{key} x rope factor {factor:g}"
    return length, key


def default_max_model_len(config: Mapping[str, Any]) -> int | None:
    """The max_model_len vLLM takes when none is given: the model's own context length
    (model_window; vllm/config/model.py: _get_and_verify_max_len)."""
    window = model_window(config)
    return window[0] if window else None


def check_max_model_len(config: Mapping[str, Any], max_model_len: int) -> str | None:
    """Why vLLM refuses this max_model_len for the model, naming what fits, or None."""
    window = model_window(config)
    if window is None or max_model_len <= window[0]:
        return None
    return (f"max_model_len {max_model_len} is over the model's context length {window[0]} "
            f"({window[1]} in config.json): vLLM refuses it (vllm/config/model.py "
            f"_get_and_verify_max_len); use max_model_len <= {window[0]}")
