"""What a model needs on a device, from its checkpoint's figures, before it is launched: the
weights vLLM holds, the KV cache of one sequence of max_model_len, and the minimum reservation
that follows. Pure arithmetic on values gpud.checkpoint read (each tensor's name, dtype and shape
from the safetensors headers; the model's config.json as a dict); standard library only, so
gpuctl can use it.

Every rule is vLLM's (0.32.0's source, paths under `vllm/`), cited where it is applied. What the
figures leave out is said where it matters: the activation peak of vLLM's profile run and CUDA
graphs are not known before a start, so the minimum is a floor (`gpuctl calibrate` measures the
rest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20

# safetensors' dtypes and their widths in bits (safetensors/src/tensor.rs: `enum Dtype`,
# `Dtype::bitsize`).
SAFETENSORS_BITS: Mapping[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}
# The floating dtypes vLLM casts to the model's dtype as it loads a tensor into a parameter of
# that dtype (vllm/model_executor/model_loader/weight_utils.py:1476 default_weight_loader copies
# into the parameter, which has the model's dtype).
CAST_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

# --dtype: the names vLLM takes and their widths (vllm/config/model.py:
# _STR_DTYPE_TO_TORCH_DTYPE).
DTYPE_BYTES: Mapping[str, int] = {
    "half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4,
}
# The short names gpud prints.
DTYPE_SHORT: Mapping[str, str] = {
    "half": "fp16", "float16": "fp16", "bfloat16": "bf16", "float": "fp32", "float32": "fp32",
}

# --kv-cache-dtype: bytes per element; "auto" is the model's dtype
# (vllm/config/cache.py: CacheDType; vllm/utils/torch_utils.py: STR_DTYPE_TO_TORCH_DTYPE).
KV_CACHE_DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1,
}

# vLLM pads the vocabulary of embeddings and the LM head to a multiple of 64
# (vllm/model_executor/layers/vocab_parallel_embedding.py:36 DEFAULT_VOCAB_PADDING_SIZE, :95
# pad_vocab_size).
VOCAB_PADDING = 64
# The KV cache is allocated in blocks of 16 tokens (vllm/config/cache.py:72 DEFAULT_BLOCK_SIZE;
# an attention backend may prefer another: vllm/platforms/interface.py:773), and one
# sequence of max_model_len needs cdiv(max_model_len, block_size) blocks
# (vllm/v1/kv_cache_interface.py:607 FullAttentionSpec.max_memory_usage_bytes).
BLOCK_TOKENS = 16
# A sliding-window layer holds the last window - 1 tokens plus those in flight (one batch of
# max_num_batched_tokens), never more than max_model_len, plus one block
# (vllm/v1/kv_cache_interface.py:873-885): 2048 tokens in flight is the API server's default
# batch on devices under 70 GiB (vllm/engine/arg_utils.py:2894-2950 get_batch_defaults; 8192
# on an H100/H200, 16384 from 160 GiB).
SLIDING_IN_FLIGHT_TOKENS = 2048

# Online quantization, `--quantization NAME` on an unquantized checkpoint (vllm/config/
# quantization.py:190-225 _ONLINE_SHORTHANDS): NAME -> (which layers, bits per weight, bytes of
# scale per weight). Only LinearBase layers and routed experts are quantized
# (vllm/model_executor/layers/quantization/online/base.py:388-411 get_quant_method): embeddings
# and the LM head (VocabParallelEmbedding, ParallelLMHead: not LinearBase), norms and biases
# stay in the model's dtype.
LINEAR_AND_EXPERTS = "linear+experts"
EXPERTS_ONLY = "experts"
ONLINE_QUANT: Mapping[str, tuple[str, int, float]] = {
    "fp8_per_tensor": (LINEAR_AND_EXPERTS, 8, 0.0),
    "fp8_per_channel": (LINEAR_AND_EXPERTS, 8, 0.0),  # one fp32 per output row: added below
    "fp8_per_block": (LINEAR_AND_EXPERTS, 8, 4 / (128 * 128)),  # fp32 per 128x128 block
    "mxfp8": (LINEAR_AND_EXPERTS, 8, 1 / 32),  # an e8m0 scale per 32 weights
    "mxfp4": (LINEAR_AND_EXPERTS, 4, 1 / 32),
    "int8_per_channel_weight_only": (EXPERTS_ONLY, 8, 0.0),
    "nvfp4_per_token": (EXPERTS_ONLY, 4, 1 / 16),  # an fp8 scale per 16 weights
}
# Names of the tensors that are not linear layers' weights, whatever their shape: embeddings
# (the LM head's, the per-layer ones of Gemma 3n), positions, norms.
NOT_LINEAR = ("embed", "lm_head", "wte", "wpe", "norm", "position", "rotary")


class SizingError(ValueError):
    """The figures cannot be made: a config.json that lacks what the KV cache needs, a dtype
    gpud does not know. Its message names what is missing."""


class Unknown(Exception):
    """A figure gpud cannot predict (an online quantization it does not model, attention it
    cannot read from the config): not an error of the config, said as a reason."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def stored_bytes(self) -> int:
        return (self.numel * SAFETENSORS_BITS[self.dtype] + 7) // 8


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config: multimodal configs nest it under text_config
    (Gemma 3/4, Llama 4, Qwen2-VL's newer layout), or llm_config (InternVL)."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = config.get(key)
        if isinstance(inner, Mapping):
            return inner
    return config


def _int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The dtype the config says the model was saved in (transformers writes `dtype` since
    4.56, `torch_dtype` before), looked for in the text config first."""
    for part in (text_config(config), config):
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if isinstance(value, str) and value in DTYPE_BYTES:
                return value
    return None


def model_dtype(config: Mapping[str, Any], dtype_arg: str | None = None) -> str:
    """The dtype vLLM runs the model in: --dtype when given; "auto" is the config's dtype, a
    float32 model downcast to the platform's first (bfloat16 on CUDA from compute capability
    8.0 and on x86 CPUs: vllm/config/model.py:2405-2447 _resolve_auto_dtype,
    vllm/platforms/cuda.py:255, vllm/platforms/cpu.py:112); a config without one is float32 to
    transformers, so bfloat16 too."""
    if dtype_arg is not None and dtype_arg != "auto":
        if dtype_arg not in DTYPE_BYTES:
            raise SizingError(f"--dtype {dtype_arg!r} is not one of "
                              f"{', '.join(sorted(DTYPE_BYTES))}")
        return "bfloat16" if dtype_arg == "bfloat16" else (
            "float16" if DTYPE_BYTES[dtype_arg] == 2 else "float32")
    found = config_dtype(config)
    if found is None or DTYPE_BYTES[found] == 4:
        return "bfloat16"
    return "float16" if found in ("half", "float16") else "bfloat16"


def quantization_method(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's own quantization (config.json's quantization_config.quant_method, as
    vLLM reads it: vllm/config/model.py _parse_quant_hf_config), or None."""
    for part in (config, text_config(config)):
        q = part.get("quantization_config") or part.get("compression_config")
        if isinstance(q, Mapping):
            method = q.get("quant_method") or q.get("format") or "quantized"
            return str(method)
    return None


@dataclass(frozen=True)
class Weights:
    """The weights vLLM holds on a device: bytes, how they were counted, and whether that is an
    estimate (an online quantization) or the checkpoint's own figures."""

    bytes: int
    stored_bytes: int
    tensors: int
    dtype: str
    how: str
    estimate: bool

    @property
    def mib(self) -> int:
        return -(-self.bytes // MIB)


def _is_linear_weight(t: Tensor) -> bool:
    lowered = t.name.lower()
    return (t.name.endswith(".weight") and len(t.shape) in (2, 3)
            and not any(word in lowered for word in NOT_LINEAR))


def _is_expert(t: Tensor) -> bool:
    return ".experts." in t.name or t.name.endswith(".experts.weight") or len(t.shape) == 3


def _padded_rows(t: Tensor, vocab: int | None) -> int:
    """Elements of `t` as vLLM allocates it: an embedding or LM head of `vocab` rows padded to
    VOCAB_PADDING rows."""
    lowered = t.name.lower()
    if vocab and t.shape and t.shape[0] == vocab and t.name.endswith(".weight") and (
            "embed" in lowered or "lm_head" in lowered or "wte" in lowered):
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        return t.numel // vocab * padded
    return t.numel


def weights(tensors: Sequence[Tensor], config: Mapping[str, Any], *,
            quantization: str | None = None, dtype_arg: str | None = None,
            devices: int = 1) -> Weights:
    """The weights of a checkpoint as vLLM holds them, per device (`devices`: tensor parallel
    over that many, each holding about 1/devices of them).

    - A pre-quantized checkpoint (config.json has a quantization_config) counts as stored:
      its packed and fp8 tensors and their scales as written, its floating weights (the layers
      its recipe left unquantized: embeddings, LM head, norms, towers) in the model's dtype.
    - An unquantized checkpoint: every floating tensor in the model's dtype (model_dtype).
    - With an online `quantization` (ONLINE_QUANT) on an unquantized checkpoint: the layers it
      quantizes at their quantized width plus scales, the rest in the model's dtype; an
      estimate, said so.
    - A tied LM head is the embedding (tie_word_embeddings): a copy saved in the checkpoint is
      a second tensor (vllm/model_executor/models/llama.py:509-510: the LM head ties its weight
      to embed_tokens).
    """
    dtype = model_dtype(config, dtype_arg)
    width = DTYPE_BYTES[dtype]
    tc = text_config(config)
    vocab = _int(tc, "vocab_size") or _int(config, "vocab_size")
    tied = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    stored = quantization_method(config)
    online = None
    if stored is None and quantization:
        if quantization not in ONLINE_QUANT:
            if quantization == "fp8":
                raise Unknown("--quantization fp8 on an unquantized checkpoint: vLLM 0.32 "
                              "refuses online fp8 (vllm/model_executor/layers/quantization/"
                              "fp8.py:106: use fp8_per_tensor)")
            raise Unknown(f"online quantization {quantization!r}: gpud does not estimate it "
                          f"(it estimates {', '.join(sorted(ONLINE_QUANT))})")
        online = ONLINE_QUANT[quantization]
    total = 0
    stored_total = 0
    count = 0
    for t in tensors:
        stored_total += t.stored_bytes
        if tied and t.name.endswith("lm_head.weight"):
            continue
        count += 1
        n = _padded_rows(t, vocab)
        if t.dtype not in CAST_DTYPES or (
                stored is not None and not t.name.endswith((".weight", ".bias"))):
            # packed weights, and a pre-quantized checkpoint's scales, as written
            total += t.stored_bytes
            continue
        if online is not None and _is_linear_weight(t):
            which, bits, scale_per_weight = online
            if which == LINEAR_AND_EXPERTS or _is_expert(t):
                total += (n * bits + 7) // 8 + int(n * scale_per_weight)
                if quantization == "fp8_per_channel":
                    total += 4 * (t.shape[-2] if len(t.shape) >= 2 else 1)
                elif quantization == "fp8_per_tensor":
                    total += 4 * (t.shape[0] if len(t.shape) == 3 else 1)
                continue
        total += n * width
    rope = rope_cache_bytes(config, width)
    total += rope
    short = DTYPE_SHORT[dtype]
    if stored is not None:
        how = f"as stored (pre-quantized: {stored}); unquantized layers in {short}"
    elif online is not None:
        how = (f"online {quantization} (estimate): linear layers quantized, embeddings, LM "
               f"head and norms in {short}")
    else:
        how = f"{short}"
    if rope:
        how += f"; RoPE cache {rope / MIB:.1f} MiB"
    if devices > 1:
        how += f"; over {devices} devices"
    return Weights(-(-total // devices), stored_total, count, dtype, how, online is not None)


def rope_cache_bytes(config: Mapping[str, Any], width: int) -> int:
    """The rotary embedding's cos/sin cache, a buffer of max_position_embeddings x rotary_dim
    in the model's dtype (vllm/model_executor/layers/rotary_embedding/base.py:59-63
    register_buffer("cos_sin_cache"), :94 _compute_cos_sin_cache), one shared by every layer
    (rotary_embedding/__init__.py:29 _ROPE_DICT). rotary_dim: MLA's qk_rope_head_dim, else
    head_dim x partial_rotary_factor."""
    tc = text_config(config)
    positions = _int(tc, "max_position_embeddings")
    heads = _int(tc, "num_attention_heads", "n_head")
    if positions is None or heads is None:
        return 0
    rotary = _int(tc, "qk_rope_head_dim")
    if rotary is None:
        head_dim = _int(tc, "head_dim") or (_int(tc, "hidden_size") or 0) // heads
        factor = tc.get("partial_rotary_factor", 1.0)
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            factor = 1.0
        rotary = int(head_dim * factor)
    return positions * rotary * width


@dataclass(frozen=True)
class KvCache:
    """What the KV cache of one sequence costs: bytes per token per full-attention layer set,
    and the sliding-window layers, which hold at most a window."""

    full_layers: int
    sliding_layers: int
    window: int | None
    layer_bytes_per_token: int  # one layer, K and V (or MLA's latent)
    dtype: str
    note: str

    @property
    def per_token_bytes(self) -> int:
        """A token's KV over every layer that keeps it (the sliding ones while in the window)."""
        return (self.full_layers + self.sliding_layers) * self.layer_bytes_per_token

    def tokens_held(self, max_model_len: int) -> tuple[int, int]:
        """(tokens a full layer holds, tokens a sliding layer holds) for one sequence, in whole
        blocks."""
        full = -(-max_model_len // BLOCK_TOKENS) * BLOCK_TOKENS
        if not self.sliding_layers or self.window is None:
            return full, 0
        held = min(self.window - 1 + SLIDING_IN_FLIGHT_TOKENS, max_model_len)
        return full, min(full, (-(-held // BLOCK_TOKENS) + 1) * BLOCK_TOKENS)

    def bytes_for(self, max_model_len: int) -> int:
        full, sliding = self.tokens_held(max_model_len)
        return (self.full_layers * full + self.sliding_layers * sliding) \
            * self.layer_bytes_per_token

    def longest_fitting(self, budget_bytes: int, upto: int) -> int:
        """The longest max_model_len (a multiple of BLOCK_TOKENS, at most `upto`) whose
        sequence fits `budget_bytes`; 0 when not even one block does."""
        lo, hi = 0, upto // BLOCK_TOKENS
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_for(mid * BLOCK_TOKENS) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo * BLOCK_TOKENS


def kv_cache(config: Mapping[str, Any], *, cache_dtype: str | None = None,
             dtype_arg: str | None = None, devices: int = 1) -> KvCache:
    """The KV cache's shape from config.json (its text_config for a multimodal model).

    Per layer and token, K and V: 2 x num_key_value_heads x head_dim x the cache dtype's bytes
    (vllm/v1/kv_cache_interface.py: AttentionSpec.page_size_bytes); MLA (kv_lora_rank) keeps one
    latent of kv_lora_rank + qk_rope_head_dim (MLAAttentionSpec). num_key_value_heads defaults
    to num_attention_heads, head_dim to hidden_size / num_attention_heads (transformers'
    configs). `layer_types` says which layers slide (sliding_attention, over
    `sliding_window` tokens) and which are not attention (linear attention, mamba: their state
    is per sequence, not per token, and is not counted); without it, `sliding_window` (unless
    use_sliding_window is false) makes every layer slide. The last num_kv_shared_layers layers
    reuse earlier layers' cache (Gemma 3n). Over `devices` (tensor parallel) each holds
    ceil(kv_heads / devices) heads."""
    tc = text_config(config)
    layers = _int(tc, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(tc, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        raise SizingError("config.json: no num_hidden_layers / num_attention_heads to size "
                          "the KV cache by")
    if cache_dtype is None or cache_dtype == "auto":
        kv_dtype = model_dtype(config, dtype_arg)
    elif cache_dtype in KV_CACHE_DTYPE_BYTES:
        kv_dtype = cache_dtype
    else:
        raise SizingError(f"kv cache dtype {cache_dtype!r} is not one of auto, "
                          f"{', '.join(sorted(KV_CACHE_DTYPE_BYTES))}")
    width = KV_CACHE_DTYPE_BYTES[kv_dtype]
    notes: list[str] = []
    rank = _int(tc, "kv_lora_rank")
    if rank is not None:
        layer_bytes = (rank + (_int(tc, "qk_rope_head_dim") or 0)) * width
        notes.append("MLA latent")
    else:
        kv_heads = _int(tc, "num_key_value_heads", "num_kv_heads") or heads
        if tc.get("multi_query") is True:
            kv_heads = 1
        head_dim = _int(tc, "head_dim")
        if head_dim is None:
            hidden = _int(tc, "hidden_size", "n_embd", "d_model")
            if hidden is None:
                raise SizingError("config.json: no head_dim or hidden_size to size the KV "
                                  "cache by")
            head_dim = hidden // heads
        per_device = -(-kv_heads // devices)
        layer_bytes = 2 * per_device * head_dim * width
    types = tc.get("layer_types")
    window = _int(tc, "sliding_window", "attention_window_size")
    full, sliding = layers, 0
    if isinstance(types, list) and len(types) == layers and all(isinstance(x, str)
                                                                 for x in types):
        shared = _int(tc, "num_kv_shared_layers") or 0
        own = types[:layers - shared] if shared < layers else []
        full = sum(1 for x in own if x in ("full_attention", "attention", "global"))
        sliding = sum(1 for x in own if x in ("sliding_attention", "chunked_attention",
                                              "local", "sliding"))
        other = len(own) - full - sliding
        if other:
            notes.append(f"{other} non-attention layers' per-sequence state not counted")
        if shared:
            notes.append(f"{shared} layers share earlier layers' cache")
        if sliding and window is None:
            window = _int(tc, "attention_chunk_size")
    elif window is not None and tc.get("use_sliding_window", True) is not False:
        full, sliding = 0, layers
    if sliding and window is None:
        full, sliding = full + sliding, 0
    if sliding:
        notes.append(f"{sliding} sliding-window layers ({window} tokens)")
    return KvCache(full, sliding, window, layer_bytes, kv_dtype, "; ".join(notes))


def default_max_model_len(config: Mapping[str, Any]) -> int | None:
    """The max_model_len vLLM takes when none is given: the model's own context length
    (vllm/config/model.py: _get_and_verify_max_len reads max_position_embeddings and its
    aliases)."""
    tc = text_config(config)
    return _int(tc, "max_position_embeddings", "n_positions", "max_seq_len",
                "seq_length", "max_sequence_length")


def mib_up(n_bytes: int) -> int:
    return -(-n_bytes // MIB)


@dataclass(frozen=True)
class Need:
    """A serve's minimum reservation: weights + the KV cache of one max_model_len sequence
    (vLLM refuses to start without room for it: vllm/v1/core/kv_cache_utils.py:1104
    check_enough_kv_cache_memory) + its context (what it draws beyond its budget)."""

    weights_mib: int
    kv_mib: int
    context_mib: int
    max_model_len: int

    @property
    def minimum_mib(self) -> int:
        return self.weights_mib + self.kv_mib + self.context_mib

    def arithmetic(self) -> str:
        return (f"weights {self.weights_mib} + KV for one {self.max_model_len}-token sequence "
                f"{self.kv_mib} + context {self.context_mib} = {self.minimum_mib} MiB")


def need(w: Weights, kv: KvCache, max_model_len: int, context_mib: int,
         kv_cache_mib: int | None = None) -> Need:
    """The minimum of a serve; with an exact KV cache (vllm.kv_cache_mib) that figure is what
    vLLM allocates, when it is larger than one sequence's."""
    kv_mib = mib_up(kv.bytes_for(max_model_len))
    if kv_cache_mib is not None:
        kv_mib = max(kv_mib, kv_cache_mib)
    return Need(w.mib, kv_mib, context_mib, max_model_len)


def shortfall(vram_mib: int, n: Need, kv: KvCache) -> str | None:
    """Why `vram_mib` cannot hold the serve, with what fits instead, or None when it can."""
    if vram_mib >= n.minimum_mib:
        return None
    why = (f"{vram_mib} MiB is below the minimum {n.arithmetic()}: set vram_mib >= "
           f"{n.minimum_mib}")
    fixed = n.weights_mib + n.context_mib
    if vram_mib < fixed:
        return why + (f" (the weights and context alone take {fixed} MiB: no shorter "
                      "max_model_len fits)")
    longest = kv.longest_fitting((vram_mib - fixed) * MIB, n.max_model_len)
    if longest == 0:
        return why + " (not one block of KV cache fits beside the weights and context)"
    return why + f", or max_model_len <= {longest} fits {vram_mib} MiB"
