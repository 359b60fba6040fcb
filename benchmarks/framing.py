"""What carrying sealed gossip over length-framed TCP costs against gloo (roster=, two processes on this machine).

With a roster the gossip's sealed messages travel over :class:`~lightning_privdec.comm.framed.FramedExchange` (one
TCP connection per edge, an 8-byte length read before each message, so that no message size can abort the receiver)
instead of gloo's point-to-point send and receive. Two processes exchange one sealed message each way per round, as
two neighbours do in every gossip step, over each transport in turn; per message size it reports the median time of
a round (``round_ms``, seal + send + receive + open on the slower of the two processes) and the bytes the exchange
counted per message (``wire_bytes``: the plain message, +16 for the Poly1305 tag, +8 for the length with framing).

Sizes: the digits MLP's push-sum message (4,810 parameters and the weight, float32: 19 KB) and the ``wide`` MLP's of
benchmarks/network.py (9.67M parameters: 38.7 MB).

    python benchmarks/framing.py --json framing.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_privdec.comm import TensorSpec, TorchDistributedExchange  # noqa: E402
from lightning_privdec.comm.framed import FramedExchange  # noqa: E402
from lightning_privdec.comm.sealed import SealedExchange  # noqa: E402

SIZES = {"digits MLP": 4_810 + 1, "wide MLP": 9_670_000 + 1}  # float32 entries of one push-sum message


def _worker(rank: int, store: str, keys: dict, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    peer = 1 - rank
    mine = {peer: keys[(rank, peer)]}
    rows = []
    for transport in ("gloo", "framed"):
        timeout = timedelta(seconds=120)
        inner = (TorchDistributedExchange(torch.device("cpu"), timeout=timeout) if transport == "gloo"
                 else FramedExchange(torch.device("cpu"), mine, timeout))
        exchange = SealedExchange(inner, mine)
        for model, numel in SIZES.items():
            message = torch.randn(numel)
            times = []
            for i in range(repeats + 2):  # two rounds of warm-up (buffers, connections)
                dist.barrier()
                start = time.perf_counter()
                exchange.exchange({peer: [message]}, {peer: [TensorSpec((numel,), torch.float32)]})
                if i >= 2:
                    times.append(time.perf_counter() - start)
            before = exchange.traffic.bytes_sent
            exchange.exchange({peer: [message]}, {peer: [TensorSpec((numel,), torch.float32)]})
            rows.append({"transport": transport, "model": model, "message_bytes": numel * 4,
                         "wire_bytes": exchange.traffic.bytes_sent - before,
                         "round_ms": 1e3 * statistics.median(times)})
        exchange.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    keys = {(0, 1): (os.urandom(32), os.urandom(32))}
    keys[(1, 0)] = keys[(0, 1)][::-1]  # node 1 receives with node 0's sending key and sends with its receiving one
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(f"{tmp}/store", keys, args.repeats, tmp), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    rows = [{**a, "round_ms": max(a["round_ms"], b["round_ms"])} for a, b in zip(*ranks)]
    print(f"{'transport':>9} {'model':>11} {'message':>12} {'wire bytes':>12} {'round ms':>9}")
    for row in rows:
        print(f"{row['transport']:>9} {row['model']:>11} {row['message_bytes']:>12} {row['wire_bytes']:>12} "
              f"{row['round_ms']:>9.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "repeats": args.repeats}, indent=1))


if __name__ == "__main__":
    main()
