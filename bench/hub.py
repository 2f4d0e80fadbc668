"""Models by name: the first and the second run of `dflash-native generate --target hf://... --drafter
hf://...` against a Hub served from local directories on loopback (tests/fixtures/hub_server.py).

    python bench/hub.py [--tiny] [--type q4_k_m] [--max-tokens 32] [--threads N]
                        [--jsonl bench/results/hub.jsonl]

The target is a random checkpoint of the 0.65B-shaped Qwen3.5 hybrid (_common.QWEN35_05B: hidden
1024, 24 layers, 3 GDN : 1 attention, vocabulary 151936; bf16 safetensors, as Qwen publishes),
the drafter a random 1-layer DFlash checkpoint for it (block 16); --tiny: the benches' smoke shape.
Both are built once into the bench cache. Each run starts with empty caches (ours and
huggingface_hub's) for the first run; the second run reuses them. The phases come from the
timestamps of the status lines `generate` prints on stderr ("fetching", "converting",
"quantizing", "wrote", "converted before") and of the first byte of generated text on stdout:
download (here a loopback copy, not a network), conversion, quantization, the drafter's download
and conversion, load + prefill to the first token, and the whole command. Random weights: the
text is gibberish; only the times matter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, QWEN35_05B, git_rev, machine, write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def parse_args(argv):\n    "


def build_repos(tiny: bool) -> tuple[str, Path, Path]:
    """(shape name, target checkpoint, drafter checkpoint), built once into the bench cache."""
    from fixtures import drafter_overrides_for_target, make_random_checkpoint, make_random_drafter_checkpoint

    name = "qwen35-tiny" if tiny else "qwen35-0.65b"
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4) if tiny \
        else dict(QWEN35_05B)
    root = CACHE / "hub-repos" / name
    target, drafter = root / name, root / f"{name}-DFlash"
    if not (target / "config.json").is_file():
        make_random_checkpoint(target, "qwen3_5", seed=0, dtype="bfloat16", **shape)
    if not (drafter / "config.json").is_file():
        n = shape["num_hidden_layers"]
        overrides = {**drafter_overrides_for_target(target), "target_layer_ids": sorted({1, n // 2, n - 2})}
        make_random_drafter_checkpoint(drafter, seed=1, dtype="bfloat16", block_size=16, num_hidden_layers=1,
                                       **overrides)
    return name, target, drafter


def timed_run(cmd: list[str], env: dict) -> dict:
    """The command's stderr lines with their times, and the time of its first stdout byte (seconds
    from the start)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []
    first_out: list[float] = []
    out = bytearray()

    def read_err():
        for raw in proc.stderr:
            lines.append((time.monotonic() - t0, raw.decode(errors="replace").rstrip()))

    def read_out():
        while True:
            b = proc.stdout.read(1)
            if not b:
                return
            if not first_out:
                first_out.append(time.monotonic() - t0)
            out.extend(b)

    threads = [threading.Thread(target=read_err), threading.Thread(target=read_out)]
    for t in threads:
        t.start()
    rc = proc.wait()
    for t in threads:
        t.join()
    total = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"generate failed ({rc}):\n" + "\n".join(l for _, l in lines))
    result = json.loads(out.decode().strip().splitlines()[-1])
    return dict(lines=lines, first_token_s=first_out[0] if first_out else total, total_s=total, result=result)


def phases(run: dict, target: str, drafter: str) -> dict:
    """Seconds per step, from the status lines' times."""
    def at(name: str, word: str) -> float | None:
        return next((t for t, l in run["lines"] if l.startswith(f"[dflash-native hub] {name}:") and word in l), None)

    def span(a, b):
        return None if a is None or b is None else round(b - a, 3)

    t_fetch, t_conv, t_quant, t_wrote = (at(target, w) for w in ("fetching", "converting", "quantizing", "wrote"))
    d_fetch, d_conv, d_wrote = (at(drafter, w) for w in ("fetching", "converting", "wrote"))
    hub_lines = [t for t, l in run["lines"] if l.startswith("[dflash-native hub]")]
    return {
        "download_s": span(t_fetch, t_conv),
        "convert_s": span(t_conv, t_quant if t_quant is not None else t_wrote),
        "quantize_s": span(t_quant, t_wrote),
        "drafter_download_s": span(d_fetch, d_conv),
        "drafter_convert_s": span(d_conv, d_wrote),
        "names_resolved_s": round(hub_lines[-1], 3) if hub_lines else None,
        "first_token_s": round(run["first_token_s"], 3),
        "total_s": round(run["total_s"], 3),
        "converted_before": sum("(converted before)" in l for _, l in run["lines"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the benches' smoke shape instead of the 0.65B one")
    ap.add_argument("--type", default="q4_k_m", help="the target's :TYPE (default q4_k_m; the drafter stays f16)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--jsonl", type=Path, default=None, help="append the two runs as JSON lines here")
    a = ap.parse_args()

    from fixtures.hub_server import LocalHub

    shape, target_dir, drafter_dir = build_repos(a.tiny)
    target, drafter = f"hf://bench/{shape}:{a.type}", f"hf://bench/{shape}-DFlash"
    rows = []
    with LocalHub() as hub, tempfile.TemporaryDirectory(prefix="dflash-hub-bench-") as tmp:
        hub.add(f"bench/{shape}", target_dir)
        hub.add(f"bench/{shape}-DFlash", drafter_dir)
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, DFLASH_NATIVE_CACHE=str(Path(tmp) / "dflash-native"),
                   HF_HUB_CACHE=str(Path(tmp) / "hf"), PYTHONPATH=os.pathsep.join(
                       [str(Path(__import__("dflash_native").__file__).resolve().parents[1]),
                        os.environ.get("PYTHONPATH", "")]))
        env.pop("HF_HUB_OFFLINE", None)
        cmd = [sys.executable, "-m", "dflash_native", "generate", "--target", target, "--drafter", drafter,
               "--prompt", PROMPT, "--max-tokens", str(a.max_tokens), "--n-ctx", "1024", "--json"]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        size = sum(p.stat().st_size for p in target_dir.glob("*.safetensors"))
        for i in (1, 2):
            r = timed_run(cmd, env)
            row = dict(bench="hub", run=i, shape=shape, type=a.type, checkpoint_mib=round(size / 2**20, 1),
                       max_tokens=a.max_tokens, threads=a.threads, n_generated=r["result"]["stats"]["n_generated"],
                       decode_tok_s=round(r["result"]["stats"]["decode_tok_s"], 2), **phases(r, target, drafter),
                       machine=machine(), git=git_rev(), load_average=round(os.getloadavg()[0], 2))
            rows.append(row)

    print(f"\n# {target} + {drafter}: {rows[0]['checkpoint_mib']} MiB of bf16 safetensors served on loopback; "
          f"{a.max_tokens} tokens; {machine()}; load average {rows[-1]['load_average']}")
    cols = ["run", "download_s", "convert_s", "quantize_s", "drafter_download_s", "drafter_convert_s",
            "names_resolved_s", "first_token_s", "total_s", "converted_before"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    for row in rows:
        print("| " + " | ".join("-" if row[c] is None else str(row[c]) for c in cols) + " |")
    write_jsonl(a.jsonl, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
