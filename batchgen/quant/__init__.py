"""Weight-only quantization (int8, int4, fp8) of a built model, with torchao or optimum-quanto."""

from batchgen.model.memory import tensor_bytes, weight_bytes
from batchgen.quant.quantize import default_backend, make_scheme, quantize_model
from batchgen.quant.scheme import QuantBackend, QuantMethod, QuantScheme, available

__all__ = [
    "QuantBackend",
    "QuantMethod",
    "QuantScheme",
    "available",
    "default_backend",
    "make_scheme",
    "quantize_model",
    "tensor_bytes",
    "weight_bytes",
]
