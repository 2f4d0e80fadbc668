"""Models by name: `hf://ORG/REPO[@REVISION][:TYPE]` as a target or drafter, through huggingface_hub.

    Engine("hf://Qwen/Qwen3.5-4B:q4_k_m", drafter="hf://z-lab/Qwen3.5-4B-DFlash")
    dflash-native generate --target hf://unsloth/Qwen3.5-4B-GGUF:Q8_0 --prompt ...

A name resolves to a local GGUF file:

- a repository holding GGUF files (llama.cpp-made): the file whose name carries TYPE as a tag
  (case-insensitive, `TYPE` followed by `.` or `-`, as llama.cpp's `-hf` matches; with no TYPE,
  Q4_K_M, then Q8_0, then the only model file there is), downloaded into huggingface_hub's cache and
  used from there. A drafter prefers files with `dflash` in their name. None or several matching:
  ValueError listing the files.
- a repository holding a Hugging Face checkpoint (config.json + *.safetensors): downloaded
  (snapshot_download: its cache, resumed downloads, HF_TOKEN, the revision), converted with the
  package's converter (convert/ for a target, convert_dflash.py for a DFlash drafter, whose
  tokenizer and checks come from the target it is paired with) to TYPE when TYPE is one of the
  converter's types (f32, f16, bf16, q8_0; default f16), else to f16 and then quantized by
  llama.cpp's quantizer (quantization.py: q4_k_m, q6_k, iq4_xs, ...). The result is kept in
  `cache_dir()` under the repository, the resolved commit, the role and TYPE, and the package
  version (a drafter also under the target it was converted against), so a second run loads it
  without downloading or converting anything.

huggingface_hub's environment applies, read when a name is resolved: HF_ENDPOINT, HF_TOKEN,
HF_HUB_CACHE / HF_HOME, and HF_HUB_OFFLINE=1 (nothing is asked of the network: the commit a
revision named last time, and the files cached then, are used). Where the Hub cannot be reached,
the same cached state is used when there is one.

Progress: one line per step on stderr ("[dflash-native hub] ..."), and progress bars (the download's
own, the conversion's and the quantizer's) when stderr is a terminal; quiet=True prints nothing.
Failures are one-line errors that say what to do: ValueError for a name, repository, revision, file
or architecture that is not there or not supported; RuntimeError for access (a gated or private
repository without a token), the network, and offline mode without a cached copy.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from ._progress import draw_bar, stderr_is_terminal

__all__ = ["HubName", "cache_dir", "is_hub_name", "parse", "pick_gguf", "resolve", "resolve_pair"]

PREFIX = "hf://"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = re.compile(rf"^({_PART})/({_PART})(?:@([^:@\s]+))?(?::([^:@/\s]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

# what a checkpoint download takes: config, tokenizer and chat template files, the weights
_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# sidecar GGUFs that are never a model to load (llama.cpp's gguf_filename_is_model)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dspark-")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_DEFAULT_GGUF_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's order when the name gives none
_TARGET_ARCHS = "Llama 3.x, Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE, Qwen3-Next"


@dataclass(frozen=True)
class HubName:
    """hf://REPO[@REVISION][:TYPE] taken apart."""

    repo: str               # "ORG/NAME"
    revision: str | None    # a branch, tag or commit; None: the default branch
    type: str | None        # a GGUF file tag or a converter / quantizer type; None: the default

    def __str__(self) -> str:
        return (PREFIX + self.repo + (f"@{self.revision}" if self.revision else "")
                + (f":{self.type}" if self.type else ""))


def is_hub_name(value) -> bool:
    """True for a str that starts with hf:// (what Engine and the CLI resolve through the Hub)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def parse(name: str) -> HubName:
    """hf://ORG/REPO[@REVISION][:TYPE]; ValueError for anything else."""
    m = _NAME.match(name[len(PREFIX):]) if is_hub_name(name) else None
    if m is None:
        raise ValueError(f"[hub] {name!r} is not a model name: expected hf://ORG/REPO[@REVISION][:TYPE], "
                         f"e.g. hf://Qwen/Qwen3.5-4B:q4_k_m")
    return HubName(f"{m.group(1)}/{m.group(2)}", m.group(3), m.group(4))


def cache_dir() -> Path:
    """Where converted models are kept: $DFLASH_NATIVE_CACHE, else $XDG_CACHE_HOME/dflash-native,
    else ~/.cache/dflash-native. (Downloads stay in huggingface_hub's own cache.)"""
    env = os.environ.get("DFLASH_NATIVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dflash-native"


def resolve_pair(target, drafter=None, *, quiet: bool = False):
    """(target, drafter) with each hf:// name resolved to a local GGUF path (others as they are).
    A drafter converted from a checkpoint is checked against the target and takes its tokenizer."""
    if is_hub_name(target):
        target = resolve(target, quiet=quiet)
    if is_hub_name(drafter):
        drafter = resolve(drafter, role="drafter", target=target, quiet=quiet)
    return target, drafter


def resolve(name: str, *, role: str = "target", target=None, quiet: bool = False) -> Path:
    """The local GGUF file `name` (hf://...) stands for, downloaded and converted when needed (see
    the module's docstring). role: "target" or "drafter"; a drafter converted from a checkpoint
    needs `target`, the local GGUF of the target it drafts for."""
    if role not in ("target", "drafter"):
        raise ValueError(f"[hub] role must be 'target' or 'drafter', got {role!r}")
    hn = parse(name)
    if role == "drafter":
        if target is None:
            raise ValueError(f"[hub] {hn}: a drafter is resolved with its target (resolve(..., target=TARGET))")
        if is_hub_name(target):
            target = resolve(target, quiet=quiet)
        target = Path(os.fsdecode(target))
        if not target.is_file():
            raise ValueError(f"[hub] {hn}: its target {str(target)!r} is not a file")
    return _Resolver(hn, role, target, _Report(quiet)).run()


# ---------------------------------------------------------------------------
# GGUF repositories
# ---------------------------------------------------------------------------

def pick_gguf(files: Sequence[str], tag: str | None, *, drafter: bool = False) -> str:
    """The GGUF file of `files` that `tag` names (see the module's docstring); ValueError listing
    the GGUF files when none or several match, or when the match is one part of a split model
    (a message without the name: resolve() puts it in front)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    models = [f for f in ggufs if not any(k in f.rsplit("/", 1)[-1] for k in _NOT_MODELS)]
    if drafter and any("dflash" in f.lower() for f in models):
        models = [f for f in models if "dflash" in f.lower()]
    elif not drafter:
        models = [f for f in models if "dflash-" not in f.rsplit("/", 1)[-1]]
    firsts = [f for f in models if not _SPLIT.search(f) or int(_SPLIT.search(f).group(1)) == 1]
    listing = ", ".join(ggufs) or "none"
    if tag is not None and tag.lower().endswith(".gguf"):  # a file named outright
        hits = [f for f in ggufs if f.lower() == tag.lower() or f.lower().endswith("/" + tag.lower())]
        return _one(hits, f"no GGUF file named {tag!r}", listing)
    for t in (tag,) if tag is not None else _DEFAULT_GGUF_TAGS:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        hits = [f for f in firsts if pattern.search(f.rsplit("/", 1)[-1])]
        if hits or tag is not None:
            return _one(hits, f"no GGUF file matches :{t}", listing)
    return _one(firsts, "no GGUF model file", listing)


def _one(hits: list[str], none: str, listing: str) -> str:
    if not hits:
        raise ValueError(f"{none}; its GGUF files: {listing}")
    if len(hits) > 1:
        raise ValueError(f"{len(hits)} GGUF files match ({', '.join(hits)}): name one with :FILE.gguf "
                         f"or a longer tag")
    m = _SPLIT.search(hits[0])
    if m and int(m.group(2)) > 1:
        raise ValueError(f"{hits[0]} is part 1 of a model split in {int(m.group(2))} files, which "
                         f"dflash-native does not load: pick another type, or merge the parts with "
                         f"llama-gguf-split --merge and pass the file")
    return hits[0]


def _is_checkpoint(files: Sequence[str]) -> bool:
    return "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files)


# ---------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------

class _Report:
    """Status lines on stderr (unless quiet), progress bars only when stderr is a terminal."""

    def __init__(self, quiet: bool):
        self.quiet = bool(quiet)
        self.bars = not self.quiet and stderr_is_terminal()

    def line(self, text: str) -> None:
        if not self.quiet:
            print(f"[dflash-native hub] {text}", file=sys.stderr, flush=True)

    def bar(self, label: str, head: str):
        """A converter progress callback, or None without bars."""
        if not self.bars:
            return None
        return lambda i, n, tensor: draw_bar(label, i, n, tensor, head=head)


class _Resolver:
    """One name's resolution: the commit and the repository's files (from the Hub, else from what
    was cached), then a GGUF pick or a checkpoint conversion."""

    def __init__(self, hn: HubName, role: str, target: Path | None, report: _Report):
        self.hn, self.role, self.target, self.report = hn, role, target, report
        self.endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        self.offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
        self.local_only = self.offline
        self.unreachable: str | None = None  # why the Hub could not be asked, when it could not
        self.repo_cache = cache_dir() / "hub" / ("models--" + hn.repo.replace("/", "--"))

    # -- the steps ----------------------------------------------------------------------
    def run(self) -> Path:
        commit, files = self._commit_and_files()
        if files is None:  # offline, or the Hub unreachable: what was cached for this commit
            if self._converted(commit) is not None:
                return self._checkpoint(commit)
            files = self._cached_files(commit)
        checkpoint = _is_checkpoint(files)
        if any(f.lower().endswith(".gguf") for f in files) and (not checkpoint or self._gguf_tag_hits(files)):
            return self._gguf(commit, files)
        if checkpoint:
            return self._checkpoint(commit)
        raise ValueError(f"[hub] {self.hn}: the repository holds neither GGUF files nor a Hugging Face checkpoint "
                         f"(config.json + *.safetensors); its files: {', '.join(files) or 'none'}")

    def _gguf_tag_hits(self, files: Sequence[str]) -> bool:
        """Whether a repository with both a checkpoint and GGUF files has a GGUF for this name."""
        try:
            pick_gguf(files, self.hn.type, drafter=self.role == "drafter")
            return True
        except ValueError:
            return False

    def _commit_and_files(self) -> tuple[str, list[str] | None]:
        """The commit the revision names and the repository's files, from the Hub; offline or
        where the Hub cannot be reached, the commit recorded last time (files: None)."""
        if not self.offline:
            from huggingface_hub import HfApi

            try:
                info = HfApi(endpoint=self.endpoint).model_info(self.hn.repo, revision=self.hn.revision)
            except Exception as e:  # noqa: BLE001 -- sorted by _hub_error; a transport failure falls back
                err = self._hub_error(e)
                if err is not None:
                    raise err from None
                self.unreachable = _first_line(e)
                self.local_only = True
            else:
                commit = str(info.sha)
                self._write_ref(commit)
                return commit, [s.rfilename for s in (info.siblings or [])]
        commit = self._read_ref()
        if commit is None:
            raise self._not_cached()
        return commit, None

    def _gguf(self, commit: str, files: Sequence[str]) -> Path:
        try:
            fname = pick_gguf(files, self.hn.type, drafter=self.role == "drafter")
        except ValueError as e:
            raise ValueError(f"[hub] {self.hn}: {e}") from None
        self.report.line(f"{self.hn}: {fname} (GGUF from the repository, commit {commit[:12]})")
        with self._hub_calls():
            path = self._download(fname, commit)
        return Path(path)

    def _checkpoint(self, commit: str) -> Path:
        from .convert import OUTTYPES

        qtype = self._checkpoint_type()
        out = self._converted(commit)
        if out is not None:
            self.report.line(f"{self.hn}: {out} (converted before)")
            return out
        out = self.repo_cache / commit / self._converted_name(qtype)
        with self._hub_calls():  # config.json first: a wrong role or architecture before the weights
            config_dir = Path(self._download("config.json", commit)).parent
        self._check_config(config_dir)
        self.report.line(f"{self.hn}: fetching the checkpoint (commit {commit[:12]}) into huggingface_hub's cache")
        with self._hub_calls():
            snapshot = Path(self._snapshot(commit))
        out.parent.mkdir(parents=True, exist_ok=True)
        conv_type = qtype if qtype in OUTTYPES else "f16"
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        self.report.line(f"{self.hn}: converting to GGUF {conv_type}")
        try:
            self._convert(snapshot, tmp, conv_type)
            if qtype != conv_type:
                from .quantization import quantize

                self.report.line(f"{self.hn}: quantizing to {qtype}")
                qtmp = out.with_name(f".{out.name}.{os.getpid()}.q.tmp")
                try:
                    quantize(tmp, qtmp, qtype, progress=self.report.bars)
                finally:
                    tmp.unlink(missing_ok=True)
                tmp = qtmp
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        self.report.line(f"{self.hn}: wrote {out}")
        return out

    def _convert(self, snapshot: Path, dst: Path, outtype: str) -> None:
        name = self.hn.repo.split("/", 1)[1]
        bar = self.report.bar("convert", name)
        if self.role == "target":
            from .convert import convert_hf_to_gguf

            convert_hf_to_gguf(snapshot, dst, outtype=outtype, name=name, progress=bar)
        else:
            from .convert_dflash import convert_dflash_to_gguf

            convert_dflash_to_gguf(snapshot, dst, outtype=outtype, target_gguf=self.target, name=name, progress=bar)

    # -- the converted file -------------------------------------------------------------
    def _checkpoint_type(self) -> str:
        from .convert import OUTTYPES
        from .quantization import ALIASES, FTYPES, quantize_types

        t = (self.hn.type or "f16").lower()
        t = ALIASES.get(t, t)
        if t not in OUTTYPES and t not in FTYPES:
            raise ValueError(f"[hub] {self.hn}: the repository is a Hugging Face checkpoint, and {self.hn.type!r} is "
                             f"not a type it can be converted to; one of: {', '.join(quantize_types())}")
        return t

    def _converted_name(self, qtype: str) -> str:
        from . import __version__

        role = self.role
        if role == "drafter":  # converted against this target: its tokenizer and checks
            st = self.target.stat()
            key = f"{self.target.resolve()}|{st.st_size}|{st.st_mtime_ns}"
            role += "-t" + hashlib.sha256(key.encode()).hexdigest()[:12]
        return f"{role}-{qtype}-dflash-native-{__version__}.gguf"

    def _converted(self, commit: str) -> Path | None:
        try:
            qtype = self._checkpoint_type()
        except ValueError:
            return None  # a GGUF tag, not a conversion type
        out = self.repo_cache / commit / self._converted_name(qtype)
        return out if out.is_file() else None

    def _check_config(self, config_dir: Path) -> None:
        """Refuse a checkpoint of the wrong role or an architecture the converter does not take,
        before the weights are downloaded."""
        from .convert.hparams import read_config_json

        config = read_config_json(config_dir, "hub")
        archs = config.get("architectures") or []
        is_drafter = isinstance(config.get("dflash_config"), dict) or any("DFlash" in str(a) for a in archs)
        if self.role == "target" and is_drafter:
            raise ValueError(f"[hub] {self.hn} is a DFlash drafter, not a target: pass it as the drafter "
                             f"(drafter=..., --drafter)")
        if self.role == "drafter" and not is_drafter:
            raise ValueError(f"[hub] {self.hn} is not a DFlash drafter (architectures {archs}): pass it as the target, "
                             f"and a DFlash drafter (a DFlashDraftModel checkpoint) as the drafter")
        if self.role == "target":
            from .convert.hparams import load_model_spec

            try:
                load_model_spec(config_dir)
            except ValueError as e:
                if "unsupported architecture" not in str(e):
                    raise
                raise ValueError(f"[hub] {self.hn}: architecture {archs} (model_type {config.get('model_type')!r}) is "
                                 f"not one dflash-native converts ({_TARGET_ARCHS}): pick a model of one of "
                                 f"these") from None
        else:
            from .convert_dflash import load_dflash_spec

            load_dflash_spec(config_dir)

    # -- huggingface_hub calls ----------------------------------------------------------
    def _download(self, filename: str, commit: str) -> str:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.hn.repo, filename, revision=commit, endpoint=self.endpoint,
                               cache_dir=_hf_cache_dir(), local_files_only=self.local_only)

    def _snapshot(self, commit: str) -> str:
        from huggingface_hub import snapshot_download

        return snapshot_download(self.hn.repo, revision=commit, endpoint=self.endpoint, cache_dir=_hf_cache_dir(),
                                 allow_patterns=_CHECKPOINT_PATTERNS, local_files_only=self.local_only)

    @contextmanager
    def _hub_calls(self) -> Iterator[None]:
        """huggingface_hub's download bars only where ours would show; its errors as ours."""
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        silence = not self.report.bars and not are_progress_bars_disabled()
        if silence:
            disable_progress_bars()
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- huggingface_hub's and the transport's errors
            raise self._hub_error(e) or self._not_cached() from None
        finally:
            if silence:
                enable_progress_bars()

    def _cached_files(self, commit: str) -> list[str]:
        """The files of `commit` in huggingface_hub's cache (offline, or the Hub unreachable)."""
        snapshot = Path(_hf_cache_dir() or _hf_default_cache()) / ("models--" + self.hn.repo.replace("/", "--")) \
            / "snapshots" / commit
        if not snapshot.is_dir():
            raise self._not_cached()
        return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())

    def _hub_error(self, e: BaseException) -> Exception | None:
        """The one-line error for a huggingface_hub failure; None for a transport failure (no
        network, a refused connection, offline mode), which the caller answers from the cache."""
        from huggingface_hub import errors as E

        hn = self.hn
        if isinstance(e, E.GatedRepoError):
            how = "the token in HF_TOKEN has no access" if _has_token() else "no token is set"
            return RuntimeError(f"[hub] {hn} is a gated repository and {how}: accept its terms at "
                                f"{self.endpoint}/{hn.repo}, then set HF_TOKEN to a token of that account (or run "
                                f"`hf auth login`)")
        if isinstance(e, E.RepositoryNotFoundError):
            return ValueError(f"[hub] {hn}: no model repository {hn.repo!r} on {self.endpoint}: check the name (a "
                              f"private repository also needs HF_TOKEN set to a token that can read it)")
        if isinstance(e, E.RevisionNotFoundError):
            return ValueError(f"[hub] {hn}: the repository has no revision {hn.revision!r}: name a branch, tag or "
                              f"commit of it after '@'")
        remote_missing = getattr(E, "RemoteEntryNotFoundError", E.EntryNotFoundError)
        if isinstance(e, remote_missing) and isinstance(e, E.HfHubHTTPError):
            return ValueError(f"[hub] {hn}: a file the repository lists is missing on {self.endpoint}: "
                              f"{_first_line(e)}")
        if isinstance(e, E.HfHubHTTPError) and getattr(e, "response", None) is not None:
            status = e.response.status_code
            if status in (401, 403):
                return RuntimeError(f"[hub] {hn}: access denied (HTTP {status}): set HF_TOKEN to a token that can "
                                    f"read {hn.repo} (or run `hf auth login`)")
            if status >= 500:  # the Hub is down: as unreachable (the cached copy, if any)
                self.unreachable = self.unreachable or f"HTTP {status}"
                return None
            return RuntimeError(f"[hub] {hn}: {self.endpoint} answered HTTP {status}; try again later")
        if _is_transport_error(e):
            self.unreachable = self.unreachable or _first_line(e)
            return None
        return RuntimeError(f"[hub] {hn}: {type(e).__name__}: {_first_line(e)}")

    def _not_cached(self) -> RuntimeError:
        if self.offline:
            return RuntimeError(f"[hub] {self.hn}: HF_HUB_OFFLINE is set and the model is not in the local cache: "
                                f"run once without HF_HUB_OFFLINE to download it")
        return RuntimeError(f"[hub] {self.hn}: cannot reach {self.endpoint} ({self.unreachable or 'no network'}) "
                            f"and the model is not in the local cache: check the network connection (or "
                            f"HF_ENDPOINT), then run again")

    # -- the revision -> commit record ----------------------------------------------------
    def _ref_file(self) -> Path:
        return self.repo_cache / "refs" / (self.hn.revision or "main")

    def _write_ref(self, commit: str) -> None:
        ref = self._ref_file()
        try:
            ref.parent.mkdir(parents=True, exist_ok=True)
            tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
            tmp.write_text(commit)
            os.replace(tmp, ref)
        except OSError:
            pass  # a read-only cache: offline use then relies on huggingface_hub's own refs

    def _read_ref(self) -> str | None:
        """The commit the revision named when last resolved: a commit itself, our record, or
        huggingface_hub's."""
        rev = self.hn.revision or "main"
        if _COMMIT.match(rev):
            return rev
        hf_ref = Path(_hf_cache_dir() or _hf_default_cache()) / ("models--" + self.hn.repo.replace("/", "--")) \
            / "refs" / rev
        for ref in (self._ref_file(), hf_ref):
            try:
                commit = ref.read_text().strip()
            except OSError:
                continue
            if _COMMIT.match(commit):
                return commit
        return None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hf_cache_dir() -> str | None:
    """huggingface_hub's cache as the environment names it now (its constants were read at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def _hf_default_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def _is_transport_error(e: BaseException) -> bool:
    """No answer from the Hub: a connection refused or dropped, a timeout, DNS, offline mode, or
    huggingface_hub's 'not cached and cannot be fetched'."""
    from huggingface_hub import errors as E

    if isinstance(e, (ConnectionError, TimeoutError, E.LocalEntryNotFoundError, E.OfflineModeIsEnabled)):
        return True
    root = type(e).__module__.split(".")[0]
    return root in ("httpx", "httpx2", "requests", "urllib3", "httpcore", "socket", "ssl")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__

