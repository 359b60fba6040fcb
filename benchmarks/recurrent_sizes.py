"""Replay against the unrolled form for nn.LSTM and nn.GRU over batch sizes, sequence lengths and widths.

One process, one thread, CPU time per book-keeping step (forward + backward + norms + clipped sum, no noise) of a
one-layer recurrent layer (input = hidden size H, batch first) and a linear head on its last step; "replay" forces
the per-example replay the layer had before privacy/per_sample/recurrent.py (``recurrent.unrolls`` off while the
hooks are attached), "unrolled" is the library's default.

    python benchmarks/recurrent_sizes.py
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

SIZES = ((1, 16, 32), (2, 256, 32), (16, 256, 32), (2, 16, 256), (2, 64, 512), (16, 64, 512))  # (B, T, H)


def step_ms(cls: type[nn.RNNBase], batch: int, steps: int, hidden: int, unrolled: bool, repeats: int = 3) -> float:
    from lightning_privdec.privacy import PerSampleGradients
    from lightning_privdec.privacy.per_sample import recurrent

    torch.manual_seed(0)
    rnn, head = cls(hidden, hidden, batch_first=True), nn.Linear(hidden, 3)
    x, y = torch.randn(batch, steps, hidden), torch.randint(0, 3, (batch,))
    default = recurrent.unrolls
    if not unrolled:
        recurrent.unrolls = lambda module: False
    try:
        psg = PerSampleGradients(nn.ModuleList([rnn, head]), mode="bookkeeping")
    finally:
        recurrent.unrolls = default

    def step() -> None:
        nn.functional.cross_entropy(head(rnn(x)[0][:, -1]), y).backward()
        psg.clip_and_sum(1.0)
        psg.clear()

    step()
    start = time.process_time()
    for _ in range(repeats):
        step()
    psg.detach()
    return 1e3 * (time.process_time() - start) / repeats


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print("| layer | B | T | H | replay ms | unrolled ms | replay / unrolled |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cls in (nn.LSTM, nn.GRU):
        for batch, steps, hidden in SIZES:
            replay = step_ms(cls, batch, steps, hidden, unrolled=False)
            unrolled = step_ms(cls, batch, steps, hidden, unrolled=True)
            print(f"| {cls.__name__} | {batch} | {steps} | {hidden} | {replay:.1f} | {unrolled:.1f} | "
                  f"{replay / unrolled:.2f} |", flush=True)


if __name__ == "__main__":
    main()
