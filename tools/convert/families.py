"""The adapters, in the order ``to-hf`` tries them when the family is not recorded."""

from composer.convert.base import Adapter
from composer.convert.decoder import LlamaAdapter, MixtralAdapter, Qwen3Adapter, Qwen3MoeAdapter
from composer.convert.granite import BambaAdapter, GraniteMoeHybridAdapter
from composer.convert.mamba import Mamba2Adapter, NemotronHAdapter

ADAPTERS: list[Adapter] = [
    LlamaAdapter(),
    Qwen3Adapter(),
    Qwen3MoeAdapter(),
    MixtralAdapter(),
    Mamba2Adapter(),
    NemotronHAdapter(),
    BambaAdapter(),
    GraniteMoeHybridAdapter(),
]
