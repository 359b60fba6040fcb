"""``privdec-keygen``: a node's Ed25519 identity key and its roster line.

    privdec-keygen keys/hospital-a.key --name hospital-a   # new key file (mode 0600); prints "hospital-a <public key>"
    privdec-keygen --public keys/hospital-a.key --name 0   # the roster line of an existing key (here pinned to rank 0)

Each site runs it once on its own machine and sends only the printed line to the others; the roster file is those
lines, the same on every node (see the README, "Training across sites").
"""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_privdec.comm.identity import MEMBER_NAME, Identity, MembershipError, write_identity_key

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="privdec-keygen", description=__doc__.split("\n\n")[0])
    parser.add_argument("key_file", type=Path, help="where to write the private key (never overwritten)")
    parser.add_argument("--name", default=None, help="the member's roster name, or a rank to pin it to (default: "
                        "the key file's name without its suffix)")
    parser.add_argument("--public", action="store_true", help="print the roster line of an existing key file")
    args = parser.parse_args(argv)
    name = args.name if args.name is not None else args.key_file.stem
    if not MEMBER_NAME.match(name):
        parser.error(f"--name {name!r}: use letters, digits and _.@:- only (at most 128 characters)")
    try:
        public = Identity(args.key_file).public_key if args.public else write_identity_key(args.key_file)
    except FileExistsError:
        print(f"privdec-keygen: {args.key_file} exists; it is never overwritten (use --public to print its roster "
              "line)", file=sys.stderr)
        return 2
    except MembershipError as error:
        print(f"privdec-keygen: {error}", file=sys.stderr)
        return 2
    print(f"{name} {base64.b64encode(public).decode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
