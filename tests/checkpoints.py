"""Checkpoints built by hand for the tests: safetensors files written byte by byte (the format:
an 8-byte little-endian header length, the JSON header, the data), a config.json, an index."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BITS = {"F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "I32": 32, "U8": 8, "I8": 8}


def safetensors_bytes(tensors: Mapping[str, tuple[str, Sequence[int]]],
                      metadata: Mapping[str, str] | None = None) -> bytes:
    """A valid safetensors file of zeros holding `tensors` (name -> (dtype, shape))."""
    header, size = safetensors_header(tensors, metadata)
    return header + bytes(size)


def safetensors_header(tensors: Mapping[str, tuple[str, Sequence[int]]],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, int]:
    """The length and header of a safetensors file holding `tensors`, and its data's size."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = 1
        for d in shape:
            n *= d
        size = (n * BITS[dtype] + 7) // 8
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset,
                                                                             offset + size]}
        offset += size
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16",
}


def llama_tensors(dtype: str = "BF16", cfg: Mapping[str, Any] = LLAMA_CONFIG,
                  ) -> dict[str, tuple[str, list[int]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    out: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": (dtype, [v, h]),
                                             "model.norm.weight": (dtype, [h])}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "input_layernorm.weight": (dtype, [h]),
                p + "post_attention_layernorm.weight": (dtype, [h]),
                p + "self_attn.q_proj.weight": (dtype, [q, h]),
                p + "self_attn.k_proj.weight": (dtype, [kv, h]),
                p + "self_attn.v_proj.weight": (dtype, [kv, h]),
                p + "self_attn.o_proj.weight": (dtype, [h, q]),
                p + "mlp.gate_proj.weight": (dtype, [i, h]),
                p + "mlp.up_proj.weight": (dtype, [i, h]),
                p + "mlp.down_proj.weight": (dtype, [h, i])}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (dtype, [v, h])
    return out


def write_checkpoint(directory: Path, *, config: Mapping[str, Any] = LLAMA_CONFIG,
                     tensors: Mapping[str, tuple[str, Sequence[int]]] | None = None,
                     shards: int = 1, sparse: bool = False) -> Path:
    """A checkpoint directory: config.json and the tensors in `shards` files (an index when
    more than one, as transformers writes it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config)))
    tensors = dict(tensors if tensors is not None else llama_tensors())
    if sparse:  # the data a hole: large models in no space
        header, size = safetensors_header(tensors)
        with (directory / "model.safetensors").open("wb") as f:
            f.write(header)
            f.truncate(len(header) + size)
        return directory
    if shards == 1:
        (directory / "model.safetensors").write_bytes(safetensors_bytes(tensors))
        return directory
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        (directory / fname).write_bytes(safetensors_bytes(part))
        weight_map |= {n: fname for n in part}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory
