"""What the rank-0 rule's broadcast costs per step: NCCL broadcast of the int32 [max_bs] live
buffer between two GPUs, eager, back to back (as the plugin issues it before the verify replay),
against an empty step (a 1-element add) on the same stream.

    python bench/bench_broadcast.py          # on a machine with 2 GPUs
"""

import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ITERATIONS, WARMUP = 2000, 200


def _run(rank: int, init_file: str, results):
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    out = {}
    for max_bs in (64, 256, 1024):
        live = torch.full((max_bs,), 6, dtype=torch.int32, device="cuda")
        one = torch.zeros(1, device="cuda")
        for name, step in (("add", lambda: one.add_(1)),
                           ("broadcast", lambda: torch.distributed.broadcast(live, src=0))):
            for _ in range(WARMUP):
                step()
            torch.cuda.synchronize()
            torch.distributed.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(ITERATIONS):
                step()
            end.record()
            torch.cuda.synchronize()
            out[f"{name} max_bs={max_bs}"] = start.elapsed_time(end) * 1000 / ITERATIONS
    torch.distributed.destroy_process_group()
    results.put((rank, out))


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 1
    context = mp.get_context("spawn")
    results = context.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    processes = [context.Process(target=_run, args=(rank, init_file, results)) for rank in range(2)]
    for process in processes:
        process.start()
    outcome = dict(results.get(timeout=300) for _ in processes)
    for process in processes:
        process.join()
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                      "us_per_step_by_rank": outcome}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
