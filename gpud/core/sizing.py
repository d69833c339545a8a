"""What a model needs on a device, from its checkpoint's figures, before it is launched: the
weights vLLM holds, the KV cache a reservation leaves (in MiB, in tokens and in sequences of
max_model_len at once), and the smallest reservation for one sequence or for N. Pure arithmetic on
values gpud.vllm.checkpoint read (each tensor's name, dtype and shape from the safetensors headers; the
model's config.json as a dict); standard library only, so gpuctl can use it.

The weights rules are vLLM's (0.32.0's source, the same in 0.33/0.34 where cited, paths under
`vllm/`); the KV cache's depend on the release and come from gpud.core.vllm_versions (its
`KvRules`, one per release, cited there). What cannot be read from a checkpoint, the activation
peak of vLLM's profile run and its CUDA graphs, is estimated (`estimate_overheads`, a rule of
thumb said as such) until a start measured it (`gpuctl calibrate`: `Overheads.measured`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpud.core.modelconfig import config_int, text_config
from gpud.core.vllm_versions import DEFAULT_VERSION, KvRules, behaviour

MIB = 1 << 20
# The KV rules of the release a serve runs when nothing says which (daemon.vllm_version's default).
DEFAULT_RULES = behaviour(DEFAULT_VERSION).kv

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


class NotApplicable(SizingError):
    """A setting vLLM would refuse for this checkpoint (a quantization that does not apply, a
    max_model_len over the model's window): bad input, its message naming the figure and what
    fits instead."""


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


# The quantization families whose names vLLM maps onto each other (a checkpoint's gptq run as
# gptq_marlin, awq as awq_marlin, modelopt's variants: the `override_quantization_method`s of
# vllm/model_executor/layers/quantization/, 0.33); any other pair must be equal.
QUANT_FAMILIES = ("gptq", "awq", "modelopt", "mxfp4", "humming", "bitsandbytes", "gguf")


def _same_family(asked: str, stored: str) -> bool:
    if asked == stored:
        return True
    return any(f in asked.lower() and f in stored.lower() for f in QUANT_FAMILIES)


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
    vocab = config_int(tc, "vocab_size") or config_int(config, "vocab_size")
    tied = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    stored = quantization_method(config)
    online = None
    if stored is not None and quantization and not _same_family(quantization, stored):
        raise NotApplicable(
            f"quantization {quantization!r} does not apply: the checkpoint is pre-quantized "
            f"({stored}, config.json quantization_config) and vLLM refuses another method "
            "(vllm/config/model.py:1453-1462 _verify_quantization, 0.32 to 0.34): leave it "
            f"unset or give {stored!r}")
    if stored is None and quantization:
        if quantization not in ONLINE_QUANT:
            if quantization == "fp8":
                raise NotApplicable(
                    "quantization 'fp8' does not apply to an unquantized checkpoint: vLLM "
                    "refuses online fp8 (vllm/model_executor/layers/quantization/fp8.py:106 "
                    "of 0.32 and 0.33, :103 of 0.34); use fp8_per_tensor (or another of "
                    f"{', '.join(sorted(ONLINE_QUANT))})")
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
    positions = config_int(tc, "max_position_embeddings")
    heads = config_int(tc, "num_attention_heads", "n_head")
    if positions is None or heads is None:
        return 0
    rotary = config_int(tc, "qk_rope_head_dim")
    if rotary is None:
        head_dim = config_int(tc, "head_dim") or (config_int(tc, "hidden_size") or 0) // heads
        factor = tc.get("partial_rotary_factor", 1.0)
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            factor = 1.0
        rotary = int(head_dim * factor)
    return positions * rotary * width


# layer_types' names of a layer that keeps every token
FULL_KINDS = ("full_attention", "attention", "global")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvCache:
    """The KV cache's shape: how many layers keep every token (full attention) and how many a
    window of them (sliding), and what a layer keeps of a token. Sized by a release's KvRules
    (gpud.core.vllm_versions), which `rules` defaults to: the default release's."""

    full_layers: int
    sliding_layers: int
    window: int | None
    layer_bytes_per_token: int  # one layer, K and V (or MLA's latent)
    dtype: str
    note: str
    # a full-attention layer's, where it differs (Gemma 4's wider global layers)
    full_layer_bytes_per_token: int | None = None

    @property
    def full_bytes(self) -> int:
        return self.full_layer_bytes_per_token or self.layer_bytes_per_token

    @property
    def per_token_bytes(self) -> int:
        """A token's KV over every layer that keeps it (the sliding ones while in the window)."""
        return self.full_layers * self.full_bytes + self.sliding_layers * self.layer_bytes_per_token

    def pages(self, rules: KvRules = DEFAULT_RULES) -> tuple[int, int, int]:
        """(a layer's page in bytes, a full layer's block in tokens, a sliding layer's): one
        page size for every layer, the smaller kind's block made longer by the ratio when the
        larger page is a multiple of it, else its page padded to the larger
        (unify_kv_cache_spec_page_size: v1/core/kv_cache_planning.py:346-410 of 0.33)."""
        bs = rules.block_tokens
        full_page, sliding_page = bs * self.full_bytes, bs * self.layer_bytes_per_token
        if not (self.full_layers and self.sliding_layers) or full_page == sliding_page:
            return (full_page if self.full_layers else sliding_page), bs, bs
        page = max(full_page, sliding_page)
        return (page,
                bs * (page // full_page) if page % full_page == 0 else bs,
                bs * (page // sliding_page) if page % sliding_page == 0 else bs)

    def groups(self) -> tuple[int, int, int]:
        """(layers per group, full-attention groups, sliding groups), as vLLM groups a model's
        layers: one group per kind, a hybrid's kinds cut into groups of the smaller kind's
        count (the larger's when it is under 1.5 times it), the last one padded
        (v1/core/kv_cache_planning.py of 0.33 `_get_kv_cache_groups_uniform_page_size`;
        kv_cache_utils.py:1362-1503 of 0.32)."""
        kinds = [n for n in (self.full_layers, self.sliding_layers) if n]
        if not kinds:
            return 0, 0, 0
        lo, hi = min(kinds), max(kinds)
        size = hi if hi < lo * 1.5 else lo
        return (size, cdiv(self.full_layers, size) if self.full_layers else 0,
                cdiv(self.sliding_layers, size) if self.sliding_layers else 0)

    def block_bytes(self, rules: KvRules = DEFAULT_RULES) -> int:
        """A block of the shared pool: one group's layers, block_tokens tokens each
        (`_get_kv_cache_bytes_per_block`: the largest group's pages)."""
        return self.groups()[0] * self.pages(rules)[0]

    def blocks_per_request(self, max_model_len: int, rules: KvRules = DEFAULT_RULES, *,
                           batched_tokens: int | None = None) -> int:
        """The blocks one request of max_model_len takes, summed over the groups
        (get_max_concurrency_for_kv_cache_config): cdiv(max_model_len, block) in a full group;
        in a sliding one the window - 1 plus the tokens in flight (in_flight_batches x
        max_num_batched_tokens, the API server's default when not given), never more than
        max_model_len, in blocks, plus one (SlidingWindowSpec.max_admission_blocks_per_request:
        the window may not start at a block's edge)."""
        _size, full_groups, sliding_groups = self.groups()
        _page, full_bs, sliding_bs = self.pages(rules)
        blocks = full_groups * cdiv(max_model_len, full_bs)
        if sliding_groups and self.window is not None:
            in_flight = rules.in_flight_batches * (batched_tokens or rules.batch_defaults(None)[0])
            held = min(self.window - 1 + in_flight, max_model_len)
            blocks += sliding_groups * (cdiv(held, sliding_bs) + 1)
        return blocks

    def bytes_for(self, max_model_len: int, rules: KvRules = DEFAULT_RULES, *,
                  batched_tokens: int | None = None) -> int:
        """The smallest KV budget vLLM starts with: one request of max_model_len beside the
        null block the block pool keeps (check_enough_kv_cache_memory, "Reserve the null
        block": 0.32's kv_cache_utils.py:1123, 0.33/0.34's kv_cache_planning.py)."""
        return (self.blocks_per_request(max_model_len, rules, batched_tokens=batched_tokens)
                + 1) * self.block_bytes(rules)

    def capacity(self, kv_bytes: int, max_model_len: int, rules: KvRules = DEFAULT_RULES, *,
                 batched_tokens: int | None = None) -> KvCapacity:
        """What a KV budget of kv_bytes holds, as vLLM counts and logs it."""
        per_block = self.block_bytes(rules)
        return KvCapacity(
            kv_bytes=kv_bytes, block_bytes=per_block, block_tokens=rules.block_tokens,
            blocks=max(0, kv_bytes) // per_block if per_block else 0,
            blocks_per_request=self.blocks_per_request(max_model_len, rules,
                                                       batched_tokens=batched_tokens),
            max_model_len=max_model_len)

    def longest_fitting(self, budget_bytes: int, upto: int, rules: KvRules = DEFAULT_RULES,
                        *, batched_tokens: int | None = None) -> int:
        """The longest max_model_len (a multiple of the block, at most `upto`) whose one
        request fits `budget_bytes` beside the null block; 0 when not even one block does."""
        bs = rules.block_tokens
        lo, hi = 0, upto // bs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_for(mid * bs, rules, batched_tokens=batched_tokens) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo * bs


@dataclass(frozen=True)
class KvCapacity:
    """A KV budget in vLLM's terms: the blocks it holds (available // bytes per block, the null
    block among them: get_kv_cache_config_from_groups), the blocks a request of max_model_len
    takes, and what vLLM logs from them: `KV cache size: N tokens, Maximum concurrency for L
    tokens per request: Cx` with C = blocks / blocks per request and N = int(C x L)
    (get_kv_cache_capacity, update_kv_cache_capacity: the same in 0.32, 0.33 and 0.34)."""

    kv_bytes: int
    block_bytes: int
    block_tokens: int
    blocks: int
    blocks_per_request: int
    max_model_len: int

    @property
    def max_concurrency(self) -> float:
        return self.blocks / self.blocks_per_request if self.blocks_per_request else 0.0

    @property
    def tokens(self) -> int:
        return int(self.max_concurrency * self.max_model_len)

    @property
    def sequences(self) -> int:
        """Requests of max_model_len that run at once: the blocks less the null block, whole
        requests only."""
        if not self.blocks_per_request:
            return 0
        return max(0, self.blocks - 1) // self.blocks_per_request

    @property
    def starts(self) -> bool:
        """vLLM starts: one request fits beside the null block."""
        return self.sequences >= 1


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
    layers = config_int(tc, "num_hidden_layers", "n_layer", "num_layers")
    heads = config_int(tc, "num_attention_heads", "n_head")
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
    full_bytes = 0
    rank = config_int(tc, "kv_lora_rank")
    if rank is not None:
        layer_bytes = (rank + (config_int(tc, "qk_rope_head_dim") or 0)) * width
        notes.append("MLA latent")
    else:
        kv_heads = config_int(tc, "num_key_value_heads", "num_kv_heads") or heads
        if tc.get("multi_query") is True:
            kv_heads = 1
        head_dim = config_int(tc, "head_dim")
        if head_dim is None:
            hidden = config_int(tc, "hidden_size", "n_embd", "d_model")
            if hidden is None:
                raise SizingError("config.json: no head_dim or hidden_size to size the KV "
                                  "cache by")
            head_dim = hidden // heads
        per_device = -(-kv_heads // devices)
        layer_bytes = 2 * per_device * head_dim * width
        # Gemma 4: its full-attention layers are wider, global_head_dim (512 unless given) and,
        # with attention_k_eq_v, num_global_key_value_heads KV heads (transformers'
        # Gemma4TextConfig.__post_init__; vllm/model_executor/models/
        # gemma4.py:576-580 Gemma4DecoderLayer takes them per layer). transformers 5 writes
        # them as per_layer_config {layer index: {"head_dim", "num_key_value_heads"}}.
        overrides = tc.get("per_layer_config")
        types_ = tc.get("layer_types")
        full_at = ([i for i, t in enumerate(types_) if t in FULL_KINDS]
                   if isinstance(types_, list) else [])
        if isinstance(overrides, Mapping) and overrides and full_at:
            first = overrides.get(str(full_at[0]), overrides.get(full_at[0]))
            if isinstance(first, Mapping):
                global_dim = config_int(first, "head_dim") or head_dim
                global_heads = config_int(first, "num_key_value_heads") or kv_heads
                full_bytes = 2 * -(-global_heads // devices) * global_dim * width
        elif str(tc.get("model_type", "")).startswith("gemma4"):
            global_dim = config_int(tc, "global_head_dim") or 512
            global_heads = (config_int(tc, "num_global_key_value_heads")
                            if tc.get("attention_k_eq_v") is True else None) or kv_heads
            full_bytes = 2 * -(-global_heads // devices) * global_dim * width
        if full_bytes and full_bytes != layer_bytes:
            notes.append(f"full-attention layers {full_bytes} bytes a token")
    types = tc.get("layer_types")
    window = config_int(tc, "sliding_window", "attention_window_size")
    full, sliding = layers, 0
    if isinstance(types, list) and len(types) == layers and all(isinstance(x, str)
                                                                 for x in types):
        shared = config_int(tc, "num_kv_shared_layers") or 0
        own = types[:layers - shared] if shared < layers else []
        full = sum(1 for x in own if x in FULL_KINDS)
        sliding = sum(1 for x in own if x in ("sliding_attention", "chunked_attention",
                                              "local", "sliding"))
        other = len(own) - full - sliding
        if other:
            notes.append(f"{other} non-attention layers' per-sequence state not counted")
        if shared:
            notes.append(f"{shared} layers share earlier layers' cache")
        if sliding and window is None:
            window = config_int(tc, "attention_chunk_size")
    elif window is not None and tc.get("use_sliding_window", True) is not False:
        full, sliding = 0, layers
    if sliding and window is None:
        full, sliding = full + sliding, 0
    if sliding:
        notes.append(f"{sliding} sliding-window layers ({window} tokens)")
    return KvCache(full, sliding, window, layer_bytes, kv_dtype, "; ".join(notes),
                   full_bytes if full_bytes and full_bytes != layer_bytes else None)


def mib_up(n_bytes: int) -> int:
    return -(-n_bytes // MIB)


@dataclass(frozen=True)
class Need:
    """A serve's floor: weights + the KV cache of one max_model_len request beside the null
    block (vLLM refuses to start without room for it: check_enough_kv_cache_memory) + its
    context (what it draws beyond its budget). The activation peak and CUDA graphs come on top
    (Overheads): the floor is what no reservation below can start, whatever they turn out."""

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
         kv_cache_mib: int | None = None, rules: KvRules = DEFAULT_RULES) -> Need:
    """The floor of a serve; with an exact KV cache (vllm.kv_cache_mib) that figure is what
    vLLM allocates, when it is larger than one sequence's."""
    kv_mib = mib_up(kv.bytes_for(max_model_len, rules))
    if kv_cache_mib is not None:
        kv_mib = max(kv_mib, kv_cache_mib)
    return Need(w.mib, kv_mib, context_mib, max_model_len)


def shortfall(vram_mib: int, n: Need, kv: KvCache, rules: KvRules = DEFAULT_RULES) -> str | None:
    """Why `vram_mib` cannot hold the serve, with what fits instead, or None when it can."""
    if vram_mib >= n.minimum_mib:
        return None
    why = (f"{vram_mib} MiB is below the minimum {n.arithmetic()}: set vram_mib >= "
           f"{n.minimum_mib}")
    fixed = n.weights_mib + n.context_mib
    if vram_mib < fixed:
        return why + (f" (the weights and context alone take {fixed} MiB: no shorter "
                      "max_model_len fits)")
    longest = kv.longest_fitting((vram_mib - fixed) * MIB, n.max_model_len, rules)
    if longest == 0:
        return why + " (not one block of KV cache fits beside the weights and context)"
    return why + f", or max_model_len <= {longest} fits {vram_mib} MiB"


class Source(StrEnum):
    """Where a figure of a reservation comes from."""

    CHECKPOINT = "checkpoint"  # read from the checkpoint's headers
    ESTIMATED = "estimated"  # gpud's rule of thumb (or an online quantization's estimate)
    MEASURED = "measured"  # a calibration's vLLM lines
    CONFIGURED = "configured"  # the config (vllm.context_mib, gpuctl size --context-mib)
    IN_ACTIVATION = "measured, in the activation peak"  # vLLM logged none of it apart


ESTIMATED, MEASURED, CONFIGURED, IN_ACTIVATION = (Source.ESTIMATED, Source.MEASURED,
                                                  Source.CONFIGURED, Source.IN_ACTIVATION)
# the sampler's dummy run of the profile keeps fp32 logits and their probabilities
SAMPLER_COPIES = 2


@dataclass(frozen=True)
class Overheads:
    """What vLLM's budget (util x total) holds besides the weights and the KV cache, and the
    context it draws beyond the budget, each with where its figure comes from."""

    activation_mib: int
    graphs_mib: int
    context_mib: int
    activation_from: Source = ESTIMATED
    graphs_from: Source = ESTIMATED
    context_from: Source = CONFIGURED
    how: str = ""

    @property
    def total_mib(self) -> int:
        return self.activation_mib + self.graphs_mib + self.context_mib


def estimate_overheads(config: Mapping[str, Any], dtype: str, rules: KvRules, *,
                       context_mib: int, device_mib: int | None = None,
                       batched_tokens: int | None = None, max_num_seqs: int | None = None,
                       enforce_eager: bool = False) -> Overheads:
    """gpud's estimate (a rule of thumb, not vLLM's arithmetic) of the profile run's activation
    peak and the CUDA graph pool, from the model's widths:

    - a token's widest activations through one layer: the MLP's gate and up projections
      (2 x intermediate), Q, K and V, and two copies of the hidden state, in the model's dtype;
    - the profile run (vllm/v1/worker/gpu_model_runner.py profile_run) pushes
      max_num_batched_tokens tokens through the model and samples max_num_seqs requests: their
      fp32 logits and probabilities over the vocabulary;
    - the CUDA graph pool holds the largest captured batch's activations: min(2 x max_num_seqs,
      512) tokens (config/vllm.py _set_cudagraph_sizes of 0.33); none with --enforce-eager.

    vLLM measures both at start (its "Available KV cache memory" is what is left); `gpuctl
    calibrate` reads them back and `measured_overheads` replaces this estimate."""
    tc = text_config(config)
    hidden = config_int(tc, "hidden_size", "n_embd", "d_model") or 0
    inter = config_int(tc, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    moe = config_int(tc, "moe_intermediate_size")
    topk = config_int(tc, "num_experts_per_tok", "moe_topk")
    if moe and topk:
        inter = max(inter, moe * topk)
    heads = config_int(tc, "num_attention_heads", "n_head") or 1
    kv_heads = config_int(tc, "num_key_value_heads") or heads
    head_dim = config_int(tc, "head_dim") or (hidden // heads if hidden else 0)
    vocab = config_int(tc, "vocab_size") or config_int(config, "vocab_size") or 0
    width = DTYPE_BYTES[dtype]
    per_token = (2 * inter + (heads + 2 * kv_heads) * head_dim + 2 * hidden) * width
    default_tokens, default_seqs = rules.batch_defaults(device_mib)
    tokens = batched_tokens or default_tokens
    seqs = max_num_seqs or default_seqs
    activation = tokens * per_token + seqs * vocab * 4 * SAMPLER_COPIES
    graph_tokens = 0 if enforce_eager else min(2 * seqs, rules.max_graph_tokens)
    graphs = graph_tokens * per_token
    how = (f"estimated: {tokens} tokens x {per_token} bytes of one layer's widest "
           f"activations + {seqs} sequences' fp32 logits over {vocab}; CUDA graphs "
           + (f"{graph_tokens} tokens' activations" if graph_tokens else "none (eager)"))
    return Overheads(mib_up(activation), mib_up(graphs), context_mib, how=how)


def measured_overheads(figures: Mapping[str, Any], estimate: Overheads, *,
                       budget_mib: int | None = None) -> Overheads:
    """The overheads a calibration measured (its vLLM figures, gpud.vllm.vllm_log): the CUDA graph
    pool vLLM logged, the context beyond its budget NVML showed, and the activation peak as
    what the budget held besides the weights, the KV cache and the graphs (vLLM's own
    determine_available_memory, read backwards). Only a util-sized start (its figures have
    `budget_mib`) says it. `budget_mib` is the budget to read it from: gpud's (the reservation
    less vllm.context_mib), so that the few MiB util's 4-decimal floor takes land in the
    activation figure and the same reservation gives back vLLM's KV cache. Without a graph
    figure (vLLM logged none) the graphs are inside the activation figure. A figure the
    calibration lacks stays the estimate's, and says so."""
    def num(key: str) -> int | None:
        value = figures.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    graphs, context = num("cudagraph_mib"), num("context_mib")
    budget = budget_mib if budget_mib is not None and num("budget_mib") is not None \
        else num("budget_mib")
    weights_mib = num("weights_mib")
    kv = num("kv_cache_estimate_mib") or num("kv_cache_mib")
    activation = None
    if budget is not None and weights_mib is not None and kv is not None:
        activation = max(0, budget - weights_mib - kv - (graphs or 0))
    graphs_mib, graphs_from = estimate.graphs_mib, estimate.graphs_from
    if graphs is not None:
        graphs_mib, graphs_from = graphs, MEASURED
    elif activation is not None:
        graphs_mib, graphs_from = 0, IN_ACTIVATION
    return Overheads(
        activation_mib=activation if activation is not None else estimate.activation_mib,
        graphs_mib=graphs_mib,
        context_mib=context if context is not None else estimate.context_mib,
        activation_from=MEASURED if activation is not None else estimate.activation_from,
        graphs_from=graphs_from,
        context_from=MEASURED if context is not None else estimate.context_from,
        how="measured by gpuctl calibrate (vLLM's start-up lines)"
            + ("; " + estimate.how if None in (activation, context) else ""))


@dataclass(frozen=True)
class Deduction:
    name: str
    mib: int
    source: Source


@dataclass(frozen=True)
class AtReservation:
    """What a reservation leaves for the KV cache, each deduction named, and what that KV
    cache holds as vLLM counts it."""

    vram_mib: int
    deductions: tuple[Deduction, ...]
    capacity: KvCapacity

    @property
    def kv_mib(self) -> int:
        return self.capacity.kv_bytes // MIB


def at_reservation(vram_mib: int, weights_mib: int, weights_from: Source, kv: KvCache,
                   max_model_len: int, overheads: Overheads, rules: KvRules = DEFAULT_RULES,
                   *, batched_tokens: int | None = None) -> AtReservation:
    """vLLM's KV budget out of `vram_mib`: util x total is the reservation less the context
    (gpud.core.launch.vllm_budget_mib), and vLLM gives the KV cache what is left of it after the
    weights, the activation peak and its CUDA-graph estimate (v1/worker/gpu_worker.py
    determine_available_memory, cited in KvRules). util's 4-decimal floor takes up to
    total/10000 MiB more, not counted here."""
    deductions = (Deduction("weights", weights_mib, weights_from),
                  Deduction("context", overheads.context_mib, overheads.context_from),
                  Deduction("activation peak", overheads.activation_mib,
                            overheads.activation_from),
                  Deduction("CUDA graphs", overheads.graphs_mib, overheads.graphs_from))
    left = vram_mib - sum(d.mib for d in deductions)
    return AtReservation(vram_mib, deductions,
                         kv.capacity(max(0, left) * MIB, max_model_len, rules,
                                     batched_tokens=batched_tokens))


def smallest_reservation(concurrency: int, weights_mib: int, kv: KvCache, max_model_len: int,
                         overheads: Overheads, rules: KvRules = DEFAULT_RULES, *,
                         batched_tokens: int | None = None) -> tuple[int, int]:
    """(vram_mib, kv_mib): the smallest reservation whose KV cache runs `concurrency` requests
    of max_model_len at once beside the null block, with the overheads given."""
    blocks = concurrency * kv.blocks_per_request(max_model_len, rules,
                                                 batched_tokens=batched_tokens) + 1
    kv_mib = mib_up(blocks * kv.block_bytes(rules))
    return weights_mib + overheads.total_mib + kv_mib, kv_mib
