"""The GPUs ``composer plan`` knows, from their vendors' datasheets (docs/planning.md).

``tflops``: dense bf16 tensor-core peak (half the "with sparsity" figure); fp8 doubles it.
``mem_gb``: HBM in GB (10^9 bytes, the datasheet's unit). ``hbm_tbs``: HBM bandwidth, TB/s.
``nvlink_gbs``: NVLink bandwidth per GPU and direction (half the datasheet's bidirectional
figure). ``net_gbs``: the scale-out network per GPU and direction (one 400 Gb/s NIC per GPU,
as in DGX/HGX systems: 50 GB/s). ``per_node``: GPUs per NVLink domain (an HGX board).
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.settings import ConfigError


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float
    mem_gb: float
    hbm_tbs: float
    nvlink_gbs: float
    net_gbs: float
    per_node: int = 8

    def peak_flops(self, precision: str) -> float:
        return self.tflops * 1e12 * (2 if precision == "fp8" else 1)

    @property
    def mem_bytes(self) -> int:
        return int(self.mem_gb * 1e9)


GPUS = {
    # H100 SXM5 datasheet: 1,979 TFLOP/s bf16 with sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink 4
    # 900 GB/s (bidirectional)
    "h100": GPU("h100", 989.5, 80, 3.35, 450, 50),
    # H200 SXM datasheet: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
    "h200": GPU("h200", 989.5, 141, 4.8, 450, 50),
    # HGX B200 datasheet (per GPU): 4.5 PFLOP/s bf16 with sparsity, 180 GB HBM3e at 8 TB/s,
    # NVLink 5 1.8 TB/s (bidirectional)
    "b200": GPU("b200", 2250, 180, 8.0, 900, 50),
}


def gpu(name: str | None, **given: float | None) -> GPU:
    """The named GPU with any of ``given`` (mem_gb, tflops, hbm_tbs, nvlink_gbs, net_gbs,
    per_node) replacing its numbers; without a name every number must be given."""
    import dataclasses

    given = {k: v for k, v in given.items() if v is not None}
    if name is None:
        missing = [k for k in ("mem_gb", "tflops", "hbm_tbs", "nvlink_gbs", "net_gbs")
                   if k not in given]
        if missing:
            raise ConfigError("give --gpu (h100, h200 or b200) or all of --mem-gib, --tflops, "
                              "--hbm-tbs, --nvlink-gbs and --net-gbs")
        return GPU("custom", **given)
    if name not in GPUS:
        raise ConfigError(f"--gpu must be one of {', '.join(GPUS)}; got {name!r}")
    return dataclasses.replace(GPUS[name], **given)
