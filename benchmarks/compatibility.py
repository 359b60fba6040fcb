"""Which models train with which private strategy and per-sample mode: the compatibility matrix of docs/models.md.

Every model is one users bring, built unchanged from a config (no weight download, tiny sizes): torchvision's
ResNet-18/50 (GroupNorm), MobileNetV3-small and EfficientNet-B0 (BatchNorm, so ``fix_model=True``), a small
VisionTransformer, Lightning's own Transformer and LSTM demos, a GRU, a language model with an Embedding, RMSNorm
and tied weights, Hugging Face GPT-2 and BERT (the privacy unit is a sequence), GPT-2 with LoRA adapters (peft), a
frozen backbone and Lightning's BoringModel. Each trains for ``--steps`` steps on synthetic data in one 2-process gloo run per cell
(every cell is a fresh Trainer; one launch per model, so a failure cannot break another model's cells), with each
private strategy and each ``grad_sample_mode`` it accepts. A cell reads

* ``trains``: the loss stayed finite and the node's epsilon was spent (> 0);
* ``refused: ...``: the library refused the combination before training, with its reason;
* ``fails: ...``: anything else (the error's first line).

It also times one private step (book-keeping) against one non-private step per model in one process and thread (CPU
time, forward + backward [+ clip + noise], the two alternating) and writes the table to docs/models.md
(``--no-record``: print only; ``--ratios-only``: only these times, e.g. ``--library`` of an older tree against this
one's, or ``--before TREE --rounds N``: both, in alternating processes, medians side by side).

    python benchmarks/compatibility.py                                 # everything (about 20 minutes on 2 cores)
    python benchmarks/compatibility.py --models resnet18,gpt2 --strategies dp_csgp --modes bookkeeping --no-record
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from machine_info import machine_line, software_line  # noqa: E402

from tests.strategy_arguments import PRIVATE_STRATEGY_ARGUMENTS as STRATEGY_ARGUMENTS  # noqa: E402

MODES = ("bookkeeping", "hooks", "functorch", "ghost")
#: why a model fails or is refused where the reason is not in the cell
NOTES = {
    "lstm_demo": "Lightning's LSTM demo carries its hidden state from one batch into the next (truncated "
    "backpropagation over one stream), so one example's data would reach later steps' gradients, which no step's "
    "clipping bounds (and a Poisson batch changes size and membership every step): every per-sample mode refuses it "
    "before the first step, at the second forward pass of the per-example probe (ghost refuses its mean loss "
    "first). Reset the state per batch "
    "(`self.hidden = None` in training_step), as the `lstm` row does with the demo's own SimpleLSTM.",
    "boring": "BoringModel's configure_optimizers adds a learning-rate scheduler, which CPGT's constant-step bound "
    "refuses.",
    "ghost": "Ghost clipping needs training_step to return per-sample losses; the unchanged demos return a mean loss "
    "and are refused with that message.",
    "published size": "GPT-2 small and BERT-base as published (124M and 110M parameters, 50,257- and 30,522-token "
    "tables), 16 sequences of 64 tokens: the step-time ratio only (`--ratios-only --published`); their cells are the "
    "tiny configurations' above.",
}


# ---------------------------------------------------------------------------------------------------------------------
# the models, each with its task
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """A LightningModule factory and its synthetic training set."""

    module: Callable[[bool], Any]  # per_sample_loss -> LightningModule
    data: Callable[[], Any]  # -> a map-style Dataset
    fix_model: bool = False
    precision: str = "32-true"


def _classifier(build: Callable[[], Any], lr: float = 0.05):  # noqa: ANN202
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class Classifier(pl.LightningModule):
        def __init__(self, per_sample_loss: bool) -> None:
            super().__init__()
            self.model, self.per_sample_loss = build(), per_sample_loss

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            losses = F.cross_entropy(self.model(x), y, reduction="none")
            self.log("train_loss", losses.mean() if len(losses) else torch.zeros(()), sync_dist=True)
            return losses if self.per_sample_loss else losses.mean()

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=lr)

    return Classifier


def _language_model(build: Callable[[], Any], lr: float = 0.05):  # noqa: ANN202
    """Next-token loss per sequence (the privacy unit) of ``build()(ids) -> logits``."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class LanguageModel(pl.LightningModule):
        def __init__(self, per_sample_loss: bool) -> None:
            super().__init__()
            self.model, self.per_sample_loss = build(), per_sample_loss

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            ids, labels = batch
            logits = self.model(ids)
            if logits.dim() == 2:  # sequence classification
                losses = F.cross_entropy(logits, labels, reduction="none")
            else:
                per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
                losses = per_token.mean(1)
            return losses if self.per_sample_loss else losses.mean()

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=lr)

    return LanguageModel


def _images(n: int = 96, size: int = 32, classes: int = 10):  # noqa: ANN202
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))


def _tokens(n: int = 96, length: int = 16, vocab: int = 64, classes: int = 2):  # noqa: ANN202
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(1, vocab, (n, length), generator=g), torch.randint(0, classes, (n,), generator=g))


def cases(image_size: int = 32) -> dict[str, Case]:
    """The model zoo; the image models take ``image_size`` x ``image_size`` inputs (docs/models.md: 32)."""
    import functools

    import torch
    from torch import nn

    def group_norm(channels: int) -> nn.Module:
        return nn.GroupNorm(min(8, channels), channels)

    def resnet18():  # noqa: ANN202
        from torchvision.models import resnet18 as build

        return build(num_classes=10, norm_layer=group_norm)

    def resnet50():  # noqa: ANN202
        from torchvision.models import resnet50 as build

        return build(num_classes=10, norm_layer=group_norm)

    def mobilenet():  # noqa: ANN202
        from torchvision.models import mobilenet_v3_small

        return mobilenet_v3_small(num_classes=10)  # BatchNorm inside: needs fix_model=True

    def efficientnet():  # noqa: ANN202
        from torchvision.models import efficientnet_b0

        return efficientnet_b0(num_classes=10)  # BatchNorm inside: needs fix_model=True

    def vit():  # noqa: ANN202
        from torchvision.models import VisionTransformer

        return VisionTransformer(image_size=image_size, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                 mlp_dim=64, num_classes=10)

    class GRUClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.rnn, self.out = nn.Embedding(64, 16), nn.GRU(16, 24, batch_first=True), nn.Linear(24, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(self.embed(ids))[0][:, -1])

    class TiedLM(nn.Module):
        """Embedding, RMSNorm, a LayerNorm'd MLP block and an output layer tied to the embedding."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
            self.norm = nn.RMSNorm(32)
            self.out = nn.Linear(32, 64, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            return self.out(self.norm(h + self.block(h)))

    def gpt2(lora: bool = False):  # noqa: ANN202
        return _gpt2_logits(dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2), lora)

    def bert():  # noqa: ANN202
        return _bert_logits(dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=32, num_labels=2))

    def frozen_backbone():  # noqa: ANN202
        backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, 64), nn.ReLU())
        for p in backbone.parameters():
            p.requires_grad_(False)
        return nn.Sequential(backbone, nn.Linear(64, 10))

    def offline(module):  # noqa: ANN001, ANN202
        module.prepare_data = lambda: None  # the demos download WikiText2 here; the cells bring their own data
        return module

    def transformer_demo(per_sample_loss: bool):  # noqa: ANN202
        from lightning.pytorch.demos.transformer import LightningTransformer

        return offline(LightningTransformer(vocab_size=64))  # unchanged: training_step returns the mean token loss

    def lstm_demo(per_sample_loss: bool):  # noqa: ANN202
        from lightning.pytorch.demos.lstm import LightningLSTM

        return offline(LightningLSTM(vocab_size=64))

    def boring(per_sample_loss: bool):  # noqa: ANN202
        from lightning.pytorch.demos.boring_classes import BoringModel

        return BoringModel()

    class DemoLSTM(nn.Module):
        """The LSTM demo's own SimpleLSTM with a fresh state per batch (the demo carries it across batches)."""

        def __init__(self) -> None:
            super().__init__()
            from lightning.pytorch.demos.lstm import SimpleLSTM

            self.lstm = SimpleLSTM(vocab_size=64, ninp=32, nhid=32, nlayers=2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            log_probs, _ = self.lstm(ids, self.lstm.init_hidden(ids.shape[0]))
            return log_probs.view(ids.shape[0], ids.shape[1], -1)

    def demo_tokens():  # noqa: ANN202
        from torch.utils.data import TensorDataset

        ids = _tokens(length=17).tensors[0]
        return TensorDataset(ids[:, :-1], ids[:, 1:])  # (input, target) sequences, as the demos' WikiText2 yields

    def boring_data():  # noqa: ANN202
        from lightning.pytorch.demos.boring_classes import RandomDataset

        return RandomDataset(32, 96)

    images = functools.partial(_images, size=image_size)
    return {
        "resnet18": Case(_classifier(resnet18), images),
        "resnet50": Case(_classifier(resnet50), lambda: images(48)),
        "mobilenet_v3_small": Case(_classifier(mobilenet), images, fix_model=True),
        "efficientnet_b0": Case(_classifier(efficientnet), images, fix_model=True),
        "vit": Case(_classifier(vit), images),
        "transformer_demo": Case(transformer_demo, demo_tokens),
        "lstm_demo": Case(lstm_demo, demo_tokens),
        "lstm": Case(_language_model(DemoLSTM), _tokens),
        "gru": Case(_classifier(GRUClassifier), _tokens),
        "tied_embedding_rmsnorm": Case(_language_model(TiedLM), _tokens),
        "gpt2": Case(_language_model(gpt2), _tokens),
        "bert": Case(_language_model(bert), _tokens),
        "gpt2_lora": Case(_language_model(lambda: gpt2(lora=True)), _tokens),
        "frozen_backbone": Case(_classifier(frozen_backbone), images),
        "boring": Case(boring, boring_data),
        "resnet18_bf16": Case(_classifier(resnet18), images, precision="bf16-mixed"),
    }


def _gpt2_logits(config: dict, lora: bool = False):  # noqa: ANN202
    """Hugging Face's GPT2LMHeadModel of ``config`` (with LoRA adapters on its attention projections where
    ``lora``), returning the logits of input ids."""
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**config))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids).logits

    return Logits()


def _bert_logits(config: dict):  # noqa: ANN202
    """Hugging Face's BertForSequenceClassification of ``config``, returning the logits of input ids (token 0 is
    padding, masked)."""
    import torch
    from torch import nn
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(**config))

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=(ids != 0).long()).logits  # a padding mask

    return Logits()


def published_size_cases() -> dict[str, Case]:
    """GPT-2 small (124M parameters, its 50,257-token table tied to its output layer) and BERT-base (110M, a
    30,522-token table) as published, on 16 sequences of 64 tokens, for the step-time ratio only (``--published``):
    the zoo's tiny configurations have 64-token tables, which hide what a real vocabulary costs."""
    return {
        "gpt2_small (published size)": Case(_language_model(lambda: _gpt2_logits({})), lambda: _tokens(16, 64, 50257)),
        "bert_base (published size)": Case(_language_model(lambda: _bert_logits(dict(num_labels=2))),
                                           lambda: _tokens(16, 64, 30522)),
    }


# ---------------------------------------------------------------------------------------------------------------------
# child: every cell, in the same 2 processes
# ---------------------------------------------------------------------------------------------------------------------
def _first_sentence(error: BaseException) -> str:
    """A refusal's first sentence on one line (the matrix's footnotes and the ratio column quote it)."""
    return " ".join(str(error).split(". ")[0].split())


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:200]


def run_cell(name: str, case: Case, strategy: str, mode: str, args: argparse.Namespace) -> str:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_privdec.privacy import PrivacyConfigError
    from lightning_privdec.strategies import PRIVATE_STRATEGIES

    pl.seed_everything(0, verbose=False)
    try:
        built = PRIVATE_STRATEGIES[strategy](grad_sample_mode=mode, fix_model=case.fix_model, noise_seed=0,
                                             peer_timeout=120, **STRATEGY_ARGUMENTS[strategy])
    except PrivacyConfigError as refused:
        return f"refused: {_first_sentence(refused)}"[:200]
    module = case.module(mode == "ghost")
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=built, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        precision=case.precision, default_root_dir=args.workdir,
    )
    try:
        trainer.fit(module, DataLoader(case.data(), batch_size=16))
    except PrivacyConfigError as refused:
        return f"refused: {_first_sentence(refused)}"[:200]
    except Exception as error:  # noqa: BLE001 - the failure is the result
        return f"fails: {_first_line(error)}"
    finite = all(torch.isfinite(p).all() for p in module.parameters())
    epsilon = built.privacy.epsilon() if built.privacy is not None else 0.0
    if trainer.global_step == args.steps and finite and epsilon > 0:
        return "trains"
    return f"fails: {trainer.global_step} steps, finite parameters {finite}, epsilon {epsilon:.3g}"


def run_child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    zoo = cases()
    results: dict[str, dict[str, str]] = {}
    for name in args.model_list:
        for strategy in args.strategy_list:
            for mode in args.mode_list:
                start = time.perf_counter()
                results.setdefault(name, {})[f"{strategy}/{mode}"] = run_cell(name, zoo[name], strategy, mode, args)
                if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                    print(f"{name} {strategy}/{mode}: {results[name][f'{strategy}/{mode}']} "
                          f"({time.perf_counter() - start:.1f} s)", flush=True)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        args.out.write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------------------------------------
# parent: the cells (one 2-process launch), the step-time ratios (one process), docs/models.md
# ---------------------------------------------------------------------------------------------------------------------
def step_time_ratio(
    case: Case, steps: int = 3, clock: Callable[[], float] = time.perf_counter, parts: dict | None = None
) -> tuple[float, float]:
    """(non-private ms, private ms) per step in one process: forward + backward, and the same plus book-keeping
    clipping and noise (the default mode). The two steps alternate, so that both see the same load; each figure is
    the median of ``steps`` timings by ``clock`` after one warm-up step of each. A ``bf16-mixed`` case runs its
    forward under CPU autocast, as Lightning's precision plugin does. ``parts``: filled with the medians, in ms, of
    the private step's ``clipping`` (per-example norms and the clipped sums, after the backward pass) and ``noise``
    (the node's draw added into the gradients), timed inside the same steps."""
    import contextlib

    import torch

    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.algorithms.node import private_step
    from lightning_privdec.privacy.per_sample import check_private_model

    from torch.utils.data import default_collate

    dataset = case.data()
    batch = default_collate([dataset[i] for i in range(16)])

    def loss(module: Any) -> torch.Tensor:
        with (torch.autocast("cpu", dtype=torch.bfloat16) if case.precision == "bf16-mixed"
              else contextlib.nullcontext()):
            out = module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out

    plain = case.module(False)
    if case.fix_model:
        check_private_model(plain, fix=True)
    plain.log = lambda *a, **k: None  # no Trainer here
    private = case.module(False)
    private.log = lambda *a, **k: None
    engine = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), rank=0,
                        device=torch.device("cpu"), noise_seed=0)
    engine.attach(private, fix_model=case.fix_model)
    engine.noise_multiplier, engine.sample_rate, engine.expected_batch_size = 1.0, 0.1, 16.0
    timed: dict[str, list[float]] = {"plain": [], "private": [], "clipping": [], "noise": []}

    def timing(name: str, call: Callable) -> Callable:  # the part's time inside a timed private step
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                timed[name].append(clock() - start)
        return timed_call

    engine.clipping.clipped_sum = timing("clipping", engine.clipping.clipped_sum)
    engine.gaussian.noise_clipped_sum = timing("noise", engine.gaussian.noise_clipped_sum)
    steps_of = {"plain": lambda: (plain.zero_grad(), loss(plain).backward()),
                "private": lambda: (private.zero_grad(), loss(private).backward(), private_step(engine))}
    for warm_up in steps_of.values():
        warm_up()
    for _ in range(steps):
        for name, step in steps_of.items():
            start = clock()
            step()
            timed[name].append(clock() - start)
    if parts is not None:
        parts.update({name: 1e3 * statistics.median(timed[name][1:]) for name in ("clipping", "noise")})
    return 1e3 * statistics.median(timed["plain"]), 1e3 * statistics.median(timed["private"])


#: one symbol per cell of docs/models.md's matrix
TRAINS, NOT_RUN = "✓", "·"


def format_table(
    results: dict[str, dict[str, str]], ratios: dict[str, str], args: argparse.Namespace
) -> tuple[list[str], list[str]]:
    """(the matrix, its footnotes): one row per model, one column per strategy holding one symbol per per-sample
    mode (in ``args.mode_list`` order): ``✓`` trains, ``Rn`` refused and ``Fn`` fails for the reason of footnote n,
    ``·`` not run. Each distinct reason is written once, as a footnote."""
    reasons: dict[str, str] = {}  # reason text -> its footnote mark

    def symbol(cell: str) -> str:
        cell = " ".join(cell.replace("|", "/").split())
        if cell == "trains":
            return TRAINS
        if cell in ("", "-"):
            return NOT_RUN
        kind = "R" if cell.startswith("refused") else "F"
        if cell not in reasons:
            reasons[cell] = f"{kind}{sum(r.startswith(kind) for r in reasons.values()) + 1}"
        return reasons[cell]

    lines = ["| model | private / non-private step (1 process) | " + " | ".join(args.strategy_list) + " |",
             "|---|---|" + ":-:|" * len(args.strategy_list)]
    for name in [*results, *(name for name in ratios if name not in results)]:  # (ratio-only rows last)
        row = results.get(name, {})
        ratio = ratios.get(name, "-")
        ratio = ratio if ratio == "-" or ratio[0].isdigit() else symbol(ratio)
        cells = [" ".join(symbol(row.get(f"{s}/{m}", "-")) for m in args.mode_list) for s in args.strategy_list]
        lines.append(f"| {name} | {ratio} | " + " | ".join(cells) + " |")
    notes = [f"- **{mark}** {text.partition(': ')[2]}" for text, mark in sorted(reasons.items(), key=lambda item: (
        item[1][0], int(item[1][1:])))]
    return lines, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="all", help="comma list (default: every model)")
    parser.add_argument("--strategies", default=",".join(STRATEGY_ARGUMENTS), help="comma list of private strategies")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of grad_sample_mode values")
    parser.add_argument("--steps", type=int, default=2, help="training steps per cell")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (gloo) per cell")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds allowed for one model's cells in one mode")
    parser.add_argument("--no-ratios", action="store_true", help="skip the one-process step-time ratios")
    parser.add_argument("--ratios-only", action="store_true",
                        help="run no cells: only the step-time ratios, in one thread and process CPU time, printed "
                        "(with --json: written) and never recorded")
    parser.add_argument("--ratio-steps", type=int, default=None,
                        help="timed steps of each kind per model (default 5; 20 with --ratios-only)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="with --ratios-only: the image models' input side (docs/models.md's column: 32; a "
                        "larger one shows the ratio where the per-example work, not the noise, dominates)")
    parser.add_argument("--published", action="store_true",
                        help="with --ratios-only: GPT-2 small and BERT-base at their published sizes instead of the "
                        "zoo (a few minutes of CPU; docs/models.md's rows marked 'published size')")
    parser.add_argument("--library", type=Path, default=None,
                        help="import lightning_privdec from this tree (e.g. a git worktree of an older commit) to "
                        "compare its ratios with this checkout's on the same models")
    parser.add_argument("--before", type=Path, default=None,
                        help="with --ratios-only: alternate processes of this tree's library (e.g. a git worktree of "
                        "an older commit) and this checkout's, --rounds times, and print the medians side by side")
    parser.add_argument("--rounds", type=int, default=3, help="with --before: rounds of (before, after) processes")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "models.md")
    parser.add_argument("--no-record", action="store_true", help="print only; do not write docs/models.md")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="run nothing: the table of earlier runs' --json files (later ones fill in or replace; "
                        "a --ratios-only file gives the step-time column); docs/models.md shows "
                        "benchmarks/compatibility.json then benchmarks/compatibility_ratios.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.published and not args.ratios_only:
        parser.error("--published measures the step-time ratios only: use it with --ratios-only")
    known = list((published_size_cases if args.published else cases)()) if args.child or args.models == "all" else None
    args.model_list = known if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [s for s in args.strategy_list if s not in STRATEGY_ARGUMENTS] + [m for m in args.mode_list if m not in MODES]
    if unknown:
        parser.error(f"unknown strategies or modes: {unknown}")
    if args.image_size != 32 and not args.ratios_only:
        parser.error("--image-size sets the ratios' inputs only: use it with --ratios-only (the cells run 32 px)")
    if args.image_size < 8 or args.image_size % 8:
        parser.error(f"--image-size must be a positive multiple of 8 (the ViT's patch side), got {args.image_size}")
    return args


def run_launch(name: str, mode: str, args: argparse.Namespace) -> dict[str, str]:
    """Every strategy's cell of one model and one per-sample mode, in one launch of ``args.devices`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cells.json"
        command = [sys.executable, os.path.abspath(__file__), "--child", "--out", str(out), "--workdir", tmp,
                   "--models", name, "--strategies", ",".join(args.strategy_list), "--modes", mode,
                   "--steps", str(args.steps), "--devices", str(args.devices)]
        try:
            done = subprocess.run(command, timeout=args.timeout, cwd=tmp, capture_output=True, text=True)
            failure = None if out.exists() else f"fails: the launch exited with {done.returncode}" + (
                " (killed: out of memory?)" if done.returncode == -9 else "")
        except subprocess.TimeoutExpired:
            failure = f"fails: not finished within {args.timeout:.0f} s"
        if failure is None:
            return json.loads(out.read_text())[name]
        return {f"{s}/{mode}": failure for s in args.strategy_list}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.library is not None:
        sys.path.insert(0, str(args.library.resolve()))
    if args.child:
        run_child(args)
        return
    if args.ratios_only:
        (run_interleaved_ratios if args.before is not None else run_ratios)(args)
        return
    command_line = "python benchmarks/compatibility.py" + ("" if argv is None else " " + " ".join(argv))
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        results: dict[str, dict[str, str]] = {}
        ratios: dict[str, str] = {}
        for run in runs:  # later runs fill in or replace earlier cells
            if run.get("image_size", 32) != 32:
                raise SystemExit(f"a ratios run on {run['image_size']} px images is not docs/models.md's column "
                                 "(32 px): leave it out of --merge")
            for name, row in run["cells"].items():
                results.setdefault(name, {}).update(row)
            ratios.update({name: _ratio_text(value) for name, value in run["ratios"].items()})
        commands = [c for run in runs for c in ([run["command"]] if isinstance(run["command"], str) else run["command"])]
        commands.append(command_line.replace("--merge", "(tabulated by) --merge"))
        record(results, ratios, sum(run["seconds"] for run in runs), commands, args, _machines(runs))
        return
    zoo = cases()
    unknown = [m for m in args.model_list if m not in zoo]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(zoo)}")
    started = time.perf_counter()
    results = {}
    for name in args.model_list:
        results[name] = {}
        # one launch per model and mode: a crashed or memory-killed process takes only its own mode's cells with it
        for mode in args.mode_list:
            results[name].update(run_launch(name, mode, args))
        print(f"{name}: {results[name]}", flush=True)
    ratios = {}
    if not args.no_ratios:
        import torch

        from lightning_privdec.privacy import PrivacyConfigError

        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)  # as the cells' processes: two threads on a loaded machine wait on each other
        for name in args.model_list:
            try:
                plain, private = step_time_ratio(zoo[name], args.ratio_steps or 5, time.process_time)
                ratios[name] = f"{private / plain:.2f}x ({private:.0f} / {plain:.0f} ms)"
            except PrivacyConfigError as refused:
                ratios[name] = f"refused: {_first_sentence(refused)}"[:200]
            except Exception as error:  # noqa: BLE001
                ratios[name] = f"fails: {_first_line(error)}"
    total = time.perf_counter() - started
    if args.json is not None:
        args.json.write_text(json.dumps({"cells": results, "ratios": ratios, "seconds": total,
                                         "command": command_line,
                                         "machine": [machine_line(), software_line(opacus=True)]}, indent=1))
    record(results, ratios, total, [command_line], args)


def _machines(runs: list[dict]) -> list[str] | None:
    """The lines saying where merged runs ran: one machine's, or, where they ran on several, each run's with what it
    still gives the table (the cells of some models, the step-time column)."""
    every = sorted({name for run in runs for name in run["cells"]})
    last_cells = {(name, key): k for k, run in enumerate(runs) for name, row in run["cells"].items() for key in row}
    last_ratio = {name: k for k, run in enumerate(runs) for name in run["ratios"]}
    shown = []  # (run, what of the table it gave)
    for k, run in enumerate(runs):
        models = sorted({name for (name, _), last in last_cells.items() if last == k})
        parts = [] if not models else ["the cells"] if models == every else [
            f"the cells of {', '.join(models)}" if 2 * len(models) <= len(every)
            else f"the cells of every model but {', '.join(m for m in every if m not in models)}"]
        parts += ["the step-time column"] if k in last_ratio.values() else []
        if "machine" in run and parts:
            shown.append((run["machine"], " and ".join(parts)))
    if len({machine[0].split("; load average")[0] for machine, _ in shown}) <= 1:
        return shown[0][0] if shown else None
    return [f"{what}: {line}" for machine, what in shown for line in machine]


def _ratio_text(value: str | dict) -> str:
    """A ratio as the table prints it: a full run's text as it is; a ``--ratios-only`` run's figures formatted."""
    if isinstance(value, str):
        return value
    if "refused" in value:
        return f"refused: {value['refused']}"[:200]  # as a full run's ratios cut it
    text = f"{value['ratio']:.2f}x ({value['private_ms']:.0f} / {value['plain_ms']:.0f} ms"
    if "noise_ms" in value:  # the noise alone, against the non-private step: the ratio is at least 1 plus it
        text += f"; noise {value['noise_ms'] / value['plain_ms']:.2f}x"
    return text + ")"


def run_ratios(args: argparse.Namespace) -> None:
    """``--ratios-only``: each model's private / non-private step in one thread, process CPU time (the load of a
    shared machine moves wall-clock time far more than CPU time), with the library of ``--library`` if given."""
    import torch

    import lightning_privdec

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    zoo = published_size_cases() if args.published else cases(args.image_size)
    unknown = [m for m in args.model_list if m not in zoo]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(zoo)}")
    print(f"library: {Path(lightning_privdec.__file__).parent}", flush=True)
    from lightning_privdec.privacy import PrivacyConfigError

    measured: dict[str, dict] = {}
    started = time.perf_counter()
    for name in args.model_list:
        try:
            parts: dict[str, float] = {}
            plain, private = step_time_ratio(zoo[name], args.ratio_steps or 20, time.process_time, parts)
        except PrivacyConfigError as refused:  # a model the library refuses (Lightning's LSTM demo) has no ratio
            measured[name] = {"refused": _first_sentence(refused)[:192]}
            print(f"{name}: refused", flush=True)
            continue
        measured[name] = {"plain_ms": plain, "private_ms": private, "ratio": private / plain,
                          "clipping_ms": parts["clipping"], "noise_ms": parts["noise"]}
        print(f"{name}: {private / plain:.2f}x ({private:.1f} / {plain:.1f} ms; clipping {parts['clipping']:.1f} ms, "
              f"noise {parts['noise']:.1f} ms = {parts['noise'] / plain:.2f}x the non-private step)", flush=True)
    if args.json is not None:  # --merge takes it as a run without cells
        args.json.write_text(json.dumps({"library": str(Path(lightning_privdec.__file__).parent),
                                         "ratios": measured, "cells": {}, "seconds": time.perf_counter() - started,
                                         "image_size": args.image_size,
                                         "command": "python benchmarks/compatibility.py " + " ".join(sys.argv[1:]),
                                         "machine": [machine_line(), software_line(opacus=True)]}, indent=1))


def run_interleaved_ratios(args: argparse.Namespace) -> None:
    """``--ratios-only --before TREE``: :func:`run_ratios` in alternating processes, TREE's library then this
    checkout's, ``--rounds`` times (a shared machine's load moves each process's figures; alternating lets both trees
    see the same load on average); prints each model's median over the rounds of the private and non-private
    milliseconds and of the ratio (taken within each process), and every round's ratio."""
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for side in ("before", "after"):
                out = Path(tmp) / f"{side}_{round_}.json"
                command = [sys.executable, os.path.abspath(__file__), "--ratios-only",
                           "--models", ",".join(args.model_list), "--ratio-steps", str(args.ratio_steps or 20),
                           "--image-size", str(args.image_size),
                           "--json", str(out)] + (["--published"] if args.published else [])
                if side == "before":
                    command += ["--library", str(args.before.resolve())]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                runs[side].append(json.loads(out.read_text()))
                print(f"round {round_ + 1} {side}: {runs[side][-1]['library']}", flush=True)
    table: dict[str, dict] = {}
    print("| model | before: private / non-private ms | before | after: private / non-private ms | after | "
          "after / before (private ms) | ratios per round (before; after) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.model_list:
        row: dict[str, Any] = {}
        for side, measured in runs.items():
            rounds = [run["ratios"][name] for run in measured if "ratio" in run["ratios"].get(name, {})]
            if not rounds:
                row[side] = {"refused": measured[0]["ratios"].get(name, {}).get("refused", "no figure")}
                continue
            row[side] = {key: statistics.median(r[key] for r in rounds) for key in ("private_ms", "plain_ms", "ratio")}
            row[side]["rounds"] = [r["ratio"] for r in rounds]
        table[name] = row
        before, after = row["before"], row["after"]
        if "ratio" not in before or "ratio" not in after:
            print(f"| {name} | {before.get('refused', '')} | | {after.get('refused', '')} | | | |")
            continue
        print(f"| {name} | {before['private_ms']:.1f} / {before['plain_ms']:.1f} | {before['ratio']:.2f}x | "
              f"{after['private_ms']:.1f} / {after['plain_ms']:.1f} | **{after['ratio']:.2f}x** | "
              f"{after['private_ms'] / before['private_ms']:.2f} | "
              f"{' '.join(f'{r:.2f}' for r in before['rounds'])}; {' '.join(f'{r:.2f}' for r in after['rounds'])} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"before": str(args.before), "rounds": args.rounds, "models": table,
                                         "machine": [machine_line(), software_line(opacus=True)]}, indent=1))


def record(results: dict[str, dict[str, str]], ratios: dict[str, str], total: float, commands: list[str],
           args: argparse.Namespace, machine: list[str] | None = None) -> None:
    """Print the matrix and (unless ``--no-record``) write it to ``args.doc`` with the commands that measured it and
    ``machine`` (the lines describing where they ran; default: this machine)."""
    table, footnotes = format_table(results, ratios, args)
    print("\n".join(table + [""] + footnotes))
    cells = [c for row in results.values() for c in row.values()]
    print(f"{sum(c == 'trains' for c in cells)} of {len(cells)} cells train, "
          f"{sum(c.startswith('refused') for c in cells)} refused, {sum(c.startswith('fails') for c in cells)} fail; "
          f"{total:.0f} s")
    if args.no_record:
        return
    machine = machine or [machine_line(), software_line(opacus=True)]
    modes = " ".join(args.mode_list)
    doc = [
        "# Models: what trains with which private strategy",
        "",
        f"Each strategy's cell holds one symbol per per-sample mode, in the order **{modes}**: "
        f"**{TRAINS}** trains (finite loss and parameters, epsilon spent), **R*n*** the library refuses the "
        "combination before training (reason *n* below), **F*n*** anything else goes wrong (reason *n*), "
        f"**{NOT_RUN}** not run. The second column is one private step (book-keeping clipping + noise) against one "
        "non-private step (forward + backward), one process and thread, CPU time, batch 16, the two "
        "alternating; in brackets the two steps' milliseconds and, where measured, the noise alone against the "
        "non-private step (one draw per parameter whatever the batch: the ratio is at least 1 plus it).",
        "",
        *table,
        "",
        "Reasons (each the first sentence of the library's message):",
        "",
        *footnotes,
        "",
        "Notes:",
        "",
        *(f"- {name}: {text}" for name, text in NOTES.items()),
        "",
        f"Generated on {datetime.date.today().isoformat()} ({total:.0f} s of runs in all) by "
        + "; ".join(f"`{c}`" for c in commands)
        + f"; {args.steps} steps per cell on {args.devices} CPU processes (gloo), synthetic data, tiny configs.",
        "",
        *(f"- {line}" for line in machine),
        "",
    ]
    args.doc.write_text("\n".join(doc))
    print(f"written to {args.doc}")


if __name__ == "__main__":
    main(sys.argv[1:] if len(sys.argv) > 1 else None)
