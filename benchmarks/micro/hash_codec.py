"""Hash and codec micro-benchmark: sha256 vs blake3, zstd levels 1 and 3.

Run from the repository root::

    python -m benchmarks.micro.hash_codec [--hash-mib 256] [--codec-mib 64] [--json OUT.json]

* Hashes: single-threaded throughput over ``--hash-mib`` MiB of random bytes,
  best of 3 (``hashlib.sha256``, ``blake3`` with ``max_threads=1``, which is
  what ckptstore calls; one multi-threaded blake3 row for reference).
* zstd (python-zstandard, one thread, content size written, as
  ``ckptstore.format.codec`` does): compress and decompress speed and ratio, level 1
  (ckptstore's default) and 3, over ``--codec-mib`` MiB of ``torch.randn``
  fp32 and bf16 data cut into 4 MiB chunks (ckptstore's default chunk size),
  best of 3. Rows marked ``bytegroup`` first transpose the bytes of each
  element into planes (all first bytes, then all second bytes...), a
  transform ckptstore does not implement today; they show what it would buy.

Speeds are in GB/s (1e9 bytes) of raw (uncompressed) data, plus GiB/s for
the hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys

import blake3
import numpy as np
import torch
import zstandard

from ..common.measure import GiB, MiB, best_of, loadavg
from ..common.report import command_line, format_table, write_results

CHUNK = 4 * MiB


def bench_hashes(nbytes: int) -> list[dict]:
    data = np.random.default_rng(0).bytes(nbytes)
    rows = []
    cases = [
        ("sha256 (hashlib)", lambda: hashlib.sha256(data).digest()),
        ("blake3 max_threads=1", lambda: blake3.blake3(data, max_threads=1).digest()),
        ("blake3 max_threads=1, 4 MiB chunks",
         lambda: [blake3.blake3(memoryview(data)[o:o + CHUNK], max_threads=1).digest()
                  for o in range(0, nbytes, CHUNK)]),
        ("blake3 max_threads=AUTO", lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()),
    ]
    for name, fn in cases:
        fn()  # warm up (page in, load code)
        s = best_of(fn)
        rows.append({"hash": name, "bytes": nbytes, "seconds": s, "gb_per_s": nbytes / s / 1e9,
                     "gib_per_s": nbytes / s / GiB})
    return rows


def _group(b: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(-1, itemsize).T).reshape(-1)


def _ungroup(b: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(itemsize, -1).T).reshape(-1)


def bench_zstd(label: str, t: torch.Tensor, level: int, group: bool) -> dict:
    raw = t.reshape(-1).view(torch.uint8).numpy()
    isz = t.element_size()
    chunks = [raw[o:o + CHUNK] for o in range(0, len(raw), CHUNK)]
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    dctx = zstandard.ZstdDecompressor()

    def compress():
        return [cctx.compress(_group(c, isz) if group else c) for c in chunks]

    frames = compress()
    stored = sum(len(f) for f in frames)

    def decompress():
        out = []
        for f, c in zip(frames, chunks):
            d = dctx.decompress(f, max_output_size=len(c))
            out.append(_ungroup(np.frombuffer(d, np.uint8), isz) if group else d)
        return out

    # Round trip must be exact.
    for d, c in zip(decompress(), chunks):
        if bytes(d) != c.tobytes():
            raise AssertionError(f"{label} level {level}: zstd round trip differs")
    cs = best_of(compress)
    ds = best_of(decompress)
    n = len(raw)
    return {
        "data": label,
        "codec": ("bytegroup+" if group else "") + "zstd",
        "level": level,
        "bytes": n,
        "ratio": n / stored,
        "compress_gb_per_s": n / cs / 1e9,
        "decompress_gb_per_s": n / ds / 1e9,
    }


def table(head, rows) -> str:
    return format_table(head, rows, left=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.micro.hash_codec", description=__doc__.split("\n")[0])
    ap.add_argument("--hash-mib", type=int, default=256, help="random bytes hashed (default 256 MiB)")
    ap.add_argument("--codec-mib", type=int, default=64, help="tensor bytes compressed per dtype (default 64 MiB)")
    ap.add_argument("--json", metavar="OUT.json")
    args = ap.parse_args(argv)
    command = command_line("benchmarks.micro.hash_codec", argv)
    print(f"command: {command}")
    print(f"python {platform.python_version()}, blake3 {getattr(blake3, '__version__', '?')}, "
          f"zstandard {zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION}), {os.cpu_count()} CPUs, "
          f"load average {loadavg()}", flush=True)

    hashes = bench_hashes(args.hash_mib * MiB)
    print(f"\nHashes, {args.hash_mib} MiB of random bytes, best of 3:")
    print(table(["hash", "seconds", "GB/s", "GiB/s"],
                [[r["hash"], f"{r['seconds']:.3f}", f"{r['gb_per_s']:.2f}", f"{r['gib_per_s']:.2f}"] for r in hashes]))

    g = torch.Generator().manual_seed(0)
    n32 = args.codec_mib * MiB // 4
    fp32 = torch.randn(n32, generator=g)
    bf16 = torch.randn(args.codec_mib * MiB // 2, generator=g).to(torch.bfloat16)
    codecs = []
    for label, t in (("randn fp32", fp32), ("randn bf16", bf16)):
        for group in (False, True):
            for level in (1, 3):
                codecs.append(bench_zstd(label, t, level, group))
    print(f"\nzstd, {args.codec_mib} MiB per dtype in 4 MiB chunks, one thread, best of 3 "
          "(GB/s of raw data; bytegroup = not in ckptstore today):")
    print(table(["data", "codec", "level", "ratio", "compress GB/s", "decompress GB/s"],
                [[r["data"], r["codec"], str(r["level"]), f"{r['ratio']:.3f}", f"{r['compress_gb_per_s']:.2f}",
                  f"{r['decompress_gb_per_s']:.2f}"] for r in codecs]))
    if args.json:
        write_results(args.json, command, {"hashes": hashes, "zstd": codecs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
