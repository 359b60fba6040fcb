"""Secrets stay with their node: Decor's pairwise secrets, its private keys and every node's noise and sampling keys
never reach a checkpoint, a log file, the console, the strategy's repr or an error message.

The multi-process test runs a real 3-node Decor fit (ring, key agreement over gloo), reads the secret material from the
live objects of every node during the run, and searches every file the run wrote for it in the encodings it could
take (raw bytes, hex, base64, decimal, tensor storage, the 8-byte words of a generator state). The search itself is
checked on planted copies. Run as ``python -m tests.test_security --out DIR`` it is that fit (one process per node,
started by Lightning's subprocess launcher).
"""

from __future__ import annotations

import base64
import copy
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
NODES = 3  # a ring of 3 (the triangle): two neighbours per node, 2-connected
STEPS = 4


# ---- what a leak looks like -----------------------------------------------------------------------------------------
def byte_string_forms(secret: bytes) -> list[bytes]:
    """The encodings a byte string takes when stored or printed: raw (also a uint8 tensor's storage), reversed (a
    pickled integer is little-endian), int64 tensor storage, hex, base64, Python's repr, a list of ints, and the
    decimal integer (either byte order)."""
    texts = [
        secret.hex(),
        secret.hex().upper(),
        base64.b64encode(secret).decode(),
        base64.urlsafe_b64encode(secret).decode(),
        repr(secret),
        str(list(secret)),
        str(int.from_bytes(secret, "big")),
        str(int.from_bytes(secret, "little")),
    ]
    return [secret, secret[::-1], b"".join(b.to_bytes(8, "little") for b in secret), *(t.encode() for t in texts)]


def integer_forms(value: int) -> list[bytes]:
    """A 64-bit seed as decimal and hex text and as an 8-byte word (a torch generator state starts with its seed)."""
    return [str(value).encode(), f"{value:x}".encode(), value.to_bytes(8, "little"), value.to_bytes(8, "big")]


def leaks(haystack: bytes, needles: dict[str, list[bytes]]) -> list[str]:
    """The names of the secrets any of whose forms occurs in ``haystack``."""
    return [name for name, forms in needles.items() if any(form in haystack for form in forms)]


def test_the_search_finds_secret_material_in_every_form_it_could_be_stored_in():
    secret, seed = bytes(range(7, 39)), 0x1234_5678_9ABC_DEF0
    needles = {"secret": byte_string_forms(secret), "seed": integer_forms(seed)}
    generator = torch.Generator().manual_seed(seed)
    planted = {
        "bytes": {"s": secret},
        "uint8 tensor": {"s": torch.tensor(list(secret), dtype=torch.uint8)},
        "int64 tensor": {"s": torch.tensor(list(secret), dtype=torch.int64)},
        "hex string": {"s": secret.hex()},
        "integer": {"s": int.from_bytes(secret, "big")},
        "generator state": {"g": generator.get_state()},
    }
    for how, obj in planted.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        assert leaks(buffer.getvalue(), needles), how
    for text in (f"secret={secret!r}", f"key {secret.hex().upper()}", f"seed: {seed}", str(list(secret))):
        assert leaks(text.encode(), needles), text
    assert leaks(b"nothing to see here " + bytes(range(40, 80)), needles) == []


# ---- a real Decor fit -----------------------------------------------------------------------------------------------
def secret_material(dumps: list[dict], run: str) -> dict[str, list[bytes]]:
    needles: dict[str, list[bytes]] = {}
    for d in dumps:
        r = d["rank"]
        for j, secret in d["pairwise"].items():
            needles[f"{run}: s_{r}{j}"] = byte_string_forms(secret)
        for (j, t), key in d["stream_keys"].items():
            needles[f"{run}: stream key of edge ({r}, {j}), round {t}"] = byte_string_forms(key)
        if d["private_key"] is not None:
            needles[f"{run}: private key of node {r}"] = byte_string_forms(d["private_key"])
        needles[f"{run}: noise key of node {r}"] = byte_string_forms(d["noise_key"])
        needles[f"{run}: sampling key of node {r}"] = byte_string_forms(d["sampling_key"])
    return needles


def written_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.multiprocess
def test_decor_secrets_reach_no_checkpoint_log_console_repr_or_error_and_a_resume_agrees_anew(tmp_path):
    from tests.multiprocess import run_group

    command = [sys.executable, "-m", "tests.test_security", "--out", str(tmp_path), "--key-dir", str(tmp_path / "keys")]
    result = run_group(command, 300, cwd=REPO)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    first, resumed = ([torch.load(tmp_path / "dump" / f"{run}_rank{r}.pt") for r in range(NODES)]
                      for run in ("first", "resumed"))
    needles = {**secret_material(first, "first"), **secret_material(resumed, "resumed")}
    # 2 edges per node, stream keys of STEPS + 1 rounds each, a private key (first run only) and 2 generator keys
    assert len(needles) == NODES * (2 * (2 + 2 * (STEPS + 1) + 2) + 1)
    # the two ends of an edge hold the same secret (so it is s_ij), the three edges' secrets differ, and the resumed
    # run, without key files, agreed on new ones
    pairwise = [{s for d in run for s in d["pairwise"].values()} for run in (first, resumed)]
    assert all(d["pairwise"][j] == first[j]["pairwise"][d["rank"]] for d in first for j in d["pairwise"])
    assert len(pairwise[0]) == len(pairwise[1]) == NODES and pairwise[0].isdisjoint(pairwise[1])
    # 2 restored from the step-2 checkpoint and 2 from the write-ahead ledger: the first run released steps 3-4, and
    # a resume without key files would send them again under new noise, so the budget (planned for 4) is spent and
    # the resumed run takes no step
    assert [d["steps"] for d in resumed] == [STEPS] * NODES

    files = {f"{run}/{name}": content for run in ("first", "resumed")
             for name, content in written_files(tmp_path / run).items()}
    assert sorted(name for name in files if name.endswith(".ckpt")) == [
        "first/ckpt/epoch=0-step=2.ckpt", "first/ckpt/epoch=0-step=4.ckpt"]
    assert sum(name.startswith("first/ckpt/privacy_ledger/") for name in files) == NODES  # scanned for leaks too
    assert {"first/logs/version_0/metrics.csv", "first/logs/version_0/hparams.yaml"} <= set(files)
    saved = torch.load(tmp_path / "first/ckpt/epoch=0-step=4.ckpt", weights_only=False)["lightning_privdec"]["nodes"]
    assert [n["privacy"]["steps"] for n in saved] == [STEPS] * NODES  # every node's own state is in the file
    for name, content in {**files, "console": (result.stdout + result.stderr).encode()}.items():
        assert leaks(content, needles) == [], name
    for d in first + resumed:
        for what, text in (*d["reprs"].items(), *d["errors"].items()):
            assert leaks(text.encode(), needles) == [], what
        assert "cannot be pickled" in d["errors"]["pickle the node privacy"]
        assert "cannot be pickled" in d["errors"]["deepcopy the node privacy"]


# ---- the child: one node of both fits --------------------------------------------------------------------------------
def _fit(argv: list[str]) -> None:
    """A 4-step Decor fit on 3 nodes with key files, checkpoints and a CSV log, then a resume of its step-2 checkpoint
    in a new Trainer without key files (one launch; each fit forks its ranks from this process, which has imported
    Lightning once)."""
    import argparse

    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_privdec import CorrelatedNoiseStrategy, PrivacyBudgetCallback
    from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--key-dir", default=None)
    args = parser.parse_args(argv)

    class DumpLiveSecrets(Callback):
        """Reads the secret material from this node's live objects and writes it OUTSIDE the run's directory."""

        def __init__(self, run: str, key_dir: str | None) -> None:
            self.run, self.key_dir = run, key_dir

        def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # also after no step
            strategy = trainer.strategy
            dp = strategy.privacy
            secrets, correlated = dp.secrets, dp.correlated
            assert correlated is not None, "the correlated noise must be on for this test"
            errors = {}
            for what, action in (
                ("pickle the node privacy", lambda: pickle.dumps(dp)),
                ("deepcopy the node privacy", lambda: copy.deepcopy(dp)),
                ("secret of a non-neighbour", lambda: secrets.secret(NODES + 5)),
            ):
                try:
                    action()
                    errors[what] = "no error"
                except Exception as err:  # noqa: BLE001 - the message is what is checked
                    errors[what] = f"{type(err).__name__}: {err}"
            rank = trainer.global_rank
            key_file = None if self.key_dir is None else Path(self.key_dir) / f"node_{rank}.key"
            dump = {
                "rank": rank,
                "steps": dp.steps,
                "pairwise": {j: secrets.secret(j) for j in secrets.neighbours},
                "stream_keys": {(j, t): correlated._stream_key(j, t)
                                for j in secrets.neighbours for t in range(STEPS + 1)},
                "private_key": None if key_file is None else key_file.read_bytes()[-32:],
                "noise_key": dp.gaussian.generator._key,
                "sampling_key": dp.sampler.generator._key,
                "reprs": {
                    "strategy": repr(strategy), "str(strategy)": str(strategy), "dp": repr(dp),
                    "vars(strategy)": repr(vars(strategy)), "vars(dp)": repr(vars(dp)),
                    "secrets": repr(secrets), "state_dict(secrets)": repr(secrets.state_dict()),
                    "correlated": repr(correlated), "state_dict(dp)": repr(dp.state_dict()),
                },
                "errors": errors,
            }
            (args.out / "dump").mkdir(parents=True, exist_ok=True)
            torch.save(dump, args.out / "dump" / f"{self.run}_rank{rank}.pt")

    def fit(run: str, key_dir: str | None, resume: Path | None) -> None:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=NODES,
            strategy=CorrelatedNoiseStrategy(topology="ring", max_grad_norm=1.0, target_epsilon=3.0,
                                             target_delta=1e-5, key_file_dir=key_dir, start_method="fork"),
            max_steps=STEPS,  # the resumed run keeps the plan, and so the calibrated noise, of the first
            callbacks=[
                ModelCheckpoint(dirpath=args.out / run / "ckpt", every_n_train_steps=2, save_top_k=-1),
                PrivacyBudgetCallback(log_every_n_steps=1),
                DumpLiveSecrets(run, key_dir),
            ],
            logger=CSVLogger(args.out / run, name="logs", version=0),
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule(batch_size=32), ckpt_path=resume)

    torch.set_num_threads(1)
    fit("first", args.key_dir, None)
    fit("resumed", None, args.out / "first" / "ckpt" / "epoch=0-step=2.ckpt")


if __name__ == "__main__":
    _fit(sys.argv[1:])
