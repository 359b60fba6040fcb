"""Point-to-point exchange over torch.distributed (gloo on CPU, NCCL on CUDA) on the default process group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_privdec.comm.base import Exchange
from lightning_privdec.comm.wire import TensorSpec, message_nbytes, pack, unpack


class TorchDistributedExchange(Exchange):
    """One ``batch_isend_irecv`` per round: an isend per out-neighbour and an irecv per in-neighbour.

    Uses the default process group (no process group per edge, so no creation-order hangs). With NCCL the CUDA
    device of this rank must be set before the first round (Lightning's strategies do this at setup).
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedExchange needs an initialised torch.distributed process group")
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.device = device
        self.group = group

    def exchange(
        self,
        outgoing: Mapping[int, Sequence[Tensor]],
        incoming: Mapping[int, Sequence[TensorSpec]],
    ) -> dict[int, list[Tensor]]:
        self._check_peers(outgoing, incoming)
        send_buffers = {peer: pack(tensors) for peer, tensors in outgoing.items()}
        recv_buffers = {
            peer: torch.empty(message_nbytes(specs), dtype=torch.uint8, device=self.device)
            for peer, specs in incoming.items()
        }
        ops = [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in send_buffers.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in recv_buffers.items()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.traffic.record(
            {peer: buf.numel() for peer, buf in send_buffers.items()},
            {peer: buf.numel() for peer, buf in recv_buffers.items()},
        )
        return {peer: unpack(recv_buffers[peer], specs) for peer, specs in incoming.items()}
