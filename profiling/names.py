"""What a profiled name is: a CUDA kernel's short label for prose, and which category of
"where the time goes" (linear layers, attention, matmul kernels, everything else) the time of
an op or kernel counts under."""

from __future__ import annotations

import re
from collections import defaultdict

# CUDA kernel names, as the profiler records them, are demangled C++ signatures: PyTorch's
# elementwise kernels run 300-1100 characters, most of it the launcher's template arguments. In
# prose a kernel goes by a short label (results.json and --diff keep the full names).
_LAUNCHERS = frozenset(
    (
        "elementwise_kernel",
        "vectorized_elementwise_kernel",
        "unrolled_elementwise_kernel",
        "elementwise_kernel_with_index",
        "reduce_kernel",
        "multi_tensor_apply_kernel",
    )
)
# Wrappers inside a launcher's template arguments that do not name the operation.
_WRAPPERS = frozenset(
    (
        "gpu_kernel_impl",
        "gpu_kernel_impl_nocast",
        "ReduceOp",
        "func_wrapper_t",
        "TensorListMetadata",
        "FusedOptimizerTensorListMetadata",
        "AUnaryFunctor",
        "BUnaryFunctor",
        "BinaryFunctor",
        "lambda",
        "operator",
        "array",
    )
)
_CALLEE = re.compile(r"([A-Za-z_]\w*)(?=[(<])")
_LAMBDA_ARGS = re.compile(r"\{lambda\(([^()]+)\)#\d+\}")
_TEMPLATE_ARG = re.compile(r"(?:Functor|ReduceOp|_add)<(?:c10::)?((?:unsigned )?\w+)")


_TRITON_SERIAL = re.compile(r"(triton_\w+?)_\d+")


def unnumbered(name: str) -> str:
    """A Triton kernel's name without the serial number Inductor gives it within its graph."""
    return triton.group(1) if (triton := _TRITON_SERIAL.fullmatch(name)) else name


def kernel_label(name: str) -> str:
    """A CUDA kernel's short name for prose.

    A PyTorch launcher (`elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel_cuda
    (...)::{lambda(c10::BFloat16)#1}>>(...)`) goes by the operation it runs and its dtype,
    `direct_copy_kernel_cuda<BFloat16>`, with "(casting)" when it loads or stores with a cast;
    any other templated or C++ kernel by its unqualified name (`softmax_warp_forward`,
    `fmha_cutlassF_bf16_aligned_64x64_rf_sm80`). Plain names (cuBLAS's `nvjet_…`, Triton's,
    cuDNN's generated kernels, `Memcpy DtoD (Device -> Device)`) stay as they are, but for the
    serial number Inductor gives each Triton kernel within its graph
    (`triton_poi_fused_gelu_view_13` is `triton_poi_fused_gelu_view`): the same fused kernel
    is numbered differently in two variants' graphs.
    """
    if (plain := unnumbered(name)) != name:
        return plain
    s = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    head = re.match(r"[\w:]+", s)
    if head is None or head.end() == len(s) or s[head.end()] not in "<(":
        return name
    base = head.group().rsplit("::", 1)[-1]
    if base not in _LAUNCHERS:
        return base
    rest = s[head.end() :]
    op = next((c for c in _CALLEE.findall(rest) if c not in _WRAPPERS), None)
    if op is None:
        return base
    dtype = _kernel_dtype(rest)
    text = f"{op}<{dtype}>" if dtype else op
    return text + (" (casting)" if "WithCast" in rest else "")


def _kernel_dtype(args: str) -> str | None:
    """The data type a launcher's operation runs on: the first template argument of its
    functor (or of ReduceOp), else the first non-bool parameter of its lambda (where's takes
    the condition first, masked_fill's the mask last)."""
    if m := _TEMPLATE_ARG.search(args):
        return m.group(1)
    for m in _LAMBDA_ARGS.finditer(args):
        types = [t.strip().removeprefix("c10::") for t in m.group(1).split(",")]
        if types != ["int"]:  # {lambda(int)#1}: the launcher's own index lambda
            return next((t for t in types if t != "bool"), types[0])
    return None


# Categories of "where the time goes". Each op's self time and each kernel's time counts under
# the outermost op around it that names a category (`enclosing_category`), else under its own
# name's (`time_category`); backward work counts where the forward op it came from does. In this
# model every linear layer is nn.Linear (aten::linear, or the oneDNN custom op) and only
# attention makes batched matmuls, softmax and masked_fill (the loss uses log_softmax). So what
# runs inside them (naive's hidden copy, the casts autocast adds around softmax) and their
# backward (a linear's weight-gradient transposes) count with them, and naive's matmuls and
# softmax count as attention, as the fused SDPA kernel that does the same work does.
# Dispatcher ops counted and timed: ATen's, and the oneDNN linear (training/cpu_linear.py's op and
# the mkldnn op it calls).
OP_NAMESPACES = ("aten::", "mkldnn::", "cpu_linear::")
LINEAR = "linear layers"
ATTENTION = "attention"
GEMM_KERNELS = "matmul kernels (linear layers; attention's too unless fused)"
OTHER = "everything else"
CATEGORIES = (LINEAR, ATTENTION, GEMM_KERNELS, OTHER)
# The record_function range the profiled steps of an eager cell put around each layer's call of
# its attention variant (measure.attention_calls_marked): all that runs inside is attention's.
ATTENTION_CALL = "attention"

_ATTENTION = re.compile(
    r"scaled_dot_product|flash|fmha|attention|sdpa"
    r"|^aten::(bmm|baddbmm|_?softmax|_safe_softmax|_softmax_backward_data|masked_fill_?)$"
    # Inductor's fused kernels, by the ops they fuse; the loss's log_softmax is not attention's
    r"|^triton_\w*(?<!log)_softmax|^triton_\w*masked_fill",
    re.I,
)
_LINEAR = re.compile(r"^aten::(mm|addmm|linear)$|^mkldnn::_linear_pointwise$|^cpu_linear::", re.I)
# A CUDA GEMM kernel's name does not say whether a linear layer or attention launched it
# (Inductor's Triton matmul templates are `triton_tem_fused_mm_…`, `…_addmm_…`, `…_bmm_…`).
_GEMM_KERNEL = re.compile(r"gemm|gemv|xmma|nvjet|cublas|cutlass|^triton_tem_fused_\w*mm", re.I)


def time_category(name: str) -> str:
    """The category of an ATen op or CUDA kernel by its name alone: one of CATEGORIES."""
    if _ATTENTION.search(name):
        return ATTENTION
    if _LINEAR.search(name):
        return LINEAR
    if _GEMM_KERNEL.search(name):
        return GEMM_KERNELS
    return OTHER


def enclosing_category(name: str) -> str | None:
    """The category an op gives to all that runs inside it (the ops it calls, the kernels they
    launch), or None. aten::matmul only dispatches to mm or bmm; a linear layer's goes through
    aten::linear, which encloses it, so one outside a linear is attention's."""
    if name == ATTENTION_CALL:
        return ATTENTION
    if not name.startswith(OP_NAMESPACES):
        return None  # annotations, Python functions, autograd nodes
    if name == "aten::matmul":
        return ATTENTION
    category = time_category(name)
    return category if category in (LINEAR, ATTENTION) else None


def time_split(times: dict[str, float]) -> dict[str, float]:
    """Shares (0..1) of the listed time by the category of each name alone: the report's fallback
    for a results.json that stored no split in the current categories."""
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in times.items():
        by_category[time_category(name)] += ms
    return shares(by_category)


def shares(times: dict[str, float]) -> dict[str, float]:
    """Each category's share (0..1) of the summed times by category."""
    total = sum(times.values()) or 1.0
    return {k: times[k] / total for k in CATEGORIES if k in times}
