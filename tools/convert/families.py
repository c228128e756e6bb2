"""The adapters, in the order ``to-hf`` tries them when the family is not recorded."""

from composer.convert.base import Adapter
from composer.convert.decoder import LlamaAdapter, MixtralAdapter, Qwen3Adapter, Qwen3MoeAdapter

ADAPTERS: list[Adapter] = [
    LlamaAdapter(),
    Qwen3Adapter(),
    Qwen3MoeAdapter(),
    MixtralAdapter(),
]
