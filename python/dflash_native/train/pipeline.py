"""`dflash-native train-drafter`: a DFlash drafter for any supported HF target, from local text.

Prompts are windows of the training split of the text (train/corpus.py: a directory, a file or
the Python standard library by default), tokenized with the target's own tokenizer; the target
continues each greedily and the drafter learns those continuations (train/drafter.py). With the
target's GGUF given, the continuations come from our engine on that file (the target the drafter
will serve, at its own precision, and ~10x faster than PyTorch's token-by-token decode); without
it, from the PyTorch model. A `constrained_share` of the engine continuations is written under a
JSON grammar (`constraint_plan`: any JSON object, random small schemas, or one schema file), so the
drafter also learns the text the target writes for a structured-output request; `constrained_extra`
adds that many constrained continuations of other prompts after the set instead of replacing part
of it (the set and its cached continuations unchanged).
Everything that can be checked is checked before the target is loaded or any text is read.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

from . import corpus


def _target_layers(target_dir: Path) -> int:
    cfg_path = target_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"[train_drafter] '{target_dir}' has no config.json: give a Hugging Face target checkpoint")
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    if "num_hidden_layers" not in text:
        raise ValueError(f"[train_drafter] '{cfg_path}' has no num_hidden_layers")
    return int(text["num_hidden_layers"])


def check_request(target_dir: Path, data: corpus.Root, target_layer_ids: Sequence[int] | None) -> list[tuple[str, Path]]:
    """Fails fast: the target checkpoint, its tokenizer, the tap layers, the text."""
    n_layers = _target_layers(target_dir)
    if not (target_dir / "tokenizer.json").is_file():
        raise ValueError(f"[train_drafter] '{target_dir}' has no tokenizer.json")
    for i in target_layer_ids or ():
        if not 0 <= int(i) < n_layers - 1:
            raise ValueError(f"[train_drafter] target layer {i} is not a tap layer of this {n_layers}-layer target "
                             f"(taps are layer outputs 0 .. {n_layers - 2})")
    files = corpus.split_files(data)["train"]  # raises on a missing or empty corpus
    if not files:
        raise ValueError(f"[train_drafter] no training text in '{data}'")
    return files


def text_prompts(files: Sequence[tuple[str, Path]], tokenizer: Any, n: int, prompt_tokens: int,
                 seed: int = 0, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """`n` prompts of `prompt_tokens` tokens, each from a random line of a random file; with
    `max_prompt_tokens`, of a length drawn uniformly from [prompt_tokens, max_prompt_tokens]
    (continuations then start at contexts spread over that range: long-context training)."""
    longest = max(prompt_tokens, max_prompt_tokens or 0)
    rng = random.Random(seed)
    out: list[list[int]] = []
    texts = [p.read_text(encoding="utf-8", errors="replace") for _, p in files]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("[train_drafter] the training text is empty")
    for _ in range(50 * n):
        if len(out) == n:
            break
        text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        # no draw without a range: the recipe's prompts (and so the shipped pair) stay reproducible
        want = rng.randint(prompt_tokens, longest) if longest > prompt_tokens else prompt_tokens
        ids = tokenizer.encode("".join(lines[start:start + max(200, want)]), add_special_tokens=False).ids
        if len(ids) >= want:
            out.append(list(ids[:want]))
    if len(out) < n:
        raise ValueError(f"[train_drafter] the text yields only {len(out)} prompts of {prompt_tokens}.."
                         f"{longest} tokens")
    return out


def _prompt_mix(files, tok, n_prompts: int, prompt_tokens: int, max_new_tokens: int, context_length: int | None,
                long_share: float | None, seed: int) -> list[list[int]]:
    """Without `context_length`: `n_prompts` prompts of `prompt_tokens`. With N: round(n_prompts *
    long_share) long prompts, of lengths spread over [prompt_tokens, N - max_new_tokens] so that the
    continuations' anchors see contexts up to N (default share 1), then the short rest of
    `prompt_tokens`: the short-context regime keeps its share of the training, and the short
    prompts are the first ones the same seed draws without N."""
    if context_length is None:
        return text_prompts(files, tok, n_prompts, prompt_tokens, seed=seed)
    n_long = round(n_prompts * (1.0 if long_share is None else long_share))
    longest = max(prompt_tokens, context_length - max_new_tokens)
    # an all-long draw keeps the seed it always had; a mix draws its long prompts from the next one
    long_seed = seed if n_long == n_prompts else seed + 1
    long = text_prompts(files, tok, n_long, prompt_tokens, seed=long_seed, max_prompt_tokens=longest) if n_long else []
    short = text_prompts(files, tok, n_prompts - n_long, prompt_tokens, seed=seed) if n_prompts > n_long else []
    return short + long


def _length_summary(lengths: Sequence[int]) -> dict:
    s = sorted(lengths)
    return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "mean": sum(s) / len(s)}


def sampling_plan(n: int, sampled_share: float, temperatures: Sequence[float], top_p: float = 0.95,
                  seed: int = 0) -> list[dict | None]:
    """Per continuation, how the target writes it: None (greedy) or the sampling settings
    {temperature, top_p, seed}. A share `sampled_share` of them sample, spread evenly over the
    list (continuation i samples when floor((i + 1) * share) > floor(i * share), so short and long
    prompts alike), cycling through `temperatures`; continuation i draws with seed
    `seed * 1_000_003 + i` (reproducible, a different noise per prompt)."""
    if not 0.0 <= sampled_share <= 1.0:
        raise ValueError(f"[train_drafter] sampled_share must be in [0, 1], got {sampled_share!r}")
    sampled = [int((i + 1) * sampled_share) > int(i * sampled_share) for i in range(n)]
    n_sampled = sum(sampled)
    temps = [float(t) for t in temperatures]
    if n_sampled and (not temps or any(not t > 0.0 for t in temps)):
        raise ValueError(f"[train_drafter] sample_temperatures must be > 0 (and given when sampled_share > 0), "
                         f"got {list(temperatures)!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"[train_drafter] sample_top_p must be in (0, 1], got {top_p!r}")
    plan: list[dict | None] = []
    for i, s in enumerate(sampled):
        plan.append({"temperature": temps[sum(sampled[:i]) % len(temps)], "top_p": float(top_p),
                     "seed": seed * 1_000_003 + i} if s else None)
    return plan


# Property names and enum words of the random schemas: common field names, none of them
# bench/structured.py's schema's (its names and enum values stay held out of training).
_FIELD_NAMES = ("id", "name", "title", "kind", "value", "count", "path", "size", "owner", "email", "price", "total",
                "tags", "enabled", "version", "created", "label", "score", "level", "mode", "code", "note", "city",
                "unit", "width", "height", "color", "role", "source", "target")
_ENUM_WORDS = ("open", "closed", "low", "high", "red", "blue", "yes", "no", "draft", "final", "ok", "error", "on",
               "off", "auto", "none")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small JSON schema: an object of 2-5 required properties, each a string of at most 4-32
    characters, an integer, a number, a boolean, an enum of 2-4 words, or (at the top level only)
    an object of the same kind or an array of exactly 1-3 of them."""
    names = rng.sample(_FIELD_NAMES, rng.randint(2, 5))
    props: dict[str, dict] = {}
    for n in names:
        nested = ("array", "object") if depth == 0 else ()
        kind = rng.choice(("string", "integer", "number", "boolean", "enum") + nested)
        if kind == "string":
            props[n] = {"type": "string", "maxLength": rng.choice((4, 8, 16, 32))}
        elif kind == "enum":
            props[n] = {"enum": rng.sample(_ENUM_WORDS, rng.randint(2, 4))}
        elif kind == "array":
            k = rng.randint(1, 3)
            props[n] = {"type": "array", "minItems": k, "maxItems": k, "items": random_schema(rng, depth + 1)}
        elif kind == "object":
            props[n] = random_schema(rng, depth + 1)
        else:
            props[n] = {"type": kind}
    return {"type": "object", "properties": props, "required": names}


CONSTRAINTS = ("json", "schemas")


def constraint_plan(plan: Sequence[dict | None], constrained_share: float, constraint: str = "json",
                    seed: int = 0) -> list[dict | None]:
    """`plan` (see `sampling_plan`) with a share `constrained_share` of its continuations written
    under a JSON grammar, spread evenly as the sampled ones are (the same rule, so with both shares
    the constrained continuations are the sampled ones first): their entry gains "constraint", a
    JSON-able {"type": "json_object"} (`constraint` "json": any JSON object, the server's
    response_format json_object) or {"type": "json_schema", "schema": ...} ("schemas": a
    `random_schema` per continuation, drawn from `seed`; or the path of a JSON schema file: that
    schema for all)."""
    if not 0.0 <= constrained_share <= 1.0:
        raise ValueError(f"[train_drafter] constrained_share must be in [0, 1], got {constrained_share!r}")
    n = len(plan)
    chosen = [int((i + 1) * constrained_share) > int(i * constrained_share) for i in range(n)]
    if not any(chosen):
        return list(plan)
    fixed = None
    if constraint == "json":
        fixed = {"type": "json_object"}
    elif constraint != "schemas":
        path = Path(constraint)
        if not path.is_file():
            raise ValueError(f"[train_drafter] constraint must be one of {', '.join(CONSTRAINTS)} or a JSON schema "
                             f"file; '{constraint}' is neither")
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"[train_drafter] constraint schema '{path}' is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"[train_drafter] constraint schema '{path}' must be a JSON object")
        fixed = {"type": "json_schema", "schema": schema}
    rng = random.Random(seed * 1_000_003 + 37)
    return [({**(p or {}), "constraint": fixed if fixed is not None else {"type": "json_schema",
                                                                         "schema": random_schema(rng)}}
             if c else p) for p, c in zip(plan, chosen)]


def as_chat_prompts(prompts: Sequence[Sequence[int]], plan: Sequence[dict | None], target_gguf,
                    instruction: str = "Reply with one JSON object.") -> list[list[int]]:
    """Each prompt whose plan entry has a constraint as a chat request for JSON: its text (the
    GGUF's tokenizer) as a user message, followed by `instruction`, rendered with the GGUF's chat
    template and tokenized as Engine.chat does; the other prompts as they are."""
    from .._tokenizer import Tokenizer

    tok = Tokenizer(target_gguf)
    if not tok.chat_template:
        raise ValueError(f"[train_drafter] constrained_prompts='chat' needs a chat template; '{target_gguf}' has "
                         f"none (use 'text')")
    out = []
    for p, entry in zip(prompts, plan):
        if entry and entry.get("constraint"):
            text = tok.apply_chat_template([{"role": "user", "content": f"{tok.detokenize(p)}\n\n{instruction}"}])
            p = tok.tokenize(text, add_special=False, parse_special=True)
        out.append([int(t) for t in p])
    return out


def _constraint_of(spec: dict | None):
    """The engine's constraint for a plan entry's "constraint" (see `constraint_plan`)."""
    from ..constraint import JsonSchema

    if spec is None:
        return None
    return JsonSchema(spec.get("schema")) if spec["type"] == "json_schema" else JsonSchema()


def engine_continuations(target_gguf, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         n_threads: int | None = None, sampling: Sequence[dict | None] | None = None,
                         log_every: int = 0) -> list[list[int]]:
    """prompt + `max_new_tokens` tokens of our engine on `target_gguf` (AR, stopping early only
    at the end-of-generation token, or where a grammar is complete), one prompt at a time: greedy,
    or sampled with `sampling[i]` ({temperature, top_p, seed}, see `sampling_plan`) where that is
    not None, under its "constraint" where it has one (`constraint_plan`)."""
    from ..engine import Engine

    if sampling is not None and len(sampling) != len(prompts):
        raise ValueError("[train_drafter] sampling needs one entry per prompt")
    longest = max(len(p) for p in prompts)
    eng = Engine(target_gguf, n_ctx=longest + max_new_tokens + 8, n_threads=n_threads)
    out = []
    for i, p in enumerate(prompts):
        kw = dict((sampling[i] if sampling is not None else None) or {})
        constraint = _constraint_of(kw.pop("constraint", None))
        r = eng.generate([int(t) for t in p], max_tokens=max_new_tokens, speculative=False, constraint=constraint,
                         **kw)
        out.append([int(t) for t in p] + list(r.tokens))
        if log_every and (i + 1) % (10 * log_every) == 0:
            print(f"[train_drafter] engine continuations {i + 1}/{len(prompts)}", flush=True)
    return out


def _cached_continuations(path, target_gguf, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          plan: Sequence[dict | None], n_threads: int | None, log_every: int,
                          save_every: int = 16) -> list[list[int]]:
    """engine_continuations, kept in the JSON file `path` (None: not kept): a continuation the file
    holds for the same target file size, max_new_tokens, prompt and plan entry is read, whatever
    its place in the file (a run that stopped is continued; a run that changes part of the plan,
    such as a constrained share, generates only the changed entries); the others are generated and
    the file rewritten (the current prompts and plan) every `save_every` prompts."""
    key = {"target_gguf_size": Path(target_gguf).stat().st_size, "max_new_tokens": max_new_tokens,
           "prompts": [list(map(int, p)) for p in prompts], "plan": list(plan)}
    known: dict[str, list[int]] = {}
    saved: dict = {}
    if path is not None and Path(path).is_file():
        saved = json.loads(Path(path).read_text())
        if all(saved.get(k) == key[k] for k in ("target_gguf_size", "max_new_tokens")):
            for p, e, s in zip(saved.get("prompts", []), saved.get("plan", []), saved.get("sequences", [])):
                known[json.dumps([p, e], sort_keys=True)] = s
    seqs: list[list[int]] = []
    step = len(prompts) if path is None else save_every
    while len(seqs) < len(prompts):
        part = range(len(seqs), min(len(seqs) + step, len(prompts)))
        have = [known.get(json.dumps([key["prompts"][i], key["plan"][i]], sort_keys=True)) for i in part]
        todo = [i for i, h in zip(part, have) if h is None]
        made = iter(engine_continuations(target_gguf, [prompts[i] for i in todo], max_new_tokens, n_threads=n_threads,
                                         sampling=[plan[i] for i in todo], log_every=0) if todo else [])
        seqs += [h if h is not None else next(made) for h in have]
        if path is not None and todo:
            Path(path).write_text(json.dumps({**key, "sequences": seqs}))
        if log_every and todo:
            print(f"[train_drafter] engine continuations {len(seqs)}/{len(prompts)}", flush=True)
    if path is not None and {k: saved.get(k) for k in key} != key:  # all read from another run's file
        Path(path).write_text(json.dumps({**key, "sequences": seqs}))
    return seqs


def run(target_dir, data, out_dir, *, n_prompts: int = 64, prompt_tokens: int = 64, max_new_tokens: int = 64,
        target_layer_ids: Sequence[int] | None = None, target_gguf=None, out_gguf=None, outtype: str = "f16",
        continuations: str | None = None, engine_threads: int | None = None, long_share: float | None = None,
        sampled_share: float = 0.0, sample_temperatures: Sequence[float] = (0.7, 1.0), sample_top_p: float = 0.95,
        constrained_share: float = 0.0, constraint: str = "json", constrained_prompts: str = "text",
        constrained_extra: int = 0, continuations_file=None, **train_kwargs) -> dict:
    """Check, sample prompts, generate the target's continuations, train, and (with out_gguf)
    convert. `continuations`: "engine" (our engine on `target_gguf`, the default when it is
    given) or "torch" (the PyTorch target). With train_kwargs' `context_length` N, a
    `long_share` of the prompts (default all) have lengths spread over [prompt_tokens,
    N - max_new_tokens] and the rest `prompt_tokens` (see `_prompt_mix`). A `sampled_share` of
    the engine continuations are sampled at `sample_temperatures` / `sample_top_p` instead of
    greedy (see `sampling_plan`; seeds from train_kwargs' `seed`). A `constrained_share` of them
    is written under `constraint` ("json", "schemas" or a schema file, see `constraint_plan`);
    `constrained_extra` more prompts (the same mix of lengths, drawn from seeds seed + 2 and
    seed + 3, not the set's draws) follow the `n_prompts`, each continued under `constraint` (its
    random schemas drawn from seed + 1), so the set's prompts, plan and cached continuations stay
    as they are. The constrained prompts are used as they are (`constrained_prompts` "text") or
    as chat requests for JSON ("chat", `as_chat_prompts`). `continuations_file` (JSON): each engine continuation is read from it when
    it holds one of the same prompt and plan entry, else generated and written to it (a rerun or a
    crash skips the slow part). Returns the recipe."""
    from .drafter import check_context_args, train_drafter

    target_dir = Path(target_dir)
    check_context_args(train_kwargs.get("context_length"), train_kwargs.get("window"))
    if long_share is not None and train_kwargs.get("context_length") is None:
        raise ValueError("[train_drafter] long_share needs context_length (the length long prompts spread up to)")
    if long_share is not None and not 0.0 <= long_share <= 1.0:
        raise ValueError(f"[train_drafter] long_share must be in [0, 1], got {long_share!r}")
    continuations = continuations or ("engine" if target_gguf is not None else "torch")
    if continuations not in ("engine", "torch"):
        raise ValueError(f"[train_drafter] continuations must be 'engine' or 'torch', got {continuations!r}")
    if continuations == "engine" and target_gguf is None:
        raise ValueError("[train_drafter] continuations='engine' needs the target's GGUF (target_gguf)")
    if target_gguf is not None and not Path(target_gguf).is_file():
        raise ValueError(f"[train_drafter] target GGUF '{target_gguf}' does not exist")
    if sampled_share and continuations != "engine":
        raise ValueError("[train_drafter] sampled continuations (sampled_share > 0) need continuations='engine'")
    if isinstance(constrained_extra, bool) or not isinstance(constrained_extra, int) or constrained_extra < 0:
        raise ValueError(f"[train_drafter] constrained_extra must be an integer >= 0, got {constrained_extra!r}")
    if (constrained_share or constrained_extra) and continuations != "engine":
        raise ValueError("[train_drafter] constrained continuations (constrained_share > 0 or constrained_extra > 0) "
                         "need continuations='engine'")
    if constrained_prompts not in ("text", "chat"):
        raise ValueError(f"[train_drafter] constrained_prompts must be 'text' or 'chat', got {constrained_prompts!r}")
    seed = train_kwargs.get("seed", 0)
    plan = sampling_plan(n_prompts, sampled_share, sample_temperatures, sample_top_p, seed)
    plan = constraint_plan(plan, constrained_share, constraint, seed)
    plan += constraint_plan([None] * constrained_extra, 1.0, constraint, seed + 1)
    n_constrained = sum(bool(p and p.get("constraint")) for p in plan)
    if n_constrained:
        from ..constraint import _xgrammar

        try:
            _xgrammar()
        except ImportError as e:
            raise ValueError(f"[train_drafter] constrained continuations: {e}") from None
        if constrained_prompts == "chat":
            as_chat_prompts([], [], target_gguf)  # the GGUF has a chat template
    files = check_request(target_dir, data, target_layer_ids)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    prompts = _prompt_mix(files, tok, n_prompts, prompt_tokens, max_new_tokens, train_kwargs.get("context_length"),
                          long_share, seed)
    if constrained_extra:
        prompts += _prompt_mix(files, tok, constrained_extra, prompt_tokens, max_new_tokens,
                               train_kwargs.get("context_length"), long_share, seed + 2)
    if n_constrained and constrained_prompts == "chat":
        prompts = as_chat_prompts(prompts, plan, target_gguf)
    t0 = time.perf_counter()
    if continuations == "engine":
        seqs = _cached_continuations(continuations_file, target_gguf, prompts, max_new_tokens, plan,
                                     engine_threads, train_kwargs.get("log_every", 0))
        n_constrained_tokens = sum(len(s) - len(p) for s, p, e in zip(seqs, prompts, plan) if e and e.get("constraint"))
        result = train_drafter(target_dir, out_dir, sequences=seqs, sequence_prompt_lengths=[len(p) for p in prompts],
                               max_new_tokens=max_new_tokens, target_layer_ids=target_layer_ids, **train_kwargs)
    else:
        n_constrained_tokens = 0
        result = train_drafter(target_dir, out_dir, prompts=prompts, max_new_tokens=max_new_tokens,
                               target_layer_ids=target_layer_ids, **train_kwargs)
    recipe = json.loads(Path(result.recipe).read_text())
    recipe.update(acceptance_before=result.acceptance_before, acceptance_after=result.acceptance_after,
                  final_loss=result.losses[-1] if result.losses else None, continuations=continuations,
                  n_prompts=n_prompts, prompt_tokens=prompt_tokens, long_share=long_share,
                  sampled_share=sampled_share, sample_temperatures=[float(t) for t in sample_temperatures],
                  sample_top_p=sample_top_p, n_sampled=sum(bool(p and "temperature" in p) for p in plan),
                  constrained_share=constrained_share, constrained_extra=constrained_extra,
                  constraint=constraint if n_constrained else None,
                  constrained_prompts=constrained_prompts if n_constrained else None, n_constrained=n_constrained,
                  n_constrained_tokens=n_constrained_tokens,
                  prompt_lengths=_length_summary([len(p) for p in prompts]),
                  pipeline_seconds=time.perf_counter() - t0)
    if out_gguf is not None:
        from ..convert_dflash import convert_dflash_to_gguf

        convert_dflash_to_gguf(out_dir, out_gguf, outtype=outtype, target_gguf=target_gguf)
        recipe["gguf"] = str(out_gguf)
    with open(Path(out_dir) / "recipe.json", "w", encoding="utf-8") as f:
        json.dump(recipe, f, indent=2)
    return recipe
