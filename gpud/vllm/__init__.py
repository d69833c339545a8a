"""What a model needs and what vLLM says, read from disk and text: a checkpoint's tensors
(`checkpoint`), a vllm serve's needs from them (`model_size`), the flag table of the vLLM version in
use (`vllm_flags`), learned from an installed vLLM's own parser when gpud ships none (`learn`
runs `parser_walk`, a standalone script, in that vLLM's interpreter) and vLLM's own account of
its memory in its start-up lines (`vllm_log`).

The lowest floor above the pure core: these modules read files and text and nothing of gpud's
running state. They may import `gpud.core` and `gpud.errors`, nothing else of gpud.
"""
