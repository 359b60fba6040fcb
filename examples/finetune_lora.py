"""Private decentralized LoRA fine-tuning of a GPT-2: only the adapters are trained, clipped, noised and gossiped.

    python examples/finetune_lora.py --synthetic          # offline: a small GPT-2 from a config, synthetic text
    python examples/finetune_lora.py --model gpt2 --text-file train.txt --nodes 2 --max-steps 200

LoRA (Hu et al. 2022) through Hugging Face's ``peft`` freezes the model and adds low-rank adapters to the attention
projections (``c_attn``); per-sample clipping and the noise touch only the adapters' parameters, and so does the
gossip: the bytes each node sends per step scale with the adapters, not with the model (printed at the end, beside
the whole model's size). The privacy unit is one sequence.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec import DPCSGPStrategy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--synthetic", action="store_true",
                   help="a small GPT-2 from a config and synthetic sequences (no download)")
    p.add_argument("--model", default="gpt2", help="Hugging Face model name or folder (without --synthetic)")
    p.add_argument("--text-file", default=None, help="training text, one example per line (without --synthetic)")
    p.add_argument("--sequence-length", type=int, default=32)
    p.add_argument("--examples", type=int, default=512, help="synthetic training sequences")
    p.add_argument("--rank", type=int, default=4, help="LoRA rank r")
    p.add_argument("--nodes", type=int, default=2, help="number of nodes = CPU processes")
    p.add_argument("--batch-size", type=int, default=16, help="expected per-node batch size B (q = B / J)")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0, help="per-sample clipping bound C")
    p.add_argument("--epsilon", type=float, default=8.0, help="per-node target epsilon")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_model(args: argparse.Namespace):  # noqa: ANN201
    """GPT-2 with LoRA adapters on its attention projections; everything else frozen by peft."""
    import peft
    import transformers

    if args.synthetic:
        config = transformers.GPT2Config(vocab_size=64, n_positions=args.sequence_length, n_embd=64, n_layer=2,
                                         n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
        base = transformers.GPT2LMHeadModel(config)
    else:
        base = transformers.GPT2LMHeadModel.from_pretrained(args.model)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["c_attn"], lora_dropout=0.0,
                           fan_in_fan_out=True)  # fmt: skip
    return peft.get_peft_model(base, lora)


def build_data(args: argparse.Namespace, vocab_size: int) -> TensorDataset:
    """(token ids, attention mask) of shape (N, T): a fixed random Markov chain with --synthetic (learnable), else
    the text file tokenized with the model's tokenizer, padded to --sequence-length."""
    if args.synthetic:
        g = torch.Generator().manual_seed(args.seed)
        successors = torch.randint(0, vocab_size, (vocab_size, 2), generator=g)  # two likely next tokens per token
        ids = torch.empty(args.examples, args.sequence_length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab_size, (args.examples,), generator=g)
        for t in range(1, args.sequence_length):
            pick = torch.randint(0, 2, (args.examples,), generator=g)
            ids[:, t] = successors[ids[:, t - 1], pick]
        return TensorDataset(ids, torch.ones_like(ids))
    import transformers

    if args.text_file is None:
        raise SystemExit("give --text-file (one training example per line), or run with --synthetic")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    with open(args.text_file, encoding="utf8") as f:
        lines = [line.strip() for line in f if line.strip()]
    encoded = tokenizer(lines, max_length=args.sequence_length, truncation=True, padding="max_length",
                        return_tensors="pt")  # fmt: skip
    return TensorDataset(encoded["input_ids"], encoded["attention_mask"])


class LoRALanguageModel(L.LightningModule):
    """Next-token loss averaged per sequence, then over the batch (the privacy unit is the sequence)."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        tokens = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none") * mask[:, 1:]
        loss = (tokens.sum(dim=1) / mask[:, 1:].sum(dim=1).clamp(min=1)).mean()
        self.log("train_loss", loss, batch_size=ids.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    model = build_model(args)
    module = LoRALanguageModel(model, args.lr)
    data = build_data(args, model.config.vocab_size)
    strategy = DPCSGPStrategy(compressor=None, max_grad_norm=args.clip, target_epsilon=args.epsilon,
                              target_delta=args.delta, seed=args.seed)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=args.nodes, strategy=strategy, max_steps=args.max_steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, shuffle=True))
    elapsed = time.perf_counter() - start
    sent = trainer.strategy.gossip.exchange.traffic.bytes_sent
    epsilon = trainer.strategy.privacy.epsilon()
    if not trainer.is_global_zero:
        return
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(json.dumps({
        "nodes": args.nodes,
        "steps": trainer.global_step,
        "trainable_parameters": trainable,
        "all_parameters": sum(p.numel() for p in module.parameters()),
        "bytes_sent_node0_per_step": sent / max(1, trainer.global_step),
        "bytes_of_the_whole_model": sum(p.numel() * p.element_size() for p in module.parameters()),
        "epsilon_node0": epsilon,
        "seconds": elapsed,
    }))


if __name__ == "__main__":
    main()
