"""Fingerprints of the compiled training step, to show that a refactor changed nothing.

For 21 configurations (every stage; buckets, quantized gathers and reduce-scatters, hpZ,
prefetch; bf16 and fp16; the streamed, chunked and host optimizer step; parameter
offload) on two test models, with and without gradient accumulation, it records on 8 CPU
devices the compiled step's collectives (opcode and result shape, sorted), a sha256 of
the parameters after two steps (bitwise) and the last loss. Run it in two checkouts with
the same environment and compare:

    python scripts/step_fingerprints.py before.json       # in the old checkout
    python scripts/step_fingerprints.py after.json        # in the new one
    python scripts/step_fingerprints.py --compare before.json after.json

It uses only the keyword API every version since 0.1.0 takes (``ZeroOptimizer(tx, mesh,
stage=..., comm=..., precision=..., offload=...)``, ``train_step(loss, grad_accum=...)``)
and the test models of ``tests/_models.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLLECTIVE = re.compile(
    r"= ([^ ]+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)


def configurations(jzero, jnp) -> dict[str, dict]:
    C, Off = jzero.Communication, jzero.Offload
    return {
        **{f"s{stage}": {"stage": stage} for stage in range(4)},
        "s3_bucket": {"stage": 3, "comm": C(bucket=True)},
        "s3_int8": {"stage": 3, "comm": C(gather_quant="int8")},
        "s3_fp8_bucket": {"stage": 3, "comm": C(gather_quant="fp8", bucket=True)},
        "s2_grad_int8": {"stage": 2, "comm": C(grad_quant="int8")},
        "s3_grad_int4_bucket": {"stage": 3, "comm": C(grad_quant="int4", bucket=True)},
        "s1_grad_int8": {"stage": 1, "comm": C(grad_quant="int8")},
        "s3_hpz": {"stage": 3, "comm": C(hpz=2)},
        "s3_hpz_bucket_int8": {"stage": 3, "comm": C(hpz=4, bucket=True, gather_quant="int8")},
        "s3_prefetch": {"stage": 3, "comm": C(prefetch=True)},
        "s3_prefetch_bucket_int8": {
            "stage": 3,
            "comm": C(prefetch=True, bucket=True, gather_quant="int8", grad_quant="int8"),
        },
        "s3_bf16": {"stage": 3, "precision": jzero.Precision(param_dtype=jnp.bfloat16)},
        "s2_fp16": {"stage": 2, "precision": jzero.Precision(param_dtype=jnp.float16)},
        "s2_stream": {"stage": 2, "offload": Off(optimizer="stream")},
        "s3_stream_chunk": {"stage": 3, "offload": Off(optimizer="stream", chunk=1024)},
        "s3_host": {"stage": 3, "offload": Off(optimizer="host")},
        "s3_params": {"stage": 3, "offload": Off(params=True)},
        "s3_params_host": {"stage": 3, "offload": Off(optimizer="host", params=True)},
    }


def fingerprints() -> dict[str, object]:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import numpy as np
    import optax

    sys.path.insert(0, str(REPO / "tests"))
    import _models

    import jzero

    models = {
        "stacked": (_models.stacked_params(), _models.stacked_loss, _models.stacked_batch()),
        "awkward": (
            _models.awkward_params(),
            _models.awkward_loss,
            _models.awkward_batches(1)[0],
        ),
    }
    out: dict[str, object] = {}
    for name, options in configurations(jzero, jnp).items():
        for model, (params, loss, batch) in models.items():
            for step_options in ({}, {"grad_accum": 2}) if model == "stacked" else ({},):
                opt = jzero.ZeroOptimizer(optax.adamw(1e-2), jzero.data_mesh(), **options)
                state, step = opt.init(params), opt.train_step(loss, **step_options)
                hlo = step.lower(state, batch).compile().as_text()
                found = sorted(f"{m[1]} {m[2]}" for m in COLLECTIVE.finditer(hlo))
                for _ in range(2):
                    state, metrics = step(state, batch)
                leaves = jax.tree.leaves(opt.full_params(state))
                digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves))
                out[f"{name}/{model}/{step_options}"] = {
                    "collectives": found,
                    "params_sha256": digest.hexdigest()[:16],
                    "loss": float(metrics["loss"]),
                }
    return out


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    count = sum(len(v["collectives"]) for v in a.values())
    print(f"{len(a)} steps, {count} collectives: {len(differ)} differ")
    for key in differ:
        print(f"  {key}: {a.get(key)} -> {b.get(key)}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="write the fingerprints here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give OUT.json, or --compare BEFORE AFTER")
    args.out.write_text(json.dumps(fingerprints(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
