"""``isthmus checkpoint inspect|export`` and ``isthmus data prepare``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parsers"]


def _cmd_inspect(args: argparse.Namespace) -> int:
    from isthmus.checkpoint import CheckpointCorrupt, NoCheckpoint, StorageError, inspect

    try:
        info = inspect(args.dir, revision=args.revision, verify=not args.no_verify)
    except (NoCheckpoint, StorageError, CheckpointCorrupt, ValueError) as e:
        print(f"isthmus checkpoint inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    m = info["manifest"]
    print(f"checkpoint {info['url']}: revision {info['revision']} of run {m['run_id']}")
    print(f"  complete: {info['checkpoints']}  incomplete: {info['incomplete'] or '-'}")
    print(
        f"  strategy {m['strategy']} {m['strategy_config']}  written by isthmus {m['isthmus_version']}"
    )
    print(
        f"  {info['tensors']} shared tensors, {info['state_bytes']:,} bytes; parts by writer: {m['writers']}"
    )
    print(f"  local state of: {', '.join(m['local']) or '-'}")
    for name, size in sorted(info["sizes"].items()):
        print(f"    {name}: {size:,} bytes")
    verified = info.get("verified")
    if verified is not None:
        print(
            "  hashes: " + ("every tensor verified" if verified is True else f"FAILED: {verified}")
        )
    return 0 if verified in (True, None) else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from isthmus.checkpoint import CheckpointCorrupt, NoCheckpoint, StorageError, export

    try:
        out = export(args.dir, args.out, revision=args.revision)
    except (NoCheckpoint, StorageError, CheckpointCorrupt, ValueError, OSError) as e:
        print(f"isthmus checkpoint export: {e}", file=sys.stderr)
        return 2
    keys = "the model's state_dict keys" if out["model_keys"] else "the shared state's names"
    print(f"wrote {out['tensors']} tensors of revision {out['revision']} to {out['path']} ({keys})")
    return 0


def add_parsers(sub: Any) -> None:
    ck = sub.add_parser("checkpoint", help="look into a checkpoint, or take the model out of it")
    csub = ck.add_subparsers(dest="checkpoint_command", required=True)
    i = csub.add_parser("inspect", help="the manifest, the parts' sizes and a hash check")
    i.add_argument("dir", help="checkpoint directory or fsspec URL (--checkpoint-dir of the run)")
    i.add_argument("--revision", type=int, default=None, help="default: the latest complete one")
    i.add_argument("--no-verify", action="store_true", help="skip reading every tensor")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_cmd_inspect)
    e = csub.add_parser("export", help="the model's state dict as one safetensors file")
    e.add_argument("dir", help="checkpoint directory or fsspec URL")
    e.add_argument("--out", required=True, help="the .safetensors file to write")
    e.add_argument("--revision", type=int, default=None, help="default: the latest complete one")
    e.set_defaults(func=_cmd_export)

    from isthmus.data.prepare import add_prepare_arguments, run_prepare

    data = sub.add_parser("data", help="prepare token files for isthmus.data.TokenDataset")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="tokenize text files into token shards")
    add_prepare_arguments(p)
    p.set_defaults(func=run_prepare)
