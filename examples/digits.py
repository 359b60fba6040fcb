"""Quick start: private decentralized training on scikit-learn's handwritten digits, on CPU.

    python examples/digits.py                                   # DP-CSGP, RandK(0.5), 4 nodes, epsilon = 3
    python examples/digits.py --strategy privsgp --epsilon 1
    python examples/digits.py --strategy dp_csgp --compressor qsgd:8 --epsilon 8
    python examples/digits.py --strategy decor --epsilon 3      # Decor on a ring, eavesdropper SecLDP
    python examples/digits.py --strategy dyn_d2p --epsilon 1 --strategy-kwargs '{"rho_c": 2, "rho_mu": 2}'
    python examples/digits.py --strategy push_sum               # non-private baseline

Each node trains on its own shard (1,347 training images split over the nodes), gossips with its graph neighbours
and never shares raw data or gradients. Prints every node's test accuracy, the accuracy of the network-average model,
the epsilon each node spent (from its accountant) and the bytes each node sent.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import lightning as L
import torch

from lightning_privdec import PrivacyBudgetCallback
from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule, accuracy
from lightning_privdec.strategies import NON_PRIVATE_STRATEGIES, PRIVATE_STRATEGIES
from lightning_privdec.strategies.checks import gather_tensors

DEFAULT_TOPOLOGY = {
    "dp2sgd": "ring", "dpsgd": "ring", "decor": "ring", "dyn_d2p": "exponential-one-peer", "cpgt": "ring",
}


def consensus_step(text: str) -> float | str:
    """``--gamma``: "auto" or a number."""
    return text if text == "auto" else float(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="dp_csgp", choices=sorted(PRIVATE_STRATEGIES) + sorted(NON_PRIVATE_STRATEGIES))
    p.add_argument("--topology", default=None, help="graph name (default: exponential; ring for dp2sgd/dpsgd)")
    p.add_argument("--compressor", default=None, help="none, randk:R, topk:R, qsgd:B, sign (dp_csgp: randk:0.5)")
    p.add_argument("--gamma", type=consensus_step, default="auto",
                   help="consensus step of compressed gossip: a number in (0, 1] or auto (default: chosen at setup)")
    p.add_argument("--epsilon", type=float, default=3.0, help="per-node target epsilon (default 3)")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--clip", type=float, default=1.0, help="per-sample clipping bound C (default 1.0)")
    p.add_argument("--accountant", default="rdp", choices=["rdp", "prv", "gdp"], help="DP-SGD strategies' accountant")
    p.add_argument("--adversary", default="eavesdropper", help="decor: eavesdropper, curious or a number of colluders")
    p.add_argument("--baseline", default=None, choices=["ldp", "cdp"], help="decor: the paper's LDP or CDP baseline")
    p.add_argument("--nodes", type=int, default=4, help="number of nodes = CPU processes (default 4)")
    p.add_argument("--epochs", type=int, default=30, help="training epochs (default 30)")
    p.add_argument("--batch-size", type=int, default=32, help="expected per-node batch size B (q = B / J)")
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 0.5 private, 0.1 non-private)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy-kwargs", default="{}", help='extra strategy arguments as JSON, e.g. \'{"rho_c": 2}\'')
    p.add_argument("--json", action="store_true", help="print one JSON line with the results")
    return p.parse_args()


def build_strategy(args: argparse.Namespace):  # noqa: ANN201
    topology = args.topology or DEFAULT_TOPOLOGY.get(args.strategy, "exponential")
    compressor = args.compressor
    if compressor is None:
        compressor = "randk:0.5" if args.strategy == "dp_csgp" else "none"
    gamma = "auto" if args.gamma is None else args.gamma
    common = dict(topology=topology, compressor=compressor, consensus_step=gamma, seed=args.seed)
    common.update(json.loads(args.strategy_kwargs))
    if args.strategy in NON_PRIVATE_STRATEGIES:
        return NON_PRIVATE_STRATEGIES[args.strategy](**common)
    if args.strategy == "decor":  # SecLDP accounting against the chosen adversary
        extra = dict(adversary=int(args.adversary) if args.adversary.isdigit() else args.adversary, baseline=args.baseline)
    else:
        extra = dict(accountant=args.accountant)
    return PRIVATE_STRATEGIES[args.strategy](
        **common, **extra, max_grad_norm=args.clip, target_epsilon=args.epsilon, target_delta=args.delta
    )


def main() -> None:
    args = parse_args()
    private = args.strategy in PRIVATE_STRATEGIES
    lr = args.lr if args.lr is not None else (0.5 if private else 0.1)
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    model = DigitsClassifier(lr=lr)
    data = DigitsDataModule(batch_size=args.batch_size, seed=args.seed)
    strategy = build_strategy(args)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=[PrivacyBudgetCallback(log_every_n_steps=50)] if private else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    elapsed = time.perf_counter() - start

    # Evaluation only: every node scores its own model; the network average is formed for reporting, never trained.
    test_x, test_y = data.tensors["test"]
    node_acc = gather_tensors(torch.tensor([accuracy(model, test_x, test_y)])).reshape(-1).tolist()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    average = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(gather_tensors(params).mean(0), average.parameters())
    traffic = trainer.strategy.gossip.exchange.traffic
    sent = gather_tensors(torch.tensor([traffic.bytes_sent], dtype=torch.float64)).reshape(-1).tolist()
    epsilons = None
    if private:
        engine = trainer.strategy.privacy
        epsilons = gather_tensors(torch.tensor([engine.epsilon()], dtype=torch.float64)).reshape(-1).tolist()
    paper_epsilons = None  # Dyn-D2P also offers the paper's CLT value (an approximation, not the epsilon spent)
    if private and callable(getattr(trainer.strategy.privacy, "paper_epsilon", None)):
        paper = torch.tensor([trainer.strategy.privacy.paper_epsilon()], dtype=torch.float64)
        paper_epsilons = gather_tensors(paper).reshape(-1).tolist()
    if not trainer.is_global_zero:
        return
    result = {
        "strategy": args.strategy,
        "topology": trainer.strategy.topology.name,
        "compressor": str(trainer.strategy.compressor),
        "nodes": args.nodes,
        "target_epsilon": args.epsilon if private else None,
        "delta": trainer.strategy.privacy.delta if private else None,  # 0 for pure-DP strategies (CPGT)
        "epsilon_per_node": epsilons,
        "epsilon_paper_clt_per_node": paper_epsilons,
        "noise_multiplier": trainer.strategy.privacy.noise_multiplier if private else None,
        "sigma_cdp": getattr(trainer.strategy.privacy, "sigma_cdp", None) if private else None,
        "sigma_cor": getattr(trainer.strategy.privacy, "sigma_cor", None) if private else None,
        "noise_split": getattr(trainer.strategy.privacy, "split", None) if private else None,
        "steps": trainer.global_step,
        "test_acc_per_node": node_acc,
        "test_acc_average_model": accuracy(average, test_x, test_y),
        "bytes_sent_per_node": sent,
        "bytes_sent_per_node_per_step": sent[0] / max(1, trainer.global_step),
        "seconds": elapsed,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"\n{args.strategy} on {result['topology']} ({result['compressor']}), {args.nodes} nodes, {trainer.global_step} steps, {elapsed:.0f} s")
    for i, acc in enumerate(node_acc):
        eps = f"  epsilon={epsilons[i]:.3f} (delta={args.delta:g})" if private else ""
        print(f"  node {i}: test accuracy {acc:.4f}{eps}  sent {sent[i] / 1e6:.2f} MB")
    print(f"  network-average model: test accuracy {result['test_acc_average_model']:.4f}")
    if args.strategy == "decor":
        print(f"  Decor noise sigma_cdp={result['sigma_cdp']:.3f}, sigma_cor={result['sigma_cor']:.3f} (SecLDP against "
              f"{args.adversary}, calibrated for epsilon={args.epsilon})")
    elif private:
        print(f"  noise multiplier sigma={result['noise_multiplier']:.3f} (calibrated for epsilon={args.epsilon}, {args.accountant})")


if __name__ == "__main__":
    main()
