"""The C decode kernel (``kernels/decode.c``): its library and the structures it takes.

Two modules call it: the fused decode step (:mod:`prefixserve.model.attention.fused_decode`, every
layer
of a decode batch) and prompt-step attention (:mod:`prefixserve.model.attention.prompt`,
attention alone). Both read :data:`library` from this module at each use (tests swap in another
build of it), and neither imports the other.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from prefixserve.model.weights import quant_kernels

SOURCE = Path(__file__).parent.parent / "kernels" / "decode.c"
#: Activation dtypes of the fused step. With bfloat16 the layers compute in float32 (norm
#: weights and biases are copied to float32 once).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
#: Cache dtypes the kernel reads and writes (``kv_type`` of ``decode.c``), any of them beside
#: either activation dtype (``--kv-cache-dtype``); K/V are rounded to the 16-bit types as they
#: are written (to nearest even, as torch rounds) and attention reads them back.
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


_INT64_3: type[ctypes.Array[ctypes.c_int64]] = ctypes.c_int64 * 3
_INT64_2: type[ctypes.Array[ctypes.c_int64]] = ctypes.c_int64 * 2
_POINTER_2: type[ctypes.Array[ctypes.c_void_p]] = ctypes.c_void_p * 2
_POINTER_4: type[ctypes.Array[ctypes.c_void_p]] = ctypes.c_void_p * 4
_INT64_4: type[ctypes.Array[ctypes.c_int64]] = ctypes.c_int64 * 4


class LayerStruct(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")] + \
               [(name, ctypes.c_int64) for name in
                ("qkv_fmt", "o_fmt", "gate_up_fmt", "down_fmt")] + \
               [(name, ctypes.c_void_p) for name in
                ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "kv", "q_norm", "k_norm",
                 "attn_out_norm", "mlp_out_norm")] + \
               [("group", ctypes.c_int64), ("local_rope", ctypes.c_int64)] + \
               [(name, _INT64_3) for name in ("qkv_rows", "gate_up_rows")] + \
               [(name, _POINTER_2) for name in ("qkv_more", "gate_up_more")] + \
               [(name, _INT64_2) for name in ("qkv_more_fmt", "gate_up_more_fmt")] + \
               [(name, _POINTER_4) for name in ("lora_a", "lora_bt", "lora_used")] + \
               [("lora_rows", _INT64_4)]


class ModelStruct(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("kv_type", ctypes.c_int64), ("bf16_products", ctypes.c_int64),
                ("bf16_queries", ctypes.c_int64), ("eps", ctypes.c_double),
                ("inv_freq", ctypes.c_void_p), ("layers", ctypes.POINTER(LayerStruct)),
                ("gelu", ctypes.c_int64), ("query_factor", ctypes.c_double),
                ("inv_freq_local", ctypes.c_void_p), ("num_groups", ctypes.c_int64),
                ("windows", ctypes.c_void_p), ("lora_max_rows", ctypes.c_int64),
                ("amx_from", ctypes.c_int64)]


class BatchStruct(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int64), ("pos", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("lora_slots", ctypes.c_void_p)]


def declare(lib: ctypes.CDLL) -> None:
    lib.decode_forward.argtypes = [ctypes.POINTER(ModelStruct), ctypes.POINTER(BatchStruct),
                                   ctypes.c_void_p]
    lib.decode_forward.restype = ctypes.c_int
    lib.phase_times.argtypes = [ctypes.c_void_p]
    lib.phase_times.restype = ctypes.c_int
    # attention alone (prefixserve.model.attention.prompt)
    model, batch = ctypes.POINTER(ModelStruct), ctypes.POINTER(BatchStruct)
    lib.attention_plan_bytes.argtypes = [model, batch]
    lib.attention_plan_bytes.restype = ctypes.c_int64
    lib.attention_plan.argtypes = [model, batch, ctypes.c_int64, ctypes.c_void_p]
    lib.attention_plan.restype = None
    lib.attention_run.argtypes = [model, batch, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.attention_run.restype = None
    lib.attention_has_fast_form.argtypes = [ctypes.c_int64]
    lib.attention_has_fast_form.restype = ctypes.c_int
    lib.attention_has_bf16_form.argtypes = []
    lib.attention_has_bf16_form.restype = ctypes.c_int


#: The compiled library, built at first use.
library = quant_kernels.KernelLibrary(SOURCE, declare)
