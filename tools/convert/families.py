"""The adapters, in the order ``to-hf`` tries them when the family is not recorded."""

from composer.convert.base import Adapter
from composer.convert.deepseek_v3 import DeepseekV3Adapter, DeepseekV32Adapter
from composer.convert.falcon_h1 import FalconH1Adapter
from composer.convert.gemma3 import Gemma3Adapter
from composer.convert.glm4_moe import Glm4MoeAdapter
from composer.convert.gpt_oss import GptOssAdapter
from composer.convert.granite import BambaAdapter, GraniteMoeHybridAdapter
from composer.convert.jamba import JambaAdapter
from composer.convert.kimi_linear import KimiLinearAdapter
from composer.convert.lfm2 import Lfm2Adapter, Lfm2MoeAdapter
from composer.convert.llama import LlamaAdapter
from composer.convert.mamba2 import Mamba2Adapter
from composer.convert.minimax_m2 import MiniMaxM2Adapter
from composer.convert.mixtral import MixtralAdapter
from composer.convert.nemotron_h import NemotronHAdapter
from composer.convert.olmo_hybrid import OlmoHybridAdapter
from composer.convert.qwen3 import Qwen3Adapter, Qwen3MoeAdapter
from composer.convert.qwen3_5_vl import Qwen3_5MoeVLAdapter, Qwen3_5VLAdapter
from composer.convert.qwen3_next import Qwen3_5Adapter, Qwen3_5MoeAdapter, Qwen3NextAdapter
from composer.convert.zamba2 import Zamba2Adapter

ADAPTERS: list[Adapter] = [
    LlamaAdapter(),
    Qwen3Adapter(),
    Qwen3MoeAdapter(),
    MixtralAdapter(),
    Mamba2Adapter(),
    NemotronHAdapter(),
    BambaAdapter(),
    GraniteMoeHybridAdapter(),
    JambaAdapter(),
    DeepseekV3Adapter(),
    DeepseekV32Adapter(),
    Glm4MoeAdapter(),
    MiniMaxM2Adapter(),
    OlmoHybridAdapter(),
    # The same config can be both: Qwen3-Next first (its published presets), Qwen3.5 by --arch.
    Qwen3NextAdapter(),
    Qwen3_5Adapter(),
    Qwen3_5MoeAdapter(),
    # The Hub's Qwen3.5 checkpoints: the text model above plus the vision tower.
    Qwen3_5VLAdapter(),
    Qwen3_5MoeVLAdapter(),
    Lfm2Adapter(),
    Lfm2MoeAdapter(),
    Gemma3Adapter(),
    KimiLinearAdapter(),
    GptOssAdapter(),
    FalconH1Adapter(),
    Zamba2Adapter(),
]
