"""Model FLOPs utilisation: the FLOPs a training step must do (nanoGPT's count) over what the GPU could do at peak.

FLOPs per token (nanoGPT's estimate_mfu, from the PaLM paper): 6 N + 12 L H Q T, N the parameters without the
position embeddings (lm_head is wte, counted once), L layers, H heads, Q the head size, T the sequence length
trained on (nanoGPT takes block_size; they are equal in its runs). Forward and backward, no recomputation.

Peaks are dense (no sparsity) TFLOP/s per GPU from the vendors' data sheets, by precision: "fp32" is the CUDA cores,
"tf32" / "bf16" / "fp16" the tensor cores. A GPU missing from the table gets no MFU unless the user gives its peak.
"""
import re

# (name pattern, {precision: dense TFLOP/s}); the first match wins, so the more specific names come first.
PEAK_TFLOPS = [
    (r"H100.*PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H[12]00.*NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),  # H100 NVL, H200 NVL
    (r"H100|H200|GH200", {"fp32": 67.0, "tf32": 494.0, "bf16": 989.0, "fp16": 989.0}),  # SXM
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),  # Turing: no bf16, no tf32
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
]


def num_parameters(config):
    """GPT-2's parameters for a GPTConfig (lm_head tied to wte, counted once), without building a model: wte and wpe,
    per layer four linears with biases (12 C^2 + 9 C) and two LayerNorms (4 C), and ln_f."""
    C = config.n_embd
    return (config.vocab_size + config.block_size) * C + config.n_layer * (12 * C * C + 13 * C) + 2 * C


def flops_per_token(config, T, num_parameters):
    """nanoGPT's training FLOPs per token of a GPT-2 (a GPTConfig) trained on sequences of T tokens."""
    n = num_parameters - config.block_size * config.n_embd  # without wpe
    L, H, Q = config.n_layer, config.n_head, config.n_embd // config.n_head
    return 6 * n + 12 * L * H * Q * T


def peak_tflops(device_name, precision):
    """Dense peak TFLOP/s of the named GPU in this precision, or None when the table does not know it."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name or ""):
            return peaks.get(precision)
    return None


def mfu(token_flops, tokens_per_second, peak, n_devices=1):
    """The fraction of n_devices' peak (TFLOP/s each) that tokens_per_second of training uses."""
    return token_flops * tokens_per_second / (peak * 1e12 * n_devices)
