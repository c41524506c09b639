"""Which kept library should carry KV blocks between replicas on CPU: pyzmq or torch.distributed
point-to-point over gloo? Moves the same blocks (the default model's: 16 tokens x 30 layers x
K and V x 3 heads x 64 dims, float32 = 720 KiB) between two processes on loopback, in chunks,
and reports the throughput of each. Prints one JSON line last.

    python -m benchmarks.kv_transfer_transport [--blocks 256] [--chunk-blocks 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time

from benchmarks import results_file

BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- pyzmq: DEALER -> ROUTER, one frame per block (zero-copy), one ack per chunk -----------------
def _zmq_receiver(port: int, chunks: int, rounds: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    for _ in range(rounds):
        for _ in range(chunks):
            frames = sock.recv_multipart(copy=False)
            sock.send_multipart([frames[0].bytes, b"ack"])
    sock.close(linger=0)
    ctx.term()


def _zmq_round_trips(port: int, blocks: int, chunk_blocks: int, rounds: int, window: int) -> list[float]:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    data = np.random.default_rng(0).integers(0, 255, (chunk_blocks, BLOCK_BYTES), dtype=np.uint8)
    chunks = blocks // chunk_blocks
    times = []
    for _ in range(rounds):
        t0, sent, acked = time.perf_counter(), 0, 0
        while acked < chunks:
            while sent < chunks and sent - acked < window:
                sock.send_multipart([b"hdr", *[memoryview(row) for row in data]], copy=False)
                sent += 1
            sock.recv()
            acked += 1
        times.append(time.perf_counter() - t0)
    sock.close(linger=0)
    ctx.term()
    return times


# -- torch.distributed gloo: one 2-rank group; isend/irecv of chunk tensors, `window` in flight ---
def _gloo_rank(rank: int, port: int, blocks: int, chunk_blocks: int, rounds: int, window: int,
               out) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buffers = [torch.randint(0, 255, (chunk_blocks, BLOCK_BYTES), dtype=torch.uint8)
               for _ in range(window)]
    chunks = blocks // chunk_blocks
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        pending = []
        for i in range(chunks):
            if len(pending) == window:
                pending.pop(0).wait()
            buf = buffers[i % window]
            pending.append(dist.isend(buf, 1) if rank == 0 else dist.irecv(buf, 0))
        for work in pending:
            work.wait()
        dist.barrier()  # the last chunk has arrived
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def measure_zmq(blocks: int, chunk_blocks: int, rounds: int, window: int) -> list[float]:
    port = _free_port()
    ctx = mp.get_context("spawn")
    receiver = ctx.Process(target=_zmq_receiver, args=(port, blocks // chunk_blocks, rounds))
    receiver.start()
    try:
        return _zmq_round_trips(port, blocks, chunk_blocks, rounds, window)
    finally:
        receiver.join(timeout=30)


def measure_gloo(blocks: int, chunk_blocks: int, rounds: int, window: int) -> list[float]:
    port = _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, blocks, chunk_blocks, rounds, window, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--chunk-blocks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window", type=int, default=4, help="chunks in flight (zmq: before an ack; gloo: isends outstanding)")
    args = ap.parse_args()
    total = args.blocks * BLOCK_BYTES
    results = {}
    for name, times in (("pyzmq", measure_zmq(args.blocks, args.chunk_blocks, args.rounds, args.window)),
                        ("gloo", measure_gloo(args.blocks, args.chunk_blocks, args.rounds, args.window))):
        best = min(times)
        results[name] = {"best_s": round(best, 4), "median_s": round(sorted(times)[len(times) // 2], 4),
                         "gb_per_s": round(total / best / 1e9, 3)}
        print(f"{name:6s} {total / 1e6:8.1f} MB in {best * 1e3:7.1f} ms best "
              f"({results[name]['gb_per_s']:.2f} GB/s), median {results[name]['median_s'] * 1e3:.1f} ms")
    summary = {"bytes": total, "block_bytes": BLOCK_BYTES, "chunk_blocks": args.chunk_blocks, **results,
               "zmq_over_gloo": round(results["pyzmq"]["gb_per_s"] / results["gloo"]["gb_per_s"], 3)}
    print(json.dumps(summary))
    results_file.write("kv_transfer_transport", summary, {"args": vars(args)})


if __name__ == "__main__":
    main()
