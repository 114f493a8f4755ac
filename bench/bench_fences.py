"""Where the hook's per-step time goes: the live-length and record kernels with and without
their system-scope fences (and %globaltimer), in CUDA graphs (20 launches per graph; per-launch time). Diagnostic only: the fence-free
variants are not correct for a concurrent writer/reader.

    python3 bench/bench_fences.py
"""
import os

import torch

from vcap.engine_hook import live_length, telemetry
from vcap.engine_hook.step import VerifyHook
from vcap.segment import Segment, SegmentConfig

from bench_hook import time_graph  # noqa: E402


def main():
    segment = Segment.create(f"vcap-fence-{os.getpid()}", SegmentConfig(stride=6, max_bs=256, num_moe_layers=43))
    try:
        hook = VerifyHook(segment, count_experts=False, path="mapped")
        conf = torch.rand(256, 5, device="cuda")
        hook.prepare(64, True)
        results = {}
        for asm in (True, False):
            for timer in (True, False):
                hook.state.device_clock = timer
                live_length._INTERPRET = not asm  # USE_ASM follows this switch
                results[f"live asm={asm} timer={timer}"] = time_graph(lambda: [hook.begin(conf) for _ in range(20)], reps=100) / 20
            telemetry._INTERPRET = not asm
            results[f"record asm={asm}"] = time_graph(lambda: [hook.end(conf) for _ in range(20)], reps=100) / 20
        dummy = torch.zeros(1, device="cuda")
        results["torch add_ (1 elem)"] = time_graph(lambda: [dummy.add_(1) for _ in range(20)], reps=100) / 20
        for name, us in results.items():
            print(f"{name:32s} {us:7.2f} us", flush=True)
        hook.close()
    finally:
        segment.unlink()


if __name__ == "__main__":
    main()
