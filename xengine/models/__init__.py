"""Model implementations keyed by HF ``architectures[0]``.

Torch-free at import: the service and scheduler use ``info.read_model_info`` and the registry's
names without loading torch; model classes are imported lazily by ``registry.get_model_class``.
"""

from xengine.models.info import ModelInfo, read_model_info
from xengine.models.registry import supported_architectures

__all__ = ["ModelInfo", "read_model_info", "supported_architectures"]
