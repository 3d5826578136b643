"""Would deeper or wider tile configs help the GEMMs? At every shape of shared/BENCH.md the eager autotuner
picks the largest tile of the gate/up, dh (two-pass) and wgrad lists (benchmarks/tuned_configs.py), so the
best may lie beyond them. Per shape, breakdown.py's rows for those kernels (and the down/dx GEMM) with the
package's lists, then with each list extended by the candidates below (4 stages; 256-row or 256-column
tiles), in one process; the extended autotuners' picks are printed at the end of each shape.

    python benchmarks/config_ab.py [--shapes gpt-oss-20b,qwen3-30b-a3b] [--kernels gate_up,two-pass,...]  # GPU
"""

from __future__ import annotations

import argparse
import os
import sys

import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from breakdown import breakdown  # noqa: E402

from mok_inductor.kernels import moe_bwd, moe_fwd  # noqa: E402
from mok_inductor.kernels._launch import cfg, with_pre_hook  # noqa: E402

CANDIDATES = {(moe_fwd, "_gate_up_kernel"): [cfg(128, 128, 64, 8, 4), cfg(64, 256, 64, 8, 3)],
              (moe_fwd, "_grouped_rows_kernel"): [cfg(128, 256, 64, 8, 4), cfg(256, 128, 64, 8, 3)],
              (moe_bwd, "_bwd_gemm_kernel"): [cfg(128, 256, 64, 8, 4), cfg(256, 128, 64, 8, 3)],
              (moe_bwd, "_wgrad_kernel"): [cfg(128, 256, 64, 8, 4)]}
KERNELS = "fwd gate_up (+gather),fwd down,two-pass,wgrad down,gate+up (one launch),dx (gate+up"


def retuned(kernel, configs):
    """The autotuner `kernel` (an eager one of `_launch.autotune`) over `configs` in place of its own, with the
    same key, restored arguments and pre-hook (the TMA block shapes)."""
    return triton.autotune(configs=with_pre_hook(configs, kernel.configs[0].pre_hook), key=list(kernel.keys),
                           restore_value=list(kernel.restore_value) or None)(kernel.fn)


def extended(kernel, extra):
    """`kernel` over its configs plus `extra` (`retuned`)."""
    return retuned(kernel, list(kernel.configs) + list(extra))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--kernels", default=KERNELS, help="breakdown.py --kernels")
    a = p.parse_args()
    only = a.kernels.split(",")
    base = {where: getattr(*where) for where in CANDIDATES}
    ext = {where: extended(k, CANDIDATES[where]) for where, k in base.items()}
    for shape in a.shapes.split(","):
        print(f"== {shape}: the package's configs", flush=True)
        breakdown(shape, only=only)
        try:
            for (module, name), k in ext.items():
                setattr(module, name, k)
            print(f"== {shape}: with the candidates", flush=True)
            breakdown(shape, only=only)
        finally:
            for (module, name), k in base.items():
                setattr(module, name, k)
        for (_, name), k in ext.items():
            for key, c in k.cache.items():
                print(f"   {name} picked {c} for {key[:6]}", flush=True)


if __name__ == "__main__":
    main()
