"""Models by their Hugging Face Hub name (DESIGN §14).

``resolve_model("org/name:Q4_K_M")`` turns a Hub name into local files, fetched into (or found
in) huggingface_hub's cache, and returns the path ``ModelRuntime.load`` reads:

- a local path that exists always wins and comes back unchanged;
- ``org/name`` or ``org/name:TAG`` (also behind ``hf.co/`` or ``https://huggingface.co/``), the
  tag a GGUF quantization read case-insensitively as llama.cpp's ``-hf`` and Ollama read it;
- GGUF repositories: only the chosen file is downloaded (every part of a split file, the path
  of the first part returned), Q4_K_M by default where the repository has several; ``mmproj``
  files (vision projectors) are never taken for the model;
- safetensors repositories: only what loading reads (config, generation config, tokenizer
  files, chat template, the weights the loader opens), the snapshot directory returned.

Everything goes through huggingface_hub: its cache and ``HF_HOME`` / ``HF_HUB_CACHE``,
``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, its progress bars on stderr. A download is
written to a temporary file and renamed into the cache once whole, so a file that was cut off
is never returned. With ``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, a model in the
cache resolves without any network request.

huggingface_hub is imported only when a Hub name is resolved: ``import candlewick`` and loading
local paths never need it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from ._native import ArtifactError, InvalidOptionError

__all__ = [
    "DEFAULT_TAG",
    "CachedModel",
    "DownloadError",
    "GatedRepositoryError",
    "HubError",
    "HubOfflineError",
    "UnknownFileError",
    "UnknownRepositoryError",
    "UnknownRevisionError",
    "UnknownTagError",
    "cached_models",
    "is_hub_name",
    "resolve_model",
]

#: The quantization taken from a GGUF repository with several when no tag is given (as llama.cpp).
DEFAULT_TAG = "Q4_K_M"


class HubError(ArtifactError):
    """A model named by its Hub name could not be resolved to local files.

    An ``ArtifactError``, as a missing local model is, so code that catches a model it cannot
    load keeps working with Hub names. ``repo_id`` and ``filename`` name what was asked for
    (``filename`` is None where the error concerns the whole repository)."""

    def __init__(self, message: str, repo_id: Optional[str] = None, filename: Optional[str] = None) -> None:
        super().__init__(message)
        self.repo_id = repo_id
        self.filename = filename


class UnknownRepositoryError(HubError):
    """The Hub has no such repository, or it is private and no token that can read it was sent."""


class UnknownRevisionError(HubError):
    """The repository has no such branch, tag or commit (``revision``)."""

    def __init__(self, message: str, repo_id: Optional[str] = None, filename: Optional[str] = None,
                 revision: Optional[str] = None) -> None:
        super().__init__(message, repo_id, filename)
        self.revision = revision


class UnknownTagError(HubError):
    """No GGUF file of the repository carries the quantization tag asked for, or no tag was
    given and the repository has several quantizations, none of them Q4_K_M. ``available``
    lists the tags it has; ``tag`` is the one asked for (None when none was)."""

    def __init__(self, message: str, repo_id: Optional[str] = None, filename: Optional[str] = None,
                 tag: Optional[str] = None, available: Sequence[str] = ()) -> None:
        super().__init__(message, repo_id, filename)
        self.tag = tag
        self.available = list(available)


class UnknownFileError(HubError):
    """``filename=`` (a name or glob) matches no model file of the repository, or matches
    several models. ``available`` lists the repository's GGUF model files."""

    def __init__(self, message: str, repo_id: Optional[str] = None, filename: Optional[str] = None,
                 available: Sequence[str] = ()) -> None:
        super().__init__(message, repo_id, filename)
        self.available = list(available)


class GatedRepositoryError(HubError):
    """The repository is gated or private and the request carried no token with access
    (``HF_TOKEN``, or ``hf auth login``)."""


class HubOfflineError(HubError):
    """The Hub cannot be reached (no network, ``HF_HUB_OFFLINE=1``, the Hub answering with a
    server error) and the model is not in the cache."""


class DownloadError(HubError):
    """A download failed part-way (the connection cut off, the server failing mid-file, the
    disk full). What arrived is never taken for the file: huggingface_hub writes a temporary
    file and renames it into the cache only once whole. Running the same call again downloads
    it anew (or, with huggingface_hub before 1.0, resumes the partial one)."""


class CachedModel(NamedTuple):
    """A model in huggingface_hub's cache, as ``candlewick ls`` lists it."""

    #: What to load it by: ``org/name:TAG`` for a GGUF quantization, ``org/name`` for safetensors.
    name: str
    #: The refs that point at the cached commit (``main``), or the commit itself when none does.
    revision: str
    #: Bytes on disk of its files.
    size: int
    #: Its files, relative to the repository.
    files: tuple[str, ...]
    #: The local path ``resolve_model`` returns for it.
    path: str


# --- names ---------------------------------------------------------------------------------

_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "http://hf.co/",
             "huggingface.co/", "hf.co/")
# The Hub's repository ids: `org/name`, word characters, `-` and `.`, starting and ending with a
# word character, with no `--` or `..` (huggingface_hub's validate_repo_id).
_REPO_ID = re.compile(r"^(\w(?:[\w.-]*\w)?)/(\w(?:[\w.-]*\w)?)$")
_TAG = re.compile(r"^[\w.-]+$")
# A last path component with one of these endings names a weights file: a missing local file,
# never a repository, so a typo in a path is not sent to the Hub.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _parse(text: str) -> Optional[tuple[str, Optional[str]]]:
    """(`repo_id`, `tag` or None) of a Hub name, None when `text` is not one."""
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):].rstrip("/")
            break
    name, sep, tag = text.partition(":")
    m = _REPO_ID.match(name)
    if m is None or "--" in name or ".." in name or name.lower().endswith(_FILE_SUFFIXES):
        return None
    if sep and not _TAG.match(tag):
        return None
    # Ollama's `:latest` is its default tag, not a quantization.
    return name, (tag if sep and tag.lower() != "latest" else None)


def is_hub_name(model: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether `model`, when no such local path exists, is read as a Hub name (``org/name[:TAG]``)."""
    return _parse(os.fspath(model)) is not None


# --- choosing files --------------------------------------------------------------------------

# A quantization tag in a GGUF file name as llama.cpp's converter and quantizer write them
# (`-Q4_K_M`, `.q8_0`, `-IQ4_XS`, `-BF16`, unsloth's `-UD-Q4_K_XL`), not inside a word.
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q[1-8](?:_[0-9]){0,3}(?:_K)?(?:_(?:XXS|XS|XL|NL|S|M|L))?"
    r"|TQ[12]_0|MXFP4(?:_MOE)?|BF16|F16|F32|FP16|FP32))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# What the loader reads from a Hugging Face directory beside the weights (src/text/tokenizer.rs,
# src/backend/config), and the image processors' configs that image input (§13) reads.
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
               "preprocessor_config.json", "processor_config.json")
_INDEX = "model.safetensors.index.json"


def _is_model_gguf(path: str) -> bool:
    """A GGUF file that holds a model: not a vision projector (`mmproj*.gguf`)."""
    base = path.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not base.startswith("mmproj") and "-mmproj" not in base


def _tag_of(path: str) -> Optional[str]:
    """The quantization tag of a GGUF file name (upper case), None when it names none."""
    base = path.rsplit("/", 1)[-1]
    m = _SPLIT.match(base)
    stem = m.group(1) if m else base[: -len(".gguf")]
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def _units(files: Sequence[str]) -> list[list[str]]:
    """The repository's GGUF models: each a single file, or every part of a split file, in order."""
    singles: list[list[str]] = []
    splits: dict[tuple[str, str], list[str]] = {}
    for f in sorted(f for f in files if _is_model_gguf(f)):
        m = _SPLIT.match(f)
        if m:
            splits.setdefault((m.group(1), m.group(3)), []).append(f)
        else:
            singles.append([f])
    return singles + [parts for _, parts in sorted(splits.items())]


def _complete(repo_id: str, parts: list[str]) -> list[str]:
    """`parts` when it holds every part of its split file (or is one plain file), else an error."""
    m = _SPLIT.match(parts[0])
    if m is None:
        return parts
    count = int(m.group(3))
    numbers = sorted(int(_SPLIT.match(p).group(2)) for p in parts)  # type: ignore[union-attr]
    if numbers != list(range(1, count + 1)):
        raise HubError(f"{repo_id}: the split file {parts[0]} should have {count} parts, the repository "
                       f"lists {len(parts)}", repo_id, parts[0])
    return parts


def _describe(units: list[list[str]]) -> list[str]:
    """Each model's files as one line (a split file as its first part and the count)."""
    return [u[0] if len(u) == 1 else f"{u[0]} (+{len(u) - 1} parts)" for u in units]


def _tags(units: list[list[str]]) -> list[str]:
    return sorted({t for u in units if (t := _tag_of(u[0])) is not None})


def _choose_gguf(repo_id: str, files: Sequence[str], tag: Optional[str], filename: Optional[str]) -> list[str]:
    """The files of the GGUF model that `tag` or `filename` (or the default) picks, first part first."""
    units = _units(files)
    if filename is not None:
        import fnmatch

        def matches(path: str) -> bool:
            return fnmatch.fnmatchcase(path, filename) or (
                "/" not in filename and fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], filename))

        picked = [u for u in units if any(matches(p) for p in u)]
        if len(picked) == 1:
            return _complete(repo_id, picked[0])
        listed = [f for u in units for f in u]
        if picked:
            raise UnknownFileError(
                f"{repo_id}: filename={filename!r} matches several models: {', '.join(_describe(picked))}; "
                "name one of them", repo_id, filename, listed)
        projector = [f for f in files if f.lower().endswith(".gguf") and not _is_model_gguf(f) and matches(f)]
        why = (f" ({', '.join(projector)} is a vision projector, not a model)" if projector else "")
        raise UnknownFileError(
            f"{repo_id}: no GGUF model file matches filename={filename!r}{why}; the repository has: "
            f"{', '.join(_describe(units)) or 'no GGUF model files'}", repo_id, filename, listed)
    if tag is not None:
        want = tag.upper()
        picked = [u for u in units if _tag_of(u[0]) == want]
        if not picked:
            # A tag that is a delimited part of the name but not what the quantization pattern
            # reads (`UD-Q4_K_XL` asked as `Q4_K_XL`, a tag of the repository's own): as the Hub's
            # manifest API, which matches it in the file name.
            token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(want)}(?![A-Za-z0-9])")
            picked = [u for u in units if token.search(u[0].rsplit("/", 1)[-1].upper())]
        if len(picked) == 1:
            return _complete(repo_id, picked[0])
        if picked:
            raise UnknownFileError(
                f"{repo_id}: the tag {tag} matches several models: {', '.join(_describe(picked))}; "
                "choose one with filename=", repo_id, None, [f for u in units for f in u])
        available = _tags(units)
        raise UnknownTagError(
            f"{repo_id} has no GGUF file tagged {tag}; "
            + (f"its tags: {', '.join(available)}" if available else
               "it has no GGUF model files" if not units else
               f"its GGUF files: {', '.join(_describe(units))} (choose with filename=)"),
            repo_id, None, tag, available)
    if len(units) == 1:
        return _complete(repo_id, units[0])
    default = [u for u in units if _tag_of(u[0]) == DEFAULT_TAG]
    if len(default) == 1:
        return _complete(repo_id, default[0])
    available = _tags(units)
    raise UnknownTagError(
        f"{repo_id} has several GGUF models and {'none' if not default else 'more than one'} tagged "
        f"{DEFAULT_TAG}; name one as {repo_id}:TAG, TAG one of: {', '.join(available) or '(none)'}"
        f" (files: {', '.join(_describe(units))})", repo_id, None, None, available)


def _safetensors_weights(repo_id: str, files: Sequence[str], read_index: Callable[[], dict]) -> list[str]:
    """The weight files the loader opens: `model.safetensors`, else the index and its shards
    (src/backend/weights/safetensors.rs). Other weight formats are never taken."""
    if "model.safetensors" in files:
        return ["model.safetensors"]
    if _INDEX in files:
        index = read_index()
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HubError(f"{repo_id}: {_INDEX} has no weight_map", repo_id, _INDEX)
        shards = sorted({str(v) for v in weight_map.values()})
        return [_INDEX, *shards]
    raise HubError(f"{repo_id} has config.json but neither model.safetensors nor {_INDEX}, which is what "
                   "candlewick loads from a Hugging Face checkpoint", repo_id, None)


def _is_safetensors_repo(files: Sequence[str]) -> bool:
    return "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files)


class _Choice(NamedTuple):
    """The files to fetch, and the one to return (None: the snapshot directory)."""

    files: list[str]
    model_file: Optional[str]


def _choose(repo_id: str, files: Sequence[str], tag: Optional[str], filename: Optional[str],
            read_index: Callable[[], dict]) -> _Choice:
    """What to fetch of a repository listing `files`: a GGUF model, or a safetensors checkpoint.

    A tag or `filename` always means GGUF; without either a repository with a loadable
    safetensors checkpoint gives that (the weights as published), else its GGUF models."""
    gguf = [f for f in files if _is_model_gguf(f)]
    if tag is not None or filename is not None or (gguf and not _is_safetensors_repo(files)):
        parts = _choose_gguf(repo_id, files, tag, filename)
        return _Choice(parts, parts[0])
    if _is_safetensors_repo(files):
        weights = _safetensors_weights(repo_id, files, read_index)
        side = [f for f in _SIDE_FILES if f in files]
        return _Choice(side + weights, None)
    shown = ", ".join(sorted(files)[:20]) + (" ..." if len(files) > 20 else "")
    raise HubError(f"{repo_id} holds no model candlewick loads (GGUF files, or config.json with safetensors "
                   f"weights); its files: {shown or 'none'}", repo_id, None)


# --- huggingface_hub -------------------------------------------------------------------------

def _hub() -> Any:
    """huggingface_hub, imported on first use of a Hub name."""
    try:
        import huggingface_hub
        # Submodules the package loads lazily, imported so that they are its attributes;
        # `utils` names the exceptions in every version from 0.24 (`errors` only from 1.0).
        import huggingface_hub.constants
        import huggingface_hub.utils  # noqa: F401
    except ImportError as e:  # a dependency of the package; missing only in a broken install
        raise HubError(f"loading a model by its Hub name needs huggingface_hub: pip install 'huggingface_hub>=0.24' "
                       f"({e})") from None
    return huggingface_hub


def _offline(hub: Any) -> bool:
    is_offline = getattr(hub.constants, "is_offline_mode", None)
    return bool(is_offline() if callable(is_offline) else hub.constants.HF_HUB_OFFLINE)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection and timeout errors: httpx2, httpx or requests, by version
    of huggingface_hub."""
    found: list[type[BaseException]] = []
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests.exceptions", ("ConnectionError", "Timeout"))):
        try:
            mod = __import__(module, fromlist=["_"])
        except ImportError:
            continue
        found.extend(getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type))
    return tuple(found)


def _endpoint(hub: Any) -> str:
    return str(hub.constants.ENDPOINT)


def _status(error: BaseException) -> Optional[int]:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _repo_error(hub: Any, error: BaseException, repo_id: str, filename: Optional[str],
                revision: Optional[str]) -> Optional[HubError]:
    """The typed error for what the Hub said about the repository, None for other failures."""
    errors = hub.utils
    at = f" at revision {revision!r}" if revision else ""
    what = f"{repo_id}/{filename}" if filename else repo_id
    if isinstance(error, errors.GatedRepoError):
        return GatedRepositoryError(
            f"{what} is gated: accept its terms at {_endpoint(hub)}/{repo_id} and set HF_TOKEN to a token of "
            f"that account (or run `hf auth login`)", repo_id, filename)
    if isinstance(error, errors.RepositoryNotFoundError):
        token = (" with the token sent" if hub.get_token()
                 else "; if it is private, set HF_TOKEN to a token that can read it")
        return UnknownRepositoryError(
            f"no repository {repo_id} on the Hub ({_endpoint(hub)}){token} (and no local path {repo_id} either)",
            repo_id, filename)
    if isinstance(error, errors.RevisionNotFoundError):
        return UnknownRevisionError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)",
                                    repo_id, filename, revision)
    if _status(error) in (401, 403):
        return GatedRepositoryError(
            f"the Hub refused access to {what}{at} ({_status(error)}): it needs a token with access (HF_TOKEN)",
            repo_id, filename)
    return None


def _unreachable(hub: Any, error: BaseException) -> bool:
    """Whether `error` says the Hub cannot be reached now (rather than what it holds)."""
    errors = hub.utils
    if isinstance(error, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError) + _transport_errors()):
        return True
    status = _status(error)
    return isinstance(error, errors.HfHubHTTPError) and status is not None and (status >= 500 or status == 429)


def _cause(error: BaseException) -> str:
    """A one-line account of a client error (huggingface_hub's messages run over several lines)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# --- the cache -------------------------------------------------------------------------------

def _storage(hub: Any, repo_id: str) -> Path:
    """The repository's folder in the cache (huggingface_hub's documented layout)."""
    return Path(hub.constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def _cached_snapshot(hub: Any, repo_id: str, revision: Optional[str]) -> Optional[tuple[Path, list[str]]]:
    """The cached snapshot of `revision` (its folder and the files whose content is there), or None."""
    storage = _storage(hub, repo_id)
    rev = revision or "main"
    commit: Optional[str] = rev if _COMMIT.match(rev) else None
    if commit is None:
        ref = storage / "refs" / rev
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    files = []
    for root, _, names in os.walk(snapshot):
        for n in names:
            p = Path(root) / n
            if p.is_file():  # a link whose blob is gone is not a cached file
                files.append(p.relative_to(snapshot).as_posix())
    return snapshot, sorted(files)


def _from_cache(hub: Any, repo_id: str, tag: Optional[str], filename: Optional[str], revision: Optional[str],
                reason: str) -> str:
    """The model from the cache alone (no request is made), or HubOfflineError saying why not."""
    label = repo_id + (f":{tag}" if tag else "") + (f" (filename={filename!r})" if filename else "") + (
        f" at revision {revision!r}" if revision else "")
    hint = ("pass a local path instead, or fetch it while online (`candlewick pull`); with a model in the "
            "cache, HF_HUB_OFFLINE=1 loads it with no network at all")
    found = _cached_snapshot(hub, repo_id, revision)
    if found is None:
        raise HubOfflineError(f"{reason}, and {label} is not in the cache ({hub.constants.HF_HUB_CACHE}): {hint}",
                              repo_id, filename)
    snapshot, files = found

    def read_index() -> dict:
        return json.loads((snapshot / _INDEX).read_text())

    try:
        choice = _choose(repo_id, files, tag, filename, read_index)
    except HubError:
        held = _describe(_units(files)) + (["a safetensors checkpoint"] if _is_safetensors_repo(files) else [])
        raise HubOfflineError(f"{reason}, and the cache does not hold {label} (of {repo_id} it holds "
                              f"{', '.join(held) or 'no model files'}): {hint}", repo_id, filename) from None
    # The choice was made from the cached files, but an index can name shards never downloaded.
    missing = [f for f in choice.files if f not in files]
    if missing:
        raise HubOfflineError(f"{reason}, and the cached {label} lacks {', '.join(missing)}: {hint}",
                              repo_id, missing[0])
    return str(snapshot / choice.model_file) if choice.model_file else str(snapshot)


# --- resolving -------------------------------------------------------------------------------

def _escape(name: str) -> str:
    """`name` as an fnmatch pattern that matches only itself (allow_patterns are globs)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def resolve_model(model: Union[str, "os.PathLike[str]"], filename: Optional[str] = None,
                  revision: Optional[str] = None) -> str:
    """The local path of `model`: a path that exists comes back unchanged; a Hub name
    (``org/name``, ``org/name:TAG``) is fetched into, or found in, huggingface_hub's cache and
    its local path returned: the GGUF file (the first part of a split file, every part beside
    it) or the snapshot directory of a safetensors checkpoint. A string that is neither an
    existing path nor a Hub name comes back unchanged too, for the loader to report the
    missing path as it always has.

    `filename`: a GGUF file name or glob (``"*Q8_0.gguf"``) choosing among the repository's
    files, instead of a tag. `revision`: a branch, tag or commit of the repository (default:
    its main branch). Both choose among a repository's files: given with a local path, they
    are refused (``InvalidOptionError``) rather than ignored.

    Raises a ``HubError`` naming the repository and file: ``UnknownRepositoryError``,
    ``UnknownRevisionError``, ``UnknownTagError`` (with ``.available``), ``UnknownFileError``,
    ``GatedRepositoryError``, ``HubOfflineError``, ``DownloadError``."""
    text = os.fspath(model)
    if os.path.exists(text):
        if filename is not None or revision is not None:
            given = "filename=" if filename is not None else "revision="
            raise InvalidOptionError(f"{given} chooses among a Hub repository's files, but {text} is a local path")
        return text
    name = _parse(text)
    if name is None:
        if filename is not None or revision is not None:
            raise InvalidOptionError(f"there is no local path {text}, and it is not a Hub name (org/name[:TAG]) "
                                     "that filename= or revision= could apply to")
        return text
    repo_id, tag = name
    if tag is not None and filename is not None:
        raise InvalidOptionError(f"{text}: give the quantization either as :{tag} or as filename=, not both")
    hub = _hub()
    if _offline(hub):
        return _from_cache(hub, repo_id, tag, filename, revision, "HF_HUB_OFFLINE is set")

    try:
        info = hub.HfApi().model_info(repo_id, revision=revision)
    except Exception as e:
        typed = _repo_error(hub, e, repo_id, None, revision)
        if typed is not None:
            raise typed from e
        if _unreachable(hub, e):
            return _from_cache(hub, repo_id, tag, filename, revision,
                               f"the Hub cannot be reached at {_endpoint(hub)} ({_cause(e)})")
        raise HubError(f"listing {repo_id}'s files failed: {_cause(e)}", repo_id) from e
    files = [s.rfilename for s in (info.siblings or [])]

    def read_index() -> dict:
        path = _download(hub, lambda: hub.hf_hub_download(repo_id, _INDEX, revision=revision), repo_id, [_INDEX],
                         revision)
        return json.loads(Path(path).read_text())

    choice = _choose(repo_id, files, tag, filename, read_index)
    folder = _download(
        hub,
        lambda: hub.snapshot_download(repo_id, revision=revision, allow_patterns=[_escape(f) for f in choice.files]),
        repo_id, choice.files, revision)
    missing = [f for f in choice.files if not (Path(folder) / f).is_file()]
    if missing:
        # The listing and the download saw different commits (a push in between).
        raise DownloadError(f"{repo_id}: {', '.join(missing)} missing after the download (the repository changed "
                            "meanwhile?); run it again", repo_id, missing[0])
    return str(Path(folder) / choice.model_file) if choice.model_file else str(folder)


def _download(hub: Any, fetch: Callable[[], Any], repo_id: str, files: list[str], revision: Optional[str]) -> str:
    """Runs `fetch` (a huggingface_hub download of `files`) and returns its path, each failure
    as its typed error."""
    shown = files[0] if len(files) == 1 else f"{len(files)} files ({', '.join(files)})"
    try:
        return str(fetch())
    except Exception as e:
        typed = _repo_error(hub, e, repo_id, files[0] if len(files) == 1 else None, revision)
        if typed is not None:
            raise typed from e
        raise DownloadError(f"downloading {shown} from {repo_id} failed: {_cause(e)}; what arrived is not used, "
                            "run it again to fetch the rest", repo_id, files[0]) from e


# --- listing the cache -----------------------------------------------------------------------

def cached_models() -> list[CachedModel]:
    """The models in huggingface_hub's cache that ``resolve_model`` can load from it: each GGUF
    quantization (``org/name:TAG``) and each safetensors checkpoint (``org/name``), per cached
    revision. Reads the cache only; no request is made."""
    hub = _hub()
    try:
        info = hub.scan_cache_dir()
    except hub.utils.CacheNotFound:
        return []
    out: list[CachedModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: (-r.last_modified, r.commit_hash)):
            sizes = {Path(f.file_path).relative_to(rev.snapshot_path).as_posix(): f.size_on_disk for f in rev.files}
            label = ", ".join(sorted(rev.refs)) or rev.commit_hash
            pinned = "" if "main" in rev.refs else f" (revision {label})"
            files = sorted(sizes)
            for unit in _units(files):
                tag = _tag_of(unit[0])
                split = _SPLIT.match(unit[0])
                if split and len(unit) != int(split.group(3)):
                    continue  # a split file with parts missing does not load
                name = f"{repo.repo_id}:{tag}" if tag else f"{repo.repo_id} (filename={unit[0]!r})"
                out.append(CachedModel(name + pinned, label, sum(sizes[f] for f in unit), tuple(unit),
                                       str(rev.snapshot_path / unit[0])))
            if _is_safetensors_repo(files):
                try:
                    weights = _safetensors_weights(
                        repo.repo_id, files, lambda: json.loads((rev.snapshot_path / _INDEX).read_text()))
                except (HubError, OSError, ValueError):
                    continue
                if all(w in sizes for w in weights):
                    kept = [f for f in files if f in _SIDE_FILES or f in weights]
                    out.append(CachedModel(repo.repo_id + pinned, label, sum(sizes[f] for f in kept), tuple(kept),
                                           str(rev.snapshot_path)))
    return out
