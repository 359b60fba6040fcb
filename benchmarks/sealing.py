"""What sealed gossip costs (roster=, ChaCha20-Poly1305 per edge), in one process.

For the digits MLP (4,810 parameters) and the ``wide`` MLP of benchmarks/network.py (9.67M parameters), a push-sum
message (the flat parameters and the push-sum weight, float32) is sealed by one node and opened by its neighbour
with :class:`~lightning_privdec.comm.sealed.SealedExchange`, and timed (median of ``--repeats``):

* ``seal_ms``, ``open_ms``: one message, in the buffers ``exchange`` keeps per peer; ``ms_per_mb``: (seal + open) per MB of message, i.e. what one message costs
  its sender and its receiver together;
* ``step_ms``: one local training step of the same model (forward, backward and SGD on a batch of 32 digits), for
  scale; ``overhead``: (seal + open) / step, what sealing adds to a step of exponential-one-peer gossip (each node
  sends one message and receives one per step; on a ring with two neighbours it is twice that);
* ``wire_bytes``: the bytes the exchange counted for one sealed message, and ``plain_bytes`` without a roster: the
  difference is the 16-byte Poly1305 tag, exactly.

With ``--device cuda`` the message starts and ends on the GPU, so the times include the copies to the host and back
(the cipher runs on the CPU), reported separately as ``copy_ms``.

    python benchmarks/sealing.py --json sealing.json
    python benchmarks/sealing.py --device cuda --json sealing_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey  # noqa: E402

from lightning_privdec.comm import LoopbackNetwork, TensorSpec  # noqa: E402
from lightning_privdec.comm.identity import AuthenticatedSetup, seal_keys  # noqa: E402
from lightning_privdec.comm.sealed import SealedExchange  # noqa: E402
from network import build_net  # noqa: E402


def median_ms(fn, repeats: int, sync) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def edge_keys() -> list[dict[int, tuple[bytes, bytes]]]:
    private = [X25519PrivateKey.generate() for _ in range(2)]
    setup = AuthenticatedSetup(os.urandom(32), {0: "0", 1: "1"},
                               {r: k.public_key().public_bytes_raw() for r, k in enumerate(private)})
    return [seal_keys(private[r], setup, r, [1 - r]) for r in range(2)]


def measure(model: str, device: torch.device, repeats: int) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    net = build_net(model).to(device)
    d = sum(p.numel() for p in net.parameters())
    message = [torch.randn(d, device=device), torch.ones(1, device=device)]
    specs = [TensorSpec.of(t) for t in message]
    keys = edge_keys()
    network = LoopbackNetwork(2)
    sender, receiver = (SealedExchange(network.exchanges[r], keys[r]) for r in range(2))
    sealed: list[torch.Tensor] = []

    def seal() -> None:
        sealed[:] = [sender._seal(1, message, reuse=True)]

    def open_() -> None:
        count = receiver._opened.get(0, 0)
        receiver._opened[0] = count + 1
        receiver._open(0, sealed[0], specs, 0, count, reuse=True)

    # seal and open alternate so that the counters stay matched
    seal_times, open_times = [], []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        seal()
        sync()
        t1 = time.perf_counter()
        open_()
        sync()
        seal_times.append(t1 - t0)
        open_times.append(time.perf_counter() - t1)
    seal_ms, open_ms = 1e3 * statistics.median(seal_times[1:]), 1e3 * statistics.median(open_times[1:])
    copy_ms = 0.0
    if device.type == "cuda":
        flat = torch.cat([t.view(torch.uint8) for t in message])
        copy_ms = median_ms(lambda: flat.cpu().to(device), repeats, sync)

    # wire bytes of one round, plain and sealed (two nodes exchanging on the loopback network)
    def one_round(rank: int, exchange, seal_it: bool) -> int:  # noqa: ANN001
        exchange = SealedExchange(exchange, edge_keys_round[rank]) if seal_it else exchange
        cpu = [t.cpu() for t in message]
        exchange.exchange({1 - rank: cpu}, {1 - rank: specs})
        return exchange.traffic.bytes_sent

    edge_keys_round = edge_keys()
    plain_bytes = LoopbackNetwork(2).run(lambda r, e: one_round(r, e, False))[0]
    wire_bytes = LoopbackNetwork(2).run(lambda r, e: one_round(r, e, True))[0]

    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    step_ms = median_ms(step, repeats, sync)
    mb = (4 * d + 4) / 1e6
    return {
        "model": model, "device": str(device), "parameters": d, "message_mb": mb, "seal_ms": seal_ms,
        "open_ms": open_ms, "ms_per_mb": (seal_ms + open_ms) / mb, "copy_ms": copy_ms, "step_ms": step_ms,
        "overhead": (seal_ms + open_ms) / step_ms, "plain_bytes": plain_bytes, "wire_bytes": wire_bytes,
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | device | message | seal | open | (seal + open) per MB | copies to host and back | local step "
             "| sealing per one-peer step | bytes per message, sealed - plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['parameters']:,} params) | {r['device']} | {r['message_mb'] * 1e3:,.1f} KB | "
            f"{r['seal_ms']:.3f} ms | {r['open_ms']:.3f} ms | {r['ms_per_mb']:.2f} ms/MB | "
            f"{r['copy_ms']:.2f} ms | {r['step_ms']:.2f} ms | +{100 * r['overhead']:.1f} % | "
            f"{r['wire_bytes'] - r['plain_bytes']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="mlp,wide")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the benchmarks' one per process)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [measure(model, torch.device(args.device), args.repeats) for model in args.models.split(",")]
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
