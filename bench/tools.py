"""A 5-turn tool-calling chat through `dflash-native serve`: speculative against AR on the same
server (the `speculative` request extension), tokens/s and acceptance per mode.

    python bench/tools.py [--target T --drafter D] [--trained] [--max-tokens 64]
                          [--jsonl bench/results/tools.jsonl]

The chat is tests/fixtures/tool_model.py's (get_weather and add; calls, two calls at once, text
after the results), sent with its tools. Each turn's history is the fixture's, so both modes see
the same prompts whatever the model answers. A target whose chat template renders no tools (the
embedded pair's plain ChatML) is served from a copy carrying Qwen3's template
(tests/fixtures/templates), made with gguf-py's gguf_new_metadata. --trained serves the tiny
target the tool tests train on that chat (it answers with the calls; built once into the bench
cache). The table reports whether every turn's answer was the same in both modes (it must be).
Figures from a shared machine are smoke.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, git_rev, machine, resolve_pair, write_jsonl  # noqa: E402
from serve import start_server  # noqa: E402

from fixtures import tool_model as TM  # noqa: E402  (tests/ is on sys.path through _common)

TEMPLATE = TM.TEMPLATES / "Qwen-Qwen3-0.6B.jinja"


def served_target(target: Path) -> Path:
    """`target`, or a copy of it with Qwen3's chat template when its own renders no tools."""
    from dflash_native._tokenizer import Tokenizer
    from dflash_native.tools import parser_for

    if parser_for(Tokenizer(target).chat_template) is not None:
        return target
    out = CACHE / f"{target.stem}-qwen3-tools.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(target), str(out),
                            "--chat-template-file", str(TEMPLATE), "--force"], capture_output=True, text=True)
        if r.returncode != 0:
            out.unlink(missing_ok=True)
            raise SystemExit(f"gguf_new_metadata failed: {r.stderr[-2000:]}")
    return out


def trained_pair() -> tuple[Path, Path]:
    from dflash_native._tokenizer import render_chat_template

    d = CACHE / "tool-model"
    if not (d / "drafter.gguf").is_file():
        tpl = TEMPLATE.read_text(encoding="utf-8")
        TM.build_tool_pair(d, lambda msgs, tools: render_chat_template(tpl, msgs, tools=tools))
    return d / "target.gguf", d / "drafter.gguf"


def run_chat(client, speculative: bool, max_tokens: int) -> list[dict]:
    out = []
    for turn, (history, _) in enumerate(TM.turns()):
        r = client.chat.completions.create(model="bench", messages=[TM.openai_message(m) for m in history],
                                           tools=TM.TOOLS, max_tokens=max_tokens,
                                           extra_body={"speculative": speculative})
        ch, ext = r.choices[0], r.model_extra["dflash"]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        out.append(dict(turn=turn + 1, prompt_tokens=r.usage.prompt_tokens, tokens=r.usage.completion_tokens,
                        decode_s=ext["decode_s"], rounds=ext["rounds"],
                        acceptance_histogram=ext["acceptance_histogram"], finish=ch.finish_reason,
                        answer=[ch.message.content, calls]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--trained", action="store_true", help="serve the tiny target trained on the chat")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--jsonl", type=Path, default=None)
    a = ap.parse_args()
    import openai

    target, drafter = trained_pair() if a.trained else resolve_pair(a.target, a.drafter)
    served = served_target(Path(target))
    mach, rev = machine(), git_rev()
    print(f"machine: {mach}\nrev: {rev}\ntarget: {served.name}, drafter: {Path(drafter).name}")
    proc, base = start_server(served, drafter, 1, a.n_ctx, a.threads)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        run_chat(client, True, 8)  # warm-up
        runs = {spec: run_chat(client, spec, a.max_tokens) for spec in (True, False)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    same = all(x["answer"] == y["answer"] for x, y in zip(runs[True], runs[False]))
    rows = []
    print("\n| mode | turns | tokens | decode tok/s | mean acceptance | calls | finish | same as AR |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for spec, turns in runs.items():
        toks = sum(t["tokens"] for t in turns)
        dec = sum(t["decode_s"] for t in turns)
        hist = [sum(h) for h in zip(*[t["acceptance_histogram"] for t in turns if t["acceptance_histogram"]])]
        acc = sum(k * n for k, n in enumerate(hist)) / sum(hist) if hist and sum(hist) else 0.0
        n_calls = sum(len(t["answer"][1]) for t in turns)
        tok_s = toks / dec if dec > 0 else 0.0
        print(f"| {'DFlash' if spec else 'AR'} | {len(turns)} | {toks} | {tok_s:.1f} | "
              f"{acc:.2f} | {n_calls} | {','.join(t['finish'] for t in turns)} | {same} |")
        rows.append(dict(bench="tools", speculative=spec, turns=len(turns), tokens=toks, decode_tok_s=tok_s,
                         mean_acceptance=acc, tool_calls=n_calls, same_as_ar=same, per_turn=turns, machine=mach,
                         rev=rev, target=served.name, drafter=Path(drafter).name, max_tokens=a.max_tokens,
                         note="smoke, shared machine" if os.environ.get("DFLASH_SMOKE") else ""))
    write_jsonl(a.jsonl, rows)
    if not same:
        raise SystemExit("speculative and AR answers differ")


if __name__ == "__main__":
    main()
