"""What the rank-0 rule costs per verify step through mapped inboxes (``engine_hook/tp_share.py``),
against an empty step measured in the same run.

    python bench/bench_tp_share.py --out share.json

One GPU (what runs when only one is lent): one process, rank 0's publish into an inbox on the same
GPU, then the receive, eager (as the plugin issues them, before the verify replay) and captured
in a CUDA graph (100 steps per graph); the baseline is a 1-element add issued the same way. This
is the kernels' own cost; it does not include the NVLink store latency.

Two or more GPUs: one process per GPU, rank 0 publishes to every other rank's inbox, eager; each
step also runs a 1-element NCCL all-reduce on every rank, the synchronisation a TP verify step
always has (it keeps rank 0 from running more than one step ahead, as the real step does), so
the baseline is that all-reduce alone; the same run also times the eager NCCL broadcast of the
live buffer (today's fallback) on top of the same all-reduce.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ITERATIONS, WARMUP, GRAPH_STEPS, REPLAYS = 2000, 200, 100, 20
STRIDE = 6


def _timed(step, iterations=ITERATIONS, warmup=WARMUP, barrier=None) -> float:
    """us per call of ``step`` on the current stream, CUDA events around ``iterations`` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iterations


def _graph_us(step) -> float:
    """us per step of ``GRAPH_STEPS`` steps captured in one graph, replayed ``REPLAYS`` times."""
    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_STEPS):
            step()
    return _timed(graph.replay, iterations=REPLAYS, warmup=2) / GRAPH_STEPS


def one_gpu() -> dict:
    from vcap.engine_hook.tp_share import INBOX_HEAD, LiveShare
    out = {}
    for max_bs in (64, 256, 1024):
        inbox = torch.zeros(INBOX_HEAD + 2 * max_bs, dtype=torch.int32, device="cuda")
        rank0 = LiveShare(0, torch.zeros(1, dtype=torch.int32, device="cuda"), [inbox], max_bs, STRIDE)
        rank1 = LiveShare(1, inbox, [], max_bs, STRIDE)
        live = torch.randint(1, STRIDE + 1, (max_bs,), dtype=torch.int32, device="cuda")
        received = torch.zeros_like(live)
        one = torch.zeros(1, device="cuda")

        def both():
            rank0.publish(live)
            rank1.receive(received)

        steps = {"add": lambda: one.add_(1), "publish+receive": both}
        for name, step in steps.items():
            out[f"eager {name} max_bs={max_bs}"] = _timed(step)
            out[f"graph {name} max_bs={max_bs}"] = _graph_us(step)
        # what the plugin runs: each side's step as a replay of its one-kernel graph
        rank0.bind(live)
        rank1.bind(received)
        out[f"eager step replays (publish+receive) max_bs={max_bs}"] = _timed(lambda: (rank0.step(), rank1.step()))
        torch.cuda.synchronize()
        assert torch.equal(received, live) and rank1.error_count() == 0, "the receive did not get rank 0's lengths"
    return out


def _rank(rank: int, world_size: int, init_file: str, results):
    from vcap.engine_hook.tp_share import build
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    cpu_group = torch.distributed.new_group(backend="gloo")

    def all_gather_object(obj):
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, obj, group=cpu_group)
        return gathered

    out = {}
    for max_bs in (64, 256, 1024):
        share = build(rank, world_size, max_bs, STRIDE, "cuda", all_gather_object)
        assert share is not None, "the ranks of one machine must share"
        live = torch.full((max_bs,), STRIDE, dtype=torch.int32, device="cuda")
        share.bind(live)
        sync = torch.zeros(1, device="cuda")
        steps = {"all-reduce (baseline)": lambda: torch.distributed.all_reduce(sync),
                 "share + all-reduce": lambda: (share.step(), torch.distributed.all_reduce(sync)),
                 "broadcast + all-reduce": lambda: (torch.distributed.broadcast(live, src=0),
                                                    torch.distributed.all_reduce(sync))}
        for name, step in steps.items():
            out[f"eager {name} max_bs={max_bs}"] = _timed(step, barrier=torch.distributed.barrier)
        out[f"receive errors max_bs={max_bs}"] = share.error_count()
    torch.distributed.destroy_process_group()
    results.put((rank, out))


def several_gpus(world_size: int) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    processes = [context.Process(target=_rank, args=(rank, world_size, init_file, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcome = dict(results.get(timeout=300) for _ in processes)
    for process in processes:
        process.join()
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here as JSON too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    count = torch.cuda.device_count()
    result = {"device": torch.cuda.get_device_name(0), "gpus": count, "torch": torch.__version__,
              "one_gpu_us_per_step": one_gpu()}
    if count >= 2:
        result["us_per_step_by_rank"] = several_gpus(count)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
